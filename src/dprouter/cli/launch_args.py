"""The SGLang router's launch arguments as its launchers parse them: the ones dprouter
takes (shaped as ``sglang_router.launch_router`` 0.3.2 and ``smg launch`` 1.13.0 declare
them: ``--worker-urls`` takes several URLs, ``--prefill URL [BOOTSTRAP_PORT]`` is
repeated), and why the others are refused (``cli/launch.py`` maps the taken ones).

A flag of either launcher that is not taken here is refused by name: a framework's
line either means the same under dprouter or does not start, never half-read.
"""

from __future__ import annotations

import argparse

# what a refused flag of the peers' launchers does that dprouter does otherwise, or not
REFUSED = {
    "--mini-lb": "SGLang's debugging balancer; dprouter is the router",
    "--enable-igw": "the multi-model gateway's mode (gRPC and OpenAI backends)",
    "--epd-disaggregation": "encode/prefill/decode: dprouter routes P/D only",
    "--encode": "encode workers: dprouter routes P/D only",
    "--log-dir": "dprouter logs to stderr",
    "--log-json": "dprouter logs plain lines to stderr",
    "--retry-max-backoff-ms": "dprouter doubles the pause, jittered, up to 1 s",
    "--retry-backoff-multiplier": "dprouter doubles the pause, jittered, up to 1 s",
    "--retry-jitter-factor": "dprouter doubles the pause, jittered, up to 1 s",
    "--cb-success-threshold": "one good half-open trial closes a dprouter breaker",
    "--cb-window-duration-secs": "a dprouter breaker counts consecutive failures, not a window",
    "--balance-abs-threshold": "cache_aware's balance is dprouter's --cache-bound (relative)",
    "--balance-rel-threshold": "cache_aware's balance is dprouter's --cache-bound (relative)",
    "--eviction-interval-secs": "dprouter's cache_aware bounds its own memory",
    "--max-tree-size": "dprouter's cache_aware bounds its own memory",
    "--worker-startup-check-interval": "dprouter probes a discovering worker on its own clock",
    "--cors-allowed-origins": "dprouter sends no CORS headers",
    "--rate-limit-tokens-per-second": "per-tenant limits are dprouter's --tenants",
    "--control-plane-api-keys": "dprouter's admin credentials are --admin-token or --tenants",
    "--jwt-issuer": "the gateway's JWTs guard its control plane; dprouter's guard both planes",
    "--jwt-audience": "the gateway's JWTs guard its control plane; dprouter's guard both planes",
    "--jwt-jwks-uri": "the gateway's JWTs guard its control plane; dprouter's guard both planes",
    "--otlp-traces-endpoint": "dprouter exports OTLP over HTTP, as OTEL_EXPORTER_OTLP_* say",
    "--prometheus-duration-buckets": "dprouter's histograms have buckets of their own",
    "--routing-key-headers": "dprouter reads X-SMG-Routing-Key, X-Session-ID, body session_id",
    "--dp-minimum-tokens-scheduler": "dprouter's own is --policy min_tokens (dprouter serve)",
    "--rl-control-timeout-secs": "dprouter bounds a weight update at 10 min, other commands 1 min",
}
for _flag in (
    "--model-path",
    "--tokenizer-path",
    "--chat-template",
    "--reasoning-parser",
    "--tool-call-parser",
    "--mcp-config-path",
    "--backend",
    "--history-backend",
):
    REFUSED[_flag] = "the gateway's own tokenizer, parsers and history: dprouter relays to engines"

# policies of the gateways with a dprouter policy of the same meaning, by their names
POLICIES = {
    "random": "random",
    "round_robin": "round_robin",
    "cache_aware": "cache_aware",
    "power_of_two": "power_of_two",
    "manual": "manual",
    "consistent_hashing": "consistent_hash",
    "least_load": "least_load",
}
# an argument not given has the SGLang router's default where a framework sees it
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_POLICY = "0.0.0.0", 30000, "cache_aware"


def parser(prog: str) -> argparse.ArgumentParser:
    """The taken arguments, in the launchers' shapes (no abbreviations: a prefix of a
    refused flag must not pass for a taken one)."""
    p = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [the SGLang router's launch arguments; --help lists those taken]",
        allow_abbrev=False,
        description="The SGLang router's launch line, run by dprouter (docs/rl.md#launch).",
    )
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--worker-urls", nargs="*", default=[], metavar="URL")
    for flag in ("--policy", "--prefill-policy", "--decode-policy"):
        p.add_argument(flag, metavar="|".join(POLICIES))
    p.add_argument("--dp-aware", action="store_true")
    p.add_argument("--enable-rl", action="store_true")
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]")
    p.add_argument("--decode", action="append", metavar="URL")
    p.add_argument("--assignment-mode", choices=["random", "min_load", "min_group"])
    floats = (
        "--cache-threshold",
        "--max-idle-secs",
        "--request-timeout-secs",
        "--shutdown-grace-period-secs",
        "--queue-timeout-secs",
        "--retry-initial-backoff-ms",
        "--cb-timeout-duration-secs",
        "--health-check-timeout-secs",
        "--health-check-interval-secs",
        "--worker-startup-timeout-secs",
    )
    for flag in floats:
        p.add_argument(flag, type=float)
    ints = (
        "--max-payload-size",
        "--max-concurrent-requests",
        "--queue-size",
        "--retry-max-retries",
        "--cb-failure-threshold",
        "--health-failure-threshold",
        "--health-success-threshold",
        "--prometheus-port",
        "--service-discovery-port",
    )
    for flag in ints:
        p.add_argument(flag, type=int)
    for flag in ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--health-check-endpoint", default="/health")
    p.add_argument("--request-id-headers", nargs="*", metavar="HEADER")
    p.add_argument("--prometheus-host")
    p.add_argument("--log-level", choices=["debug", "info", "warn", "error"], default="info")
    p.add_argument("--service-discovery", action="store_true")
    p.add_argument("--service-discovery-namespace")
    for flag in ("--selector", "--prefill-selector", "--decode-selector"):
        p.add_argument(flag, nargs="+", metavar="K=V")
    for flag in ("--api-key", "--tls-cert-path", "--tls-key-path"):
        p.add_argument(flag)
    for flag in ("--client-cert-path", "--client-key-path"):
        p.add_argument(flag)
    p.add_argument("--ca-cert-paths", nargs="*", default=[], metavar="FILE")
    p.add_argument("--enable-trace", action="store_true")
    return p


def refusals(extra: list[str]) -> list[str]:
    """Each flag among what the parser left over, named, with why when it is known; a
    value that follows no flag is named too (values after a refused flag are its own)."""
    said: list[str] = []
    for token in extra:
        if token.startswith("-") and token != "-":
            flag = token.split("=", 1)[0]
            why = REFUSED.get(flag)
            said.append(f"{flag} ({why})" if why else flag)
        elif not said:
            said.append(f"{token!r} (a value of no argument)")
    return said
