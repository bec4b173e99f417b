"""``dprouter serve``: the command line over ``RouterConfig`` and ``Router``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
from click.decorators import FC

from dprouter.cli import stopped_early
from dprouter.config import RouterConfig, load_file, validate
from dprouter.core import gc_tuning
from dprouter.core.errors import ConfigError
from dprouter.core.types import PD_MODES, ROLES
from dprouter.fleet.worker_spec import parse_worker
from dprouter.multiproc.supervisor import Supervisor
from dprouter.policies import POLICIES
from dprouter.server.identity import Identity
from dprouter.server.router import Router

log = logging.getLogger("dprouter")
T = TypeVar("T")


def option(flag: str, name: str | None = None, **kw: Any) -> Callable[[FC], FC]:
    """An option of ``RouterConfig``: its default is the field's, stated there alone, and
    shown in ``--help`` (a flag's and an unset one's are not)."""
    field = name or flag.lstrip("-").replace("-", "_")
    default = RouterConfig.__dataclass_fields__[field].default
    if field == "processes":
        default = str(default)  # N or auto: the option takes text
    if field == "classes":
        default = ",".join(RouterConfig().classes)  # one text, split by the option's callback
    show = default is not None and not kw.get("is_flag", False) and default != ()
    return click.option(flag, field, default=default, show_default=show, **kw)


def make_config(
    ctx: click.Context, config_file: Path | None, workers: tuple[str, ...], options: dict[str, Any]
) -> RouterConfig:
    """File values first; options given on the command line override them."""
    values: dict[str, Any] = load_file(config_file) if config_file else {}
    by_role = [
        parse_worker(w, role) for role in ("prefill", "decode") for w in options.pop(f"{role}s")
    ]
    for name, value in options.items():
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            values[name] = value
        else:
            values.setdefault(name, value)
    listed = (*(parse_worker(w) for w in workers), *by_role)
    values["workers"] = (*values.get("workers", ()), *listed)
    return validate(RouterConfig(**values))


@click.command()
@click.option(
    "--worker",
    "workers",
    multiple=True,
    metavar="URL[,key=value...]",
    help="An engine endpoint; keys: id, dialect, dp_size, role, model, rank_offset, "
    "bootstrap_port, tp_size, kv_events (tcp://HOST:PORT, rank r on PORT + r, or auto), "
    "kv_replay.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, path_type=Path),
    help="TOML file with router options and [[workers]] tables.",
)
@option(
    "--discovery",
    metavar="etcd://HOST:PORT[,HOST:PORT...]/PREFIX|k8s",
    help=(
        "Also take workers from etcd (one key per worker under PREFIX; see dprouter register) or "
        "from Kubernetes pods (k8s)."
    ),
)
@option(
    "--selector",
    metavar="K=V[,K=V...]",
    help="k8s: label selector of the engine pods (applied by the API server).",
)
@option(
    "--namespace",
    help="k8s: the pods' namespace (default: the router pod's own, or the kubeconfig context's).",
)
@option(
    "--pod-port",
    type=click.IntRange(1, 65535),
    help="k8s: the engine's port in each pod (default: the pod's dprouter/ports annotation).",
)
@option(
    "--prefill-selector",
    metavar="K=V[,K=V...]",
    help="k8s with --pd: pods matching it are prefill workers.",
)
@option(
    "--decode-selector",
    metavar="K=V[,K=V...]",
    help="k8s with --pd: pods matching it are decode workers.",
)
@option(
    "--bootstrap-port-annotation",
    help="k8s: the pod annotation holding an SGLang prefill's bootstrap port.",
)
@option(
    "--kubeconfig",
    metavar="FILE",
    help="k8s outside a pod: the kubeconfig (default $KUBECONFIG, else ~/.kube/config).",
)
@option(
    "--resync",
    type=click.FloatRange(min=0, min_open=True),
    help="k8s: seconds between whole re-lists of the pods, whatever the watch said.",
)
@option("--pd", type=click.Choice(PD_MODES), help="Prefill/decode disaggregation flow.")
@click.option(
    "--prefill",
    "prefills",
    multiple=True,
    metavar="URL[,key=value...]",
    help=(
        "A prefill engine (SGLang: bootstrap_port=N unless /server_info says; "
        "vLLM Mooncake: bootstrap_port=N unless 8998)."
    ),
)
@click.option(
    "--decode", "decodes", multiple=True, metavar="URL[,key=value...]", help="A decode engine."
)
@option(
    "--prefill-policy",
    type=click.Choice(list(POLICIES)),
    help="P/D: policy over prefill targets (default --policy).",
)
@option(
    "--decode-policy",
    type=click.Choice(list(POLICIES)),
    help="P/D: policy over decode targets (default --policy).",
)
@option("--registration", help="MoRIIO: the ZMQ address instances register at.")
@option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="MoRIIO: expire an instance silent this long.",
)
@option("--host", help="Address to listen on.")
@option(
    "--port",
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port; the log says which).",
)
@option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Also serve GET /metrics alone on this port (0: any free one), for a scraper kept "
    "off the traffic port.",
)
@option("--metrics-host", help="Address the --metrics-port listens on (default: --host).")
@option(
    "--processes",
    metavar="N|auto",
    help="Serving processes on the port, sharing one view of load (auto: one per core).",
)
@option(
    "--policy",
    type=click.Choice(list(POLICIES)),
    help="Default round_robin (manual with --sessions).",
)
@option(
    "--assignment",
    type=click.Choice(["random", "min_load", "min_group"]),
    help="How manual places a new routing key.",
)
@option(
    "--tokenizer",
    "tokenizers",
    multiple=True,
    metavar="[MODEL=]DIR",
    help=(
        "A model's tokenizer directory (tokenizer.json, tokenizer_config.json), loaded at start-up,"
        " never from a hub; without MODEL= for any model without its own. For --policy prefix."
    ),
)
@option(
    "--kv-capacity",
    type=click.IntRange(min=1),
    help="prefix: blocks the KV-event index holds at most, over all ranks (~200 B each).",
)
@option(
    "--cache-threshold",
    type=click.FloatRange(0, 1),
    help="cache_aware: least share of the prompt a target's remembered prefix must cover.",
)
@option(
    "--cache-bound",
    type=click.FloatRange(min=0),
    help="cache_aware: affinity holds while the target's load <= this x (mean load + 1).",
)
@option(
    "--prefix-weight",
    type=click.FloatRange(min=0),
    help="prefix: worth of a target holding the whole prompt (docs/kv-events.md).",
)
@option(
    "--prefix-bound",
    type=click.FloatRange(min=0),
    help="prefix: a held prefix counts while the target's load <= this x (mean load + 1).",
)
@option(
    "--load-weight",
    type=click.FloatRange(min=0),
    help="prefix: cost of requests in flight, relative to the mean + 1.",
)
@option(
    "--token-weight",
    type=click.FloatRange(min=0),
    help="prefix: cost of tokens in flight, relative to the mean + the prompt's.",
)
@option(
    "--queue-weight",
    type=click.FloatRange(min=0),
    help="prefix: cost of prefill sent to a target and not yet stored, in prompts like this one.",
)
@option("--sessions", is_flag=True, help="Clients send routing keys: keep them sticky.")
@option(
    "--dp-aware",
    type=click.Choice(["auto", "off"]),
    help="Route to ranks of DP engines (off: engines pick).",
)
@option("--trust-client-rank", is_flag=True, help="Keep rank headers/fields clients send.")
@option(
    "--forward-authorization",
    is_flag=True,
    help="Pass clients' Authorization header on to the engines.",
)
@option("--seed", type=int, help="Seed of the random policies' choices.")
@option(
    "--key-ttl",
    type=click.FloatRange(min=0),
    help="manual: forget a routing key idle this many seconds.",
)
@option(
    "--session-bound",
    type=click.FloatRange(min=0),
    help=(
        "manual: a routing key moves off its target once that target's load reaches this many times"
        " the mean load + 2 (0: keys never move for load)."
    ),
)
@option(
    "--output-budget",
    type=click.Choice(["typical", "cap"]),
    help=(
        "The output tokens a request is counted by (min_tokens, prefix, token load): "
        "min(max_tokens, the typical length of the answers seen), or max_tokens as sent (for "
        "clients whose max_tokens is the length they expect)."
    ),
)
@option(
    "--dispatch",
    type=click.Choice(["auto", "off"]),
    help=(
        "auto: while every rank's running slots are taken (as the engine reports them, or "
        "--dispatch-slots), requests wait in the router and go to the first rank that frees "
        "one, the longest predicted first; off: every request goes to an engine at once."
    ),
)
@option(
    "--dispatch-slots",
    type=click.IntRange(min=0),
    help="Running slots per rank for engines that do not report theirs (vLLM: its "
    "max_num_seqs / DP); 0: the engines' own.",
)
@option(
    "--dispatch-wait",
    type=click.FloatRange(min=0),
    help="Seconds a request may wait in the router for a slot before a 503.",
)
@option(
    "--dispatch-aging",
    type=click.FloatRange(min=0),
    help="Tokens of priority a second of waiting is worth, so that nothing starves.",
)
@option(
    "--samples",
    type=click.Choice(["split", "together"]),
    help=(
        "A request sampling n sequences: together on one target, as the engine runs them; "
        "split (not streamed, no seed): routed as its n samples would be, one request to "
        "each target reached, the answers merged (evener lock-step steps, fewer prompt hits)."
    ),
)
@option(
    "--max-body", type=click.IntRange(min=1), help="Largest request body in bytes (413 beyond)."
)
@option(
    "--backlog",
    type=click.IntRange(min=1),
    help="Listen backlog: a burst queues here instead of being reset.",
)
@option(
    "--attempts",
    type=click.IntRange(min=1),
    help="Tries per request before its first byte, each on another target.",
)
@option(
    "--retry-backoff",
    type=click.FloatRange(min=0),
    help="Seconds before a second attempt, doubling per attempt, jittered, at most 1 s.",
)
@option(
    "--total-timeout",
    type=click.FloatRange(min=0),
    help="Seconds one attempt may take in all, a stream included (0: no limit).",
)
@option(
    "--max-concurrent",
    type=click.IntRange(min=0),
    help="Requests in flight at once (0: no cap); beyond it they queue.",
)
@option(
    "--queue-size",
    type=click.IntRange(min=0),
    help="Requests waiting for a slot at most; beyond it: 429 with Retry-After.",
)
@option(
    "--queue-timeout",
    type=click.FloatRange(min=0),
    help="Seconds a queued request waits for a slot before a 429.",
)
@option(
    "--breaker-failures",
    type=click.IntRange(min=0),
    help="Consecutive failures that take a target (one rank) out (0: never).",
)
@option(
    "--breaker-cooldown",
    type=click.FloatRange(min=0),
    help="Seconds a target stays out before a half-open trial.",
)
@option(
    "--health-interval",
    type=click.FloatRange(min=0),
    help="Seconds between GET /health of each worker (0: off).",
)
@option(
    "--version-interval",
    type=click.FloatRange(min=0),
    help="Seconds between reads of each worker's weights version, so that updates sent "
    "straight to an engine are seen (0: off; answers that state it are read regardless).",
)
@option(
    "--health-failures",
    type=click.IntRange(min=1),
    help="Consecutive failed health checks that take a worker out.",
)
@option(
    "--health-successes",
    type=click.IntRange(min=1),
    help="Consecutive good health checks that take a worker back.",
)
@option(
    "--health-timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds one health check may take.",
)
@option(
    "--connect-timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to open a connection to an engine; then retried elsewhere.",
)
@option(
    "--first-byte-timeout",
    type=click.FloatRange(min=0),
    help="Seconds until an engine's answer starts (0: --read-timeout); then retried elsewhere.",
)
@option(
    "--grace",
    type=click.FloatRange(min=0),
    help="On SIGTERM, seconds in-flight requests get to finish (a second signal: at once).",
)
@option(
    "--models-interval",
    type=click.FloatRange(min=0),
    help=(
        "Seconds between reads of each worker's /v1/models, where both engines list their "
        "LoRA adapters: one loaded or unloaded straight at an engine is routed accordingly "
        "within it (0: off)."
    ),
)
@option(
    "--load-interval",
    type=click.FloatRange(min=0),
    help=(
        "Seconds between scrapes of engine-reported load (0: off). Default 1, or 0.25 with "
        "--discovery."
    ),
)
@option(
    "--read-timeout",
    type=click.FloatRange(min=0),
    help="Seconds without a byte from the engine before the attempt fails (0: none).",
)
@option(
    "--startup-timeout",
    type=click.FloatRange(min=0),
    help=(
        "Seconds to wait for discovery before refusing misconfigured workers and logging the "
        "targets; the router listens meanwhile (503 until a worker is ready)."
    ),
)
@option(
    "--admin-token",
    envvar="DPROUTER_ADMIN_TOKEN",
    help=(
        "Every admin call (/workers, engine commands) must carry it; also read from "
        "DPROUTER_ADMIN_TOKEN. Without it they are taken from loopback, this host's own "
        "addresses and --admin-from only."
    ),
)
@option(
    "--admin-from",
    multiple=True,
    metavar="CIDR",
    help=(
        "Without --admin-token: a network whose hosts may make admin calls besides loopback "
        "and this host's own addresses (engines registering from other hosts); repeat it for "
        "several."
    ),
)
@option(
    "--tenants",
    type=click.Path(exists=True, dir_okay=False),
    help=(
        "A YAML file of tenants: their API keys, role (user or admin), priority class, "
        "weight and limits (docs/security.md). Without it or --jwt-issuer the data plane is open."
    ),
)
@option("--jwt-issuer", metavar="URL", help="Accept JWT bearer tokens of this issuer (iss).")
@option(
    "--jwt-jwks",
    metavar="URL",
    help="The issuer's keys (JWKS); unset: named by its /.well-known/openid-configuration.",
)
@option("--jwt-audience", help="The audience (aud) a JWT must name.")
@option("--jwt-tenant-claim", help="The JWT claim naming the caller's tenant.")
@option("--jwt-role-claim", help="The JWT claim whose value admin gives the admin role.")
@option(
    "--classes",
    multiple=False,
    callback=lambda _c, _p, v: tuple(c.strip() for c in v.split(",")),
    metavar="A,B,...",
    help="Priority classes, highest first (a tenant's class, or X-Priority when it may set it).",
)
@option(
    "--dispatch-queue",
    type=click.IntRange(min=0),
    help=(
        "Requests held in the router at most (0: no bound); beyond it the lowest class is "
        "shed first, with a 503."
    ),
)
@option(
    "--engine-queue",
    type=click.IntRange(min=0),
    help="Requests a rank may queue beyond its running slots before the router holds more.",
)
@option(
    "--engine-kv",
    type=click.FloatRange(min=0, max=1),
    help=(
        "The share of its KV cache at which a rank takes no more requests (held in the "
        "router meanwhile): the tokens its engine last reported, plus those sent since; "
        "0: no bound."
    ),
)
@option(
    "--reserve",
    type=click.IntRange(min=0),
    help=(
        "Running slots per rank only the highest class may take while the others are held "
        "(its requests then start at once under overload)."
    ),
)
@option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    help="Serve HTTPS: the certificate chain (PEM); reloaded on SIGHUP.",
)
@option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Serve HTTPS: the private key (PEM).",
)
@option(
    "--engine-ca",
    type=click.Path(exists=True, dir_okay=False),
    help="CA bundle the engines' certificates are checked against.",
)
@option(
    "--engine-cert",
    type=click.Path(exists=True, dir_okay=False),
    help="Client certificate (PEM) shown to engines that require one (mTLS).",
)
@option(
    "--engine-key",
    type=click.Path(exists=True, dir_okay=False),
    help="The client certificate's private key (PEM).",
)
@option(
    "--engine-api-key",
    envvar="DPROUTER_ENGINE_API_KEY",
    help=(
        "Sent to every engine as Authorization: Bearer (their --api-key); also read from "
        "DPROUTER_ENGINE_API_KEY. A worker's own api_key wins."
    ),
)
@option(
    "--engine-admin-key",
    envvar="DPROUTER_ENGINE_ADMIN_KEY",
    help=(
        "Sent to SGLang engines' admin endpoints (engine commands, aborts) instead of the "
        "API key: their --admin-api-key, which those endpoints then take alone; also read "
        "from DPROUTER_ENGINE_ADMIN_KEY. A worker's own admin_key wins."
    ),
)
@option(
    "--tracing",
    is_flag=True,
    help="Export OpenTelemetry traces over OTLP, as OTEL_EXPORTER_OTLP_ENDPOINT and friends say.",
)
@option(
    "--hold-wait",
    type=click.FloatRange(min=0),
    help=(
        "Seconds a request waits while every worker that could serve it is paused or "
        "updating its weights (or older than the version it asks for), before a 503."
    ),
)
@option(
    "--hold-lease",
    type=click.IntRange(min=2),
    help=(
        "etcd: seconds a hold (a pause, an update) relayed by this replica outlives it, killed "
        "or cut off from etcd, in the other replicas (docs/replicas.md)."
    ),
)
@option(
    "--dashboard",
    is_flag=True,
    help=(
        "Serve the live view at /dashboard and its JSON at /dashboard/data, behind the admin "
        "role (docs/security.md)."
    ),
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="How much the router logs.",
)
@click.pass_context
def serve(
    ctx: click.Context,
    /,
    workers: tuple[str, ...],
    config_file: Path | None,
    log_level: str,
    **options: Any,
) -> None:
    """Route requests to every (worker, dp_rank) target of vLLM and SGLang engines."""
    # until run() has its own handlers, a SIGTERM ends the process at once, saying so
    signal.signal(signal.SIGTERM, stopped_early)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = make_config(ctx, config_file, workers, options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except TypeError as exc:
        raise click.UsageError(f"bad option in the configuration: {exc}") from None
    try:
        asyncio.run(run(config))
    except ConfigError as exc:  # what the configuration names is missing or unreadable
        raise click.UsageError(str(exc)) from None


async def run(config: RouterConfig) -> None:
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: exiting now, in-flight requests are cut")
            os._exit(1)
        log.info("stopping: no new connections, %g s for in-flight requests", config.grace)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    # one or the other: a Router made and dropped would load the TLS pair (and more) twice
    router: Router | Supervisor = Supervisor(config) if config.process_count > 1 else Router(config)
    if config.tls_cert is not None:
        # SIGHUP reloads the certificate and key (renewed on disk) without a restart; under
        # --processes the supervisor forwards it to every serving process
        loop.add_signal_handler(signal.SIGHUP, router.reload_tls)
    try:
        await router.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    try:
        # a signal while workers are still discovered stops the router there: it never
        # says it serves
        settled = await until_stopped(router.settled(config.startup_timeout), stop)
        if settled is None:
            return
        if not settled:
            waiting = [w.id for w in router.registry.workers.values() if w.state == "discovering"]
            log.warning("still discovering %s; they get traffic once they answer", waiting)
        listed = {spec.url for spec in config.workers}  # etcd's come and go: only logged
        refused = [
            w.id for w in router.registry.workers.values() if w.state == "error" and w.url in listed
        ]
        if refused:  # each was logged, with its reason, when it was refused
            names = ", ".join(refused)
            raise click.ClickException(f"refusing to start with misconfigured workers: {names}")
        snapshot = router.registry.snapshot
        targets = sum(len(snapshot.pool(role)) for role in ROLES)
        gc_tuning.tune()  # what lives as long as the router is in place now
        log.info(
            "dprouter on %s: policy %s, %d target(s), %d serving process(es)",
            router.url,
            config.policy_name,
            targets,
            config.process_count,
        )
        if router.metrics_url is not None:
            log.info("metrics also on %s", router.metrics_url)
        identity = Identity.of(config, warn=False)
        if identity.open_admin():  # no admin credential at all
            log.warning(identity.trust.exposure())
        if not config.workers and config.discovery is None and config.pd != "vllm-moriio":
            log.warning("no worker yet: engines join with POST /workers (docs/rl.md)")
        if isinstance(router, Supervisor):  # it may find it cannot serve after all
            await asyncio.wait(
                [asyncio.create_task(e.wait()) for e in (stop, router.gave_up)],
                return_when=asyncio.FIRST_COMPLETED,
            )
        else:
            await stop.wait()
    finally:
        await router.stop()


async def until_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """What ``work`` returns, or None if ``stop`` is set first (``work`` is cancelled)."""
    task, stopping = asyncio.create_task(work), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if stop.is_set():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
