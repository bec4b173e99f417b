"""Router configuration, read once and validated in one place.

``validate`` is the single step where defaults follow from each other and
contradictions fail with a message that says what to change:
- DP-aware routing is on unless turned off (``auto``: ranks are targets
  whenever an engine runs DP); turning it off is allowed but warns loudly;
- a session setup (routing keys) with no policy named means ``manual`` with
  ``min_load`` assignment;
- options that only make sense with another option are rejected without it.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dprouter.core.errors import ConfigError
from dprouter.core.tls import EngineAccess
from dprouter.core.tracing import missing_modules
from dprouter.core.types import PD_MODES, DispatchMode, DpAware, PdMode, Role, SamplesMode
from dprouter.fleet.breakers import BreakerOptions
from dprouter.fleet.membership import Source
from dprouter.fleet.membership.labels import Selector, parse_selector
from dprouter.fleet.membership.pods import PodRules
from dprouter.fleet.model_lists import ListOptions
from dprouter.fleet.monitor import Monitor, MonitorOptions
from dprouter.fleet.registry import Registry
from dprouter.fleet.worker_spec import (
    WorkerSpec,
    check_types,
    check_worker,
    worker_from_mapping,
)
from dprouter.policies import POLICIES, PolicyOptions

# The defaults of options that configure a component are the component's own, stated there
# (what each means is said there too); the command line's are these fields' (cli/serve.py).
POLICY, MONITOR, BREAKER, LISTS = PolicyOptions(), MonitorOptions(), BreakerOptions(), ListOptions()


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[WorkerSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str | None = None  # None: chosen by validate()
    assignment: str | None = None  # manual's assignment mode
    sessions: bool = False  # clients send routing keys: sticky sessions wanted
    dp_aware: DpAware = "auto"
    trust_client_rank: bool = False
    forward_authorization: bool = False  # pass clients' Authorization on to the engines
    seed: int = POLICY.seed
    key_ttl: float = POLICY.key_ttl
    session_bound: float = POLICY.session_bound
    # a request's output counted as min(max_tokens, the typical length learned), or its cap
    output_budget: str = "typical"
    cache_threshold: float = POLICY.cache_threshold
    cache_bound: float = POLICY.cache_bound
    max_body: int = 32 << 20
    backlog: int = 4096
    attempts: int = 3  # tries per request before the first byte, each on another target
    upstream_keepalive: float = 3.0  # below the engines' own (uvicorn: 5 s)
    upstream_connections: int = 4096  # open to all workers at once, at most
    upstream_per_worker: int = 1024  # open to one worker at once, at most
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # no byte from the engine for this long: the attempt failed
    max_concurrent: int = 0  # requests in flight at once; 0: no cap
    queue_size: int = 1024  # beyond the cap, requests waiting for a slot at most
    queue_timeout: float = 30.0  # seconds one waits for a slot before a 429
    retry_backoff: float = 0.02  # seconds before the 2nd attempt, doubling, at most 1 s
    total_timeout: float = 0.0  # seconds one attempt may take in all, stream included; 0: none
    breaker_failures: int = BREAKER.failures
    breaker_cooldown: float = BREAKER.cooldown
    health_interval: float = MONITOR.health_interval
    health_failures: int = MONITOR.health_failures
    health_successes: int = MONITOR.health_successes
    health_timeout: float = MONITOR.health_timeout
    version_interval: float = MONITOR.version_interval  # reads of the weights' versions
    # seconds between reads of each worker's /v1/models (its LoRA adapters); 0: never
    models_interval: float = LISTS.interval
    first_byte_timeout: float = 0.0  # seconds to the answer's headers; 0: --read-timeout
    grace: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    # seconds between scrapes of engine-reported load; 0: off; None: 1, or 0.25 with
    # --discovery (a replica sees the others' requests only in the engines' reports)
    load_interval: float | None = None
    startup_timeout: float = 10.0  # serve waits this long for discovery, then checks workers
    # None: the admin API (workers, engine commands) is open to loopback, this host's own
    # addresses and admin_from only (server/trust.py)
    admin_token: str | None = None
    admin_from: tuple[str, ...] = ()  # without a token: networks (CIDR) the admin API trusts
    # -- the front door (docs/security.md) --
    # tenants: their API keys (or the environment variables holding them), role, priority
    # class, weight and limits, as a YAML file; None: no keys (the data plane is open)
    tenants: str | None = None
    # JWT bearer tokens, verified against the issuer's keys (JWKS: its URL, or None: the
    # issuer's OpenID discovery document names it); iss, aud and exp are checked
    jwt_issuer: str | None = None
    jwt_jwks: str | None = None
    jwt_audience: str | None = None
    jwt_tenant_claim: str = "sub"  # the claim naming the caller's tenant
    jwt_role_claim: str = "role"  # a claim of "admin" (or a list holding it): the admin role
    # priority classes, highest first: a request's is its tenant's, or the X-Priority header's
    # when its tenant may set it; the lowest is shed first when the router's queue is full
    classes: tuple[str, ...] = ("high", "normal", "low")
    # requests held in the router (the dispatcher's queue) at most; 0: no bound
    dispatch_queue: int = 0
    # requests a rank may queue beyond its running slots before the router holds new ones
    engine_queue: int = 0
    # running slots per rank only the highest class may take: it finds one free at once
    reserve: int = 0
    # the share of its KV capacity (0 to 1) at which a rank takes no more requests (held in
    # the router): the tokens its engine last reported, plus those sent since; 0: no bound
    engine_kv: float = 0.0
    # HTTPS: the router's certificate chain and key (PEM), reloaded on SIGHUP
    tls_cert: str | None = None
    tls_key: str | None = None
    # to the engines: a CA bundle for their certificates, a client certificate and key
    # (mTLS), and the API key sent as Authorization: Bearer (a worker's own api_key wins)
    engine_ca: str | None = None
    engine_cert: str | None = None
    engine_key: str | None = None
    engine_api_key: str | None = None
    # SGLang's --admin-api-key, for its admin endpoints (engine commands, aborts), which
    # then take no other key (a worker's own admin_key wins)
    engine_admin_key: str | None = None
    # OpenTelemetry traces, exported over OTLP as OTEL_EXPORTER_OTLP_* say; off: no cost
    tracing: bool = False
    # seconds a request waits while every worker that could serve it is paused or updating
    # its weights (or has not reached the version it asks for) before a 503
    hold_wait: float = 60.0
    # etcd: seconds a hold relayed by this replica outlives it (killed, stopped, cut off
    # from etcd) in the others; the lease its holds are written on
    hold_lease: int = 10
    # hold requests in the router while every rank's running slots are taken, longest
    # predicted first (proxy/dispatch.py); auto: where the engines report their caps
    dispatch: DispatchMode = "auto"
    dispatch_slots: int = 0  # running slots per rank when the engines do not say; 0: theirs
    dispatch_wait: float = 600.0  # seconds a request may be held before a 503
    dispatch_aging: float = 100.0  # tokens of priority a second of waiting is worth
    # a request sampling n sequences: all on one target, as the engine runs them; split:
    # routed as its n samples would be, one request to each target reached, answered as
    # one (proxy/samples.py; bench samples: evener lock-step steps, fewer prompt hits)
    samples: SamplesMode = "together"
    dashboard: bool = False  # /dashboard and /dashboard/data; behind the admin role
    pd: PdMode | None = None  # P/D disaggregation flow, chosen once; None: regular workers
    prefill_policy: str | None = None  # None: --policy (round_robin)
    decode_policy: str | None = None
    registration: str = "tcp://127.0.0.1:36367"  # MoRIIO engines register here (ZMQ)
    heartbeat_timeout: float = 10.0  # MoRIIO: an instance silent this long is expired
    processes: int | str = 1  # serving processes on the port; "auto": one per core
    # GET /metrics on a port of its own as well (0: any free one); None: on --port only
    metrics_port: int | None = None
    metrics_host: str | None = None  # where that port listens; None: --host
    discovery: str | None = None  # etcd://HOST:PORT[,HOST:PORT...]/PREFIX, or k8s: pods
    # --discovery k8s: engine pods by label selector (docs/kubernetes.md)
    selector: str | None = None  # applied by the API server: k=v[,k=v]
    namespace: str | None = None  # None: the router pod's own, or the kubeconfig context's
    pod_port: int | None = None  # the engine's port in each pod; None: the ports annotation
    prefill_selector: str | None = None  # --pd: pods matching it are prefill workers...
    decode_selector: str | None = None  # ...and these decode workers
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"  # SGLang prefill pods
    kubeconfig: str | None = None  # outside a pod; None: $KUBECONFIG or ~/.kube/config
    resync: float = 60.0  # seconds between whole re-lists of the pods, whatever the watch said
    # each model's tokenizer directory, as [MODEL=]DIR (no MODEL: any model without its own)
    tokenizers: tuple[str, ...] = ()
    kv_capacity: int = 4_000_000  # blocks the KV-event index holds at most, over all ranks
    prefix_weight: float = POLICY.prefix_weight  # prefix: the score's (docs/kv-events.md)
    prefix_bound: float = POLICY.prefix_bound
    load_weight: float = POLICY.load_weight
    token_weight: float = POLICY.token_weight
    queue_weight: float = POLICY.queue_weight
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def process_count(self) -> int:
        if self.processes == "auto":
            return len(os.sched_getaffinity(0))
        return int(self.processes)

    @property
    def policy_name(self) -> str:
        return self.policy or "round_robin"

    def role_policy(self, role: Role) -> str:
        chosen = {"prefill": self.prefill_policy, "decode": self.decode_policy}.get(role)
        return chosen or self.policy_name

    def engine_access(self) -> EngineAccess:
        """The TLS context and keys every call to an engine carries (made once)."""
        return EngineAccess.load(
            self.engine_ca,
            self.engine_cert,
            self.engine_key,
            self.engine_api_key,
            self.engine_admin_key,
        )

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(
            seed=self.seed,
            assignment=self.assignment or "random",  # type: ignore[arg-type]
            key_ttl=self.key_ttl,
            session_bound=self.session_bound,
            cache_threshold=self.cache_threshold,
            cache_bound=self.cache_bound,
            prefix_weight=self.prefix_weight,
            prefix_bound=self.prefix_bound,
            load_weight=self.load_weight,
            token_weight=self.token_weight,
            queue_weight=self.queue_weight,
        )

    def tokenizer_dirs(self) -> dict[str | None, Path]:
        """Tokenizer directories by model (None: the one for any other model)."""
        found: dict[str | None, Path] = {}
        for text in self.tokenizers:
            model, sep, directory = text.rpartition("=")
            found[model if sep else None] = Path(directory)
        return found

    def monitor_options(self) -> MonitorOptions:
        load_interval = validate(self).load_interval  # its default depends on --discovery
        assert load_interval is not None
        return MonitorOptions(
            scrape_interval=load_interval,
            health_interval=self.health_interval,
            health_failures=self.health_failures,
            health_successes=self.health_successes,
            health_timeout=self.health_timeout,
            version_interval=self.version_interval,
        )

    def list_options(self) -> ListOptions:
        return ListOptions(interval=self.models_interval)

    def breaker_options(self) -> BreakerOptions:
        return BreakerOptions(self.breaker_failures, self.breaker_cooldown)

    def check_new_worker(self, spec: WorkerSpec) -> WorkerSpec:
        """A worker joining the running router (the admin API, etcd), checked against its
        configuration as a listed one is: a ``--pd`` router takes prefill and decode
        workers, not regular ones. ``ConfigError`` says why not."""
        return validate(replace(self, workers=(spec,))).workers[0]

    def pod_rules(self) -> PodRules:
        """Which workers a pod is (``--discovery k8s``)."""

        def selector(text: str | None) -> Selector | None:
            return parse_selector(text) if text else None

        return PodRules(
            self.pod_port,
            selector(self.prefill_selector),
            selector(self.decode_selector),
            self.bootstrap_port_annotation,
        )


def validate(config: RouterConfig) -> RouterConfig:
    check_types(config, "")
    if config.dp_aware not in ("auto", "off"):
        raise ConfigError(f"dp_aware must be auto or off, got {config.dp_aware!r}")
    warnings = list(config.warnings)
    policy, assignment = config.policy, config.assignment
    if policy is not None and policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if assignment is not None and assignment not in ("random", "min_load", "min_group"):
        raise ConfigError(f"unknown assignment {assignment!r}; use random, min_load or min_group")
    if config.sessions and policy is None:
        policy, assignment = "manual", assignment or "min_load"  # the session-server default
    if assignment is not None and policy is None:
        policy = "manual"
    if assignment is not None and policy != "manual":
        raise ConfigError(
            f"--assignment places new keys for --policy manual, not {policy}; "
            "drop --assignment or use --policy manual"
        )
    if config.dp_aware == "off":
        if policy == "min_tokens":
            raise ConfigError(
                "min_tokens balances the ranks of each engine: use --dp-aware auto, "
                "or another policy"
            )
        warnings.append(
            "DP-aware routing is OFF: requests name no rank and each engine's own balancer "
            "places them, which can queue on one rank while others idle. Use --dp-aware auto."
        )
    if config.attempts < 1:
        raise ConfigError("--attempts must be at least 1")
    processes = config.processes
    if isinstance(processes, str) and processes != "auto":
        if not processes.isdigit():
            raise ConfigError(f"processes must be a number or auto, got {processes!r}")
        processes = int(processes)
    if isinstance(processes, int) and not 1 <= processes <= 256:
        raise ConfigError(f"processes must be 1 to 256, got {processes}")
    for name in (
        "max_concurrent",
        "queue_size",
        "queue_timeout",
        "grace",
        "breaker_failures",
        "breaker_cooldown",
        "health_interval",
        "health_timeout",
        "version_interval",
        "models_interval",
        "first_byte_timeout",
        "retry_backoff",
        "total_timeout",
        "read_timeout",
        "key_ttl",
        "session_bound",
        "cache_bound",
        "startup_timeout",
        "hold_wait",
        "dispatch_slots",
        "dispatch_wait",
        "dispatch_aging",
        "dispatch_queue",
        "engine_queue",
        "reserve",
    ):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)}")
    check_metrics_port(config)
    for name in ("connect_timeout", "heartbeat_timeout", "backlog", "max_body"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")
    check_prefix(config)
    check_door(config)
    admin_networks(config.admin_from)
    if config.dispatch not in ("auto", "off"):
        raise ConfigError(f"dispatch must be auto or off, got {config.dispatch!r}")
    if config.samples not in ("split", "together"):
        raise ConfigError(f"samples must be split or together, got {config.samples!r}")
    if config.output_budget not in ("typical", "cap"):
        raise ConfigError(f"output_budget must be typical or cap, got {config.output_budget!r}")
    if not 0 <= config.cache_threshold <= 1:
        raise ConfigError(f"cache_threshold must be in [0, 1], got {config.cache_threshold}")
    if config.health_failures < 1 or config.health_successes < 1:
        raise ConfigError("health_failures and health_successes must be at least 1")
    for name in ("prefill_policy", "decode_policy"):
        chosen = getattr(config, name)
        if chosen is not None and chosen not in POLICIES:
            raise ConfigError(f"unknown {name} {chosen!r}; choose one of {', '.join(POLICIES)}")
    if config.pd is not None and config.pd not in PD_MODES:
        raise ConfigError(f"--pd must be one of {', '.join(PD_MODES)}, got {config.pd!r}")
    if config.pd in ("sglang", "vllm-moriio", "vllm-mooncake") and config.dp_aware == "off":
        raise ConfigError(
            f"--pd {config.pd} tells the decode which prefill rank holds the KV, so the router "
            "must choose that rank: drop --dp-aware off"
        )
    workers = [check_worker(spec) for spec in config.workers]
    roles = {w.role for w in workers}
    if config.pd is None and roles - {"regular"}:
        raise ConfigError("prefill and decode workers need a P/D flow: add --pd")
    if config.pd is not None and "regular" in roles:
        raise ConfigError(f"with --pd {config.pd} every worker is --prefill or --decode")
    if config.pd == "vllm-moriio" and workers:
        raise ConfigError(
            "MoRIIO instances register themselves over ZMQ (their handshake addresses come "
            f"with it): point them at --registration {config.registration}, list no workers"
        )
    load_interval = config.load_interval
    if load_interval is None:
        load_interval = 1.0 if config.discovery is None else 0.25
    if load_interval < 0:
        raise ConfigError(f"load_interval must be >= 0, got {load_interval}")
    if config.discovery == KUBERNETES:
        check_kubernetes(config)
    else:
        if config.discovery is not None:
            parse_discovery(config.discovery)
        given = [f"--{n.replace('_', '-')}" for n in KUBERNETES_OPTIONS if _changed(config, n)]
        if given:
            raise ConfigError(f"{', '.join(given)} only with --discovery k8s")
    if _changed(config, "hold_lease") and not (config.discovery or "").startswith("etcd://"):
        raise ConfigError("--hold-lease only with --discovery etcd://...: holds shared there")
    if config.hold_lease < 2:
        raise ConfigError(f"hold_lease must be >= 2 (etcd's least), got {config.hold_lease}")
    urls = [w.url for w in workers]
    for url in urls:
        if urls.count(url) > 1:
            raise ConfigError(f"worker {url} is listed twice")
    return replace(
        config,
        policy=policy,
        assignment=assignment,
        workers=tuple(workers),
        warnings=tuple(warnings),
        processes=processes,
        load_interval=load_interval,
        tokenizers=tuple(config.tokenizers),
        admin_from=tuple(config.admin_from),
    )


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def admin_networks(given: Sequence[str]) -> tuple[Network, ...]:
    """``--admin-from``: the networks, each a CIDR or one address."""
    if not isinstance(given, tuple | list) or not all(isinstance(n, str) for n in given):
        raise ConfigError(f"admin_from must be a list of networks (CIDR), got {given!r}")
    try:
        return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in given)
    except ValueError as exc:
        raise ConfigError(f"admin_from: {exc}") from None


def check_metrics_port(config: RouterConfig) -> None:
    port = config.metrics_port
    if port is None:
        if config.metrics_host is not None:
            raise ConfigError("--metrics-host needs --metrics-port")
        return
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics_port must be 0 to 65535, got {port}")
    if port != 0 and port == config.port and (config.metrics_host or config.host) == config.host:
        raise ConfigError(
            f"--metrics-port {port} is --port: /metrics is served there anyway; drop it"
        )


def check_prefix(config: RouterConfig) -> None:
    if not isinstance(config.tokenizers, tuple | list) or not all(
        isinstance(t, str) and t for t in config.tokenizers
    ):
        raise ConfigError(f"tokenizers must be a list of [MODEL=]DIR, got {config.tokenizers!r}")
    for model, directory in config.tokenizer_dirs().items():
        if not (directory / "tokenizer.json").is_file():
            name = "" if model is None else f" of {model}"
            raise ConfigError(f"tokenizer{name}: no tokenizer.json in {directory}")
    uses = {config.policy, config.prefill_policy, config.decode_policy}
    if "prefix" in uses and not config.tokenizers:
        raise ConfigError(
            "--policy prefix matches a prompt's tokens against the engines' KV events: give "
            "--tokenizer [MODEL=]DIR (the model's tokenizer.json) and kv_events= on the workers"
        )
    if config.kv_capacity < 1:
        raise ConfigError(f"kv_capacity must be at least 1, got {config.kv_capacity}")
    for name in ("prefix_weight", "prefix_bound", "load_weight", "token_weight", "queue_weight"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)}")


def check_door(config: RouterConfig) -> None:
    """The front door's options (docs/security.md): what goes in pairs, and classes."""
    for cert, key, what in (
        ("tls_cert", "tls_key", "serving HTTPS"),
        ("engine_cert", "engine_key", "a client certificate to the engines"),
    ):
        if (getattr(config, cert) is None) != (getattr(config, key) is None):
            raise ConfigError(
                f"{what} needs both --{cert.replace('_', '-')} and --{key.replace('_', '-')}"
            )
    if not 0.0 <= config.engine_kv <= 1.0:
        raise ConfigError(f"--engine-kv is a share of the KV cache, 0 to 1, got {config.engine_kv}")
    classes = config.classes
    if not classes or len(set(classes)) != len(classes) or not all(c.strip() for c in classes):
        raise ConfigError(f"--classes must name distinct classes, highest first, got {classes!r}")
    if config.forward_authorization and (config.tenants or config.jwt_issuer):
        raise ConfigError(
            "--forward-authorization would send clients' credentials for the router (their "
            "--tenants keys or JWTs) on to the engines: drop it, and give the engines "
            "--engine-api-key"
        )
    if config.jwt_issuer is None and (config.jwt_jwks or config.jwt_audience):
        raise ConfigError("--jwt-jwks and --jwt-audience need --jwt-issuer")
    if config.tracing and (absent := missing_modules()):
        raise ConfigError(
            f"--tracing needs OpenTelemetry's SDK and OTLP exporter (no {absent[0]} here): "
            "install the tracing extra, pip install 'dprouter[tracing]' (from a checkout: "
            "pip install '.[tracing]')"
        )


