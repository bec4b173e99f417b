"""``dprouter launch`` and ``python -m dprouter.launch_router``: the SGLang router's launch
line, as RL frameworks build it (``python -m sglang_router.launch_router ...``,
``smg launch ...``), run as dprouter, so that a framework swaps the module or the binary
and keeps its arguments.

Each taken argument becomes the ``RouterConfig`` field of the same meaning (the table,
with where the meaning is approximate, is docs/rl.md's "Launch"); then the router runs
as ``dprouter serve`` runs it (``serve.run``). An argument of either launcher that
dprouter cannot honour is refused by name, with a usage error (exit code 2).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import click

from dprouter.cli.launch_args import DEFAULT_POLICY, POLICIES, parser, refusals
from dprouter.cli.serve import run
from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError
from dprouter.fleet.worker_spec import WorkerSpec

# taken as they are: the launcher's name -> RouterConfig's
SAME = {
    "host": "host",
    "port": "port",
    "cache_threshold": "cache_threshold",
    "max_idle_secs": "key_ttl",
    "assignment_mode": "assignment",
    "max_payload_size": "max_body",
    "shutdown_grace_period_secs": "grace",
    "queue_size": "queue_size",
    "queue_timeout_secs": "queue_timeout",
    "cb_failure_threshold": "breaker_failures",
    "cb_timeout_duration_secs": "breaker_cooldown",
    "health_failure_threshold": "health_failures",
    "health_success_threshold": "health_successes",
    "health_check_timeout_secs": "health_timeout",
    "health_check_interval_secs": "health_interval",
    "worker_startup_timeout_secs": "startup_timeout",
    "prometheus_port": "metrics_port",
    "prometheus_host": "metrics_host",
    "api_key": "engine_api_key",
    "tls_cert_path": "tls_cert",
    "tls_key_path": "tls_key",
    "client_cert_path": "engine_cert",
    "client_key_path": "engine_key",
    "service_discovery_namespace": "namespace",
}


def config_of(args: argparse.Namespace) -> RouterConfig:
    """The router the launch line means; ``ConfigError`` names what it cannot mean (a
    policy dprouter has not, a second CA bundle...) or what contradicts itself."""
    values: dict[str, Any] = {
        ours: getattr(args, theirs)
        for theirs, ours in SAME.items()
        if getattr(args, theirs) is not None
    }
    refused: list[str] = []
    for flag in ("policy", "prefill_policy", "decode_policy"):
        name = getattr(args, flag) or (DEFAULT_POLICY if flag == "policy" else None)
        if name is not None and name not in POLICIES:
            refused.append(f"--{flag.replace('_', '-')} {name}")
        elif name is not None:
            values[flag] = POLICIES[name]
    values["workers"] = workers(args)
    if args.pd_disaggregation:
        values["pd"] = "sglang"
    elif args.prefill or args.decode:
        raise ConfigError("--prefill and --decode need --pd-disaggregation")
    if args.prometheus_host is not None and args.prometheus_port is None:
        values["metrics_port"] = 29000  # the gateway's default port, on the host given
    if args.request_timeout_secs is not None:  # the gateway's timeout is the whole request's
        values["total_timeout"] = values["read_timeout"] = args.request_timeout_secs
    if args.max_concurrent_requests is not None:
        values["max_concurrent"] = max(0, args.max_concurrent_requests)  # -1, 0: no cap
    if args.retry_max_retries is not None:
        values["attempts"] = max(1, args.retry_max_retries)  # the first try counts
    if args.disable_retries:
        values["attempts"] = 1
    if args.retry_initial_backoff_ms is not None:
        values["retry_backoff"] = args.retry_initial_backoff_ms / 1000
    if args.disable_circuit_breaker:
        values["breaker_failures"] = 0
    if args.disable_health_check:
        values["health_interval"] = 0.0
    if args.enable_trace:
        values["tracing"] = True
    if args.health_check_endpoint != "/health":
        refused.append(f"--health-check-endpoint {args.health_check_endpoint} (dprouter: /health)")
    others = [h for h in args.request_id_headers or () if h.lower() != "x-request-id"]
    if others:
        refused.append(f"--request-id-headers {' '.join(others)} (dprouter reads X-Request-ID)")
    if len(args.ca_cert_paths) > 1:
        refused.append("--ca-cert-paths with more than one file (give one bundle)")
    elif args.ca_cert_paths:
        values["engine_ca"] = args.ca_cert_paths[0]
    if refused:
        raise ConfigError(unsupported(refused))
    values |= discovery(args)
    return validate(RouterConfig(**values))


def unsupported(refused: list[str]) -> str:
    return (
        f"dprouter does not support {', '.join(refused)}: drop them, or start the router "
        "with dprouter serve and its own options (docs/rl.md#launch)"
    )


def workers(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    """``--worker-urls``, ``--prefill URL [BOOTSTRAP_PORT|none]`` and ``--decode URL``."""
    found = [WorkerSpec(url) for url in args.worker_urls]
    for given in args.prefill or ():
        if len(given) > 2:
            raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(given)}")
        port = given[1] if len(given) == 2 else "none"
        if port.lower() != "none" and not port.isdigit():
            raise ConfigError(f"--prefill {given[0]}: bootstrap port {port!r} is not a number")
        bootstrap = None if port.lower() == "none" else int(port)  # None: as the engine says
        found.append(WorkerSpec(given[0], role="prefill", bootstrap_port=bootstrap))
    found += [WorkerSpec(url, role="decode") for url in args.decode or ()]
    return tuple(found)


def discovery(args: argparse.Namespace) -> dict[str, Any]:
    """``--service-discovery``: the engine pods by label, as dprouter's ``--discovery k8s``."""
    values: dict[str, Any] = {}
    if args.service_discovery_port is not None:
        values["pod_port"] = args.service_discovery_port
    if args.service_discovery:
        values["discovery"] = "k8s"
        values.setdefault("pod_port", 80)  # the gateway's default
    for flag in ("selector", "prefill_selector", "decode_selector"):
        if getattr(args, flag):
            values[flag] = ",".join(getattr(args, flag))  # k=v k=v -> k=v,k=v
    return values


@click.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(ctx: click.Context, argv: tuple[str, ...]) -> None:
    """Run the SGLang router's launch line (sglang_router.launch_router, smg launch) as
    dprouter; launch --help lists the arguments it takes."""
    p = parser(ctx.command_path)
    args, extra = p.parse_known_args(list(argv))
    refused = refusals(extra)
    if refused:
        p.error(unsupported(refused))  # exit code 2, as argparse's own usage errors
    try:
        config = config_of(args)
    except ConfigError as exc:
        p.error(str(exc))
    level = "warning" if args.log_level == "warn" else args.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(run(config))
    except ConfigError as exc:  # what the configuration names is missing or unreadable
        raise click.UsageError(str(exc)) from None
