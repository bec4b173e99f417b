"""``dprouter sim``: start simulated engines from the command line; ``dprouter sim
calibrate``: measure a real engine into a persona file they can start from."""

from __future__ import annotations

import asyncio
import shlex
import signal
import ssl
import sys
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import click
from click.core import ParameterSource

from dprouter.core.errors import ConfigError
from dprouter.core.tls import server_context
from dprouter.core.types import PD_MODES
from dprouter.sim.calibrate import Calibration
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model import persona_file
from dprouter.sim.model.config import (
    LEGACY_SGLANG_DISPATCH,
    SGLANG_DISPATCH,
    EngineConfig,
    Faults,
    PdConfig,
)
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.model.vocab import ensure_tokenizer


def slow_rank(text: str) -> tuple[int, float]:
    """``RANK=FACTOR`` of ``--slow-rank``, or a message naming the option and the form."""
    rank, sep, factor = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(factor)
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected RANK=FACTOR, e.g. 3=4.0", param_hint="--slow-rank"
        ) from None


def build(
    o: dict[str, Any], base: EngineConfig | None = None, given: Collection[str] | None = None
) -> list[EngineConfig]:
    """One config per engine (P/D engines each get their own bootstrap port). With a
    ``base`` (a persona file's), only the options in ``given`` override it."""

    def pick(option: str, current: Any) -> Any:
        return o[option] if base is None or given is None or option in given else current

    b = base or EngineConfig()
    slow = dict(slow_rank(s) for s in o["slow_ranks"])
    pd = None
    if o["pd"] or o["role"]:
        if not (o["pd"] and o["role"]):
            raise ValueError("--pd and --role go together")
        pd = PdConfig(
            mode=o["pd"],
            role=o["role"],
            transfer_mode=o["transfer_mode"],
            registration=o["registration"],
            bootstrap_port=o["bootstrap_port"],
            kv_wait=o["kv_wait"],
        )
    persona = pd.persona if pd is not None else pick("persona", b.persona)
    kv = KvEventsConfig()
    if o["kv_events_config"]:
        kv = KvEventsConfig.from_json(o["kv_events_config"])
    tokenizer = o["tokenizer"]
    if tokenizer is not None and ensure_tokenizer(Path(tokenizer)):
        click.echo(f"wrote the simulator's tokenizer files to {tokenizer}", err=True)
    limits = b.limits
    config = replace(
        b,
        persona=persona,
        dp_size=pick("dp_size", b.dp_size),
        tp_size=pick("tp_size", b.tp_size),
        dp_attention=pick("dp_attention", b.dp_attention),
        dispatch=pick("dispatch", b.dispatch),
        legacy_sglang=pick("legacy_sglang", b.legacy_sglang),
        stats_interval=pick("stats_interval", b.stats_interval),
        reserve_locally=pick("reserve_locally", b.reserve_locally),
        model=pick("model", b.model),
        time_scale=pick("time_scale", b.time_scale),
        limits=replace(
            limits,
            max_running=pick("max_running", limits.max_running),
            kv_tokens=pick("kv_tokens", limits.kv_tokens),
            max_model_len=pick("max_model_len", limits.max_model_len),
        ),
        faults=Faults(slow_ranks=slow, fail_rate=o["fail_rate"]),
        pd=pd,
        kv_events=kv,
        tokenizer=tokenizer,
    )
    configs = []
    for i in range(o["engines"]):
        # engine i's ranks publish after engine i-1's, as on a host of several engines
        one = replace(config, kv_events=kv.shifted(i * config.dp_size))
        if pd is not None and pd.bootstrap_port:
            one = replace(one, pd=replace(pd, bootstrap_port=pd.bootstrap_port + i))
        configs.append(one)
    return configs