KUBERNETES = "k8s"
KUBERNETES_OPTIONS = (
    "selector",
    "namespace",
    "pod_port",
    "prefill_selector",
    "decode_selector",
    "bootstrap_port_annotation",
    "kubeconfig",
    "resync",
)


def _changed(config: RouterConfig, name: str) -> bool:
    return bool(getattr(config, name) != RouterConfig.__dataclass_fields__[name].default)


def check_kubernetes(config: RouterConfig) -> None:
    if config.pd == "vllm-moriio":
        raise ConfigError("MoRIIO instances register themselves: drop --discovery k8s")
    for name in ("selector", "prefill_selector", "decode_selector"):
        text = getattr(config, name)
        if text is not None:
            try:
                parse_selector(text)
            except ValueError as exc:
                raise ConfigError(f"--{name.replace('_', '-')}: {exc}") from None
    roles = config.prefill_selector is not None, config.decode_selector is not None
    if config.pd is None and any(roles):
        raise ConfigError("--prefill-selector and --decode-selector name P/D roles: add --pd")
    if config.pd is not None and not all(roles):
        raise ConfigError(
            f"--pd {config.pd} with --discovery k8s: give --prefill-selector and "
            "--decode-selector (which pods are which)"
        )
    if config.selector is None and config.pd is None:
        raise ConfigError("--discovery k8s needs --selector (the engine pods' labels)")
    if config.pod_port is not None and not 1 <= config.pod_port <= 65535:
        raise ConfigError(f"--pod-port must be 1 to 65535, got {config.pod_port}")
    if config.resync <= 0:
        raise ConfigError(f"resync must be > 0, got {config.resync}")
    if not config.bootstrap_port_annotation:
        raise ConfigError("--bootstrap-port-annotation must name an annotation")


def parse_discovery(url: str) -> tuple[list[str], str]:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` -> (endpoint URLs, key prefix ending in /)."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ConfigError(
            f"discovery {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX or k8s"
        )
    prefix = parts.path.rstrip("/") + "/"
    if prefix == "/":
        raise ConfigError(f"discovery {url!r}: name a key prefix, e.g. etcd://HOST:2379/dprouter")
    return [f"http://{host}" for host in parts.netloc.split(",") if host], prefix


def load_file(path: Path) -> dict[str, Any]:
    """A TOML file: top-level router options and ``[[workers]]`` tables."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    options = {k.replace("-", "_"): v for k, v in data.items() if k != "workers"}
    known = set(RouterConfig.__dataclass_fields__) - {"workers", "warnings"}
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"{path}: unknown options {sorted(unknown)}")
    workers = data.get("workers", [])
    if not isinstance(workers, list):
        raise ConfigError(f"{path}: workers must be an array of tables ([[workers]])")
    options["workers"] = tuple(worker_from_mapping(dict(w)) for w in workers)
    return options


def sources(config: RouterConfig, registry: Registry, monitor: Monitor) -> list[Source]:
    """The membership sources the configuration names (besides its own list of workers):
    the one place they are chosen, for a router alone and the control plane alike."""
    if config.discovery is None:
        return []
    if config.discovery == KUBERNETES:
        from dprouter.fleet.membership.kubeconfig import access
        from dprouter.fleet.membership.kubernetes import KubernetesMembership

        found = access(config.kubeconfig)  # a bad kubeconfig fails here, at start-up
        rules = config.pod_rules()
        return [
            KubernetesMembership(
                found, registry, monitor, rules, config.namespace, config.selector, config.resync
            )
        ]
    from dprouter.fleet.membership.etcd import EtcdMembership
    from dprouter.fleet.membership.etcd_holds import EtcdHolds

    endpoints, prefix = parse_discovery(config.discovery)
    workers = EtcdMembership(endpoints, prefix, registry, monitor, config.check_new_worker)
    # the holds first: read before any worker joins (started in this order)
    return [EtcdHolds(workers, registry, config.hold_lease), workers]