@click.group(invoke_without_command=True)
@click.option("--persona", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True)
@click.option(
    "--persona-file",
    default=None,
    metavar="NAME|FILE",
    help="Start from a persona file (shape, limits, step costs) written by `dprouter sim "
    "calibrate`, or a shipped one by name: sglang-cpu. Options given override it.",
)
@click.option("--engines", type=click.IntRange(1, 256), default=1, show_default=True)
@click.option("--dp-size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--tp-size", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--dp-attention", is_flag=True, help="Ranks of an engine step in lock-step.")
@click.option(
    "--dispatch",
    type=click.Choice(list(dict.fromkeys(SGLANG_DISPATCH + LEGACY_SGLANG_DISPATCH))),
    default=None,
    help="SGLang internal balancer (default round_robin, a P/D prefill follow_bootstrap_room; "
    "shortest_queue only with --legacy-sglang, total_* only without).",
)
@click.option(
    "--legacy-sglang",
    is_flag=True,
    help="Imitate SGLang before attn_dp_size: /server_info counts attention-DP ranks in "
    "dp_size, /get_load answers (default: SGLang 0.5.23).",
)
@click.option(
    "--stats-interval",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="vLLM: seconds between published rank counts.",
)
@click.option(
    "--reserve-locally",
    is_flag=True,
    help="vLLM: count own picks between published counts (vLLM >= 0.10).",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Wall seconds per simulated second.",
)
@click.option("--model", default="sim-model", show_default=True)
@click.option("--max-running", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--kv-tokens", type=click.IntRange(min=2), default=400_000, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=2), default=32_768, show_default=True)
@click.option(
    "--slow-rank",
    "slow_ranks",
    multiple=True,
    metavar="RANK=FACTOR",
    help="Multiply one rank's step cost, e.g. 3=4.0.",
)
@click.option("--fail-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True)
@click.option("--pd", type=click.Choice(PD_MODES), default=None, help="P/D flow of this engine.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None)
@click.option(
    "--transfer-mode",
    type=click.Choice(["READ", "WRITE"]),
    default="READ",
    show_default=True,
    help="MoRIIO transfer mode.",
)
@click.option(
    "--registration",
    default=None,
    metavar="tcp://HOST:PORT",
    help="MoRIIO: the router's registration address (serve --registration): heartbeats go there.",
)
@click.option(
    "--bootstrap-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="SGLang and vLLM Mooncake prefill: first engine's bootstrap port (0: any free port).",
)
@click.option(
    "--kv-wait",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Decode: seconds to wait for the prefill's KV.",
)
@click.option(
    "--kv-events-config",
    default=None,
    metavar="JSON",
    help="Publish each rank's KV-cache events, as the engines' --kv-events-config: "
    '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
    '"tcp://*:5600", "topic": "kv"}\' (port 0: free ports; "encoding": "array" for the '
    "older tagged-array events).",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="DIR",
    help="Tokenise with DIR/tokenizer.json and its chat template, as the engine would "
    "(the simulator's own files are written there when DIR has none).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="First engine's port; engine i listens on PORT+i (0: any free port).",
)
@click.option(
    "--api-key",
    envvar="DPROUTER_SIM_API_KEY",
    default=None,
    help="Answer 401 without Authorization: Bearer KEY where the persona's engine does "
    "(vLLM: /v1 and its other API prefixes; SGLang: all but /health, /ready, /metrics).",
)
@click.option(
    "--admin-api-key",
    envvar="DPROUTER_SIM_ADMIN_API_KEY",
    default=None,
    help="SGLang: its admin endpoints (flush, pause, weights, adapters, /abort_request) "
    "take this key alone, as SGLang's --admin-api-key.",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Serve HTTPS: the certificate chain (PEM).",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Serve HTTPS: the private key (PEM).",
)
@click.option(
    "--tls-client-ca",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --tls-cert: require a client certificate signed by this CA (mTLS).",
)
@click.pass_context
def sim(
    ctx: click.Context,
    /,
    host: str,
    port: int,
    api_key: str | None,
    admin_api_key: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    **options: Any,
) -> None:
    """Start N simulated engines with DP ranks and serve until interrupted."""
    if ctx.invoked_subcommand is not None:
        return
    if admin_api_key and options["persona"] != "sglang":
        raise click.UsageError("--admin-api-key is SGLang's: give --persona sglang")
    tls = tls_context(tls_cert, tls_key, tls_client_ca)
    try:
        path = options.pop("persona_file")
        base = persona_file.load(path) if path else None
        given = {o for o in options if ctx.get_parameter_source(o) != ParameterSource.DEFAULT}
        configs = build(options, base, given)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(serve_cluster(configs, host, port, api_key or None, admin_api_key or None, tls))


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The engines' HTTPS context, or a usage error naming what is missing or unreadable."""
    if (cert is None) != (key is None):
        raise click.UsageError("serving HTTPS needs both --tls-cert and --tls-key")
    if cert is None or key is None:
        if client_ca is not None:
            raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    try:
        return server_context(cert, key, client_ca)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


async def serve_cluster(
    configs: list[EngineConfig],
    host: str,
    port: int,
    api_key: str | None = None,
    admin_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    c = configs[0]
    prefix = c.persona if c.pd is None else f"{c.pd.role}"
    try:
        cluster = SimCluster(
            configs, host, port, prefix=prefix, api_key=api_key, admin_key=admin_key, tls=tls
        )
        await cluster.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    shape = f"dp_size={c.dp_size}" + (" dp_attention" if c.dp_attention else "")
    for server in cluster.servers:
        extra = ""
        if server.pd is not None and server.pd.bootstrap_port:
            extra = f" bootstrap_port={server.pd.bootstrap_port}"
        click.echo(f"{server.engine_id} {c.persona} {shape} {server.url}{extra}")
        if server.kv is not None:
            for rank, endpoint in enumerate(server.kv.endpoints):
                replay = server.kv.replay_endpoints[rank]
                click.echo(
                    f"  rank {rank} kv events {endpoint}" + (f" replay {replay}" if replay else "")
                )
    click.echo("ready", err=True)
    try:
        await stop.wait()
    finally:
        await cluster.stop()


@sim.command()
@click.option(
    "--url", required=True, help="The running SGLang engine, e.g. http://127.0.0.1:31600."
)
@click.option(
    "--log",
    "log_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The engine's log; it must log each decode step (--decode-log-interval 1).",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--repeats", type=click.IntRange(1, 20), default=5, show_default=True)
@click.option(
    "--decode-tokens",
    type=click.IntRange(8, 1024),
    default=96,
    show_default=True,
    help="Output tokens of each request of a decode burst.",
)
def calibrate(url: str, log_path: Path, out: Path, repeats: int, decode_tokens: int) -> None:
    """Measure a running SGLang engine's step costs into a persona file (takes minutes)."""
    run = Calibration(url, log_path, repeats, decode_tokens)
    try:
        config, measured = asyncio.run(run.run())
    except (OSError, RuntimeError, KeyError, ValueError, aiohttp.ClientError) as exc:
        raise click.ClickException(f"calibration failed: {exc!r}") from None
    made_by = shlex.join(["dprouter", *sys.argv[1:]])
    out.write_text(persona_file.dump(config, made_by, measured))
    c = config.cost
    click.echo(
        f"wrote {out}: step_base {c.step_base * 1e3:.2f} ms, decode_per_seq "
        f"{c.decode_per_seq * 1e3:.3f} ms, prefill_per_token {c.prefill_per_token * 1e6:.2f} us, "
        f"decode_per_kv_token {c.decode_per_kv_token * 1e9:.2f} ns"
    )
