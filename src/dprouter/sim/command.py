"""``dprouter sim``: start simulated engines from the command line."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from dprouter.core.types import PD_MODES
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import (
    LEGACY_SGLANG_DISPATCH,
    SGLANG_DISPATCH,
    EngineConfig,
    Faults,
    PdConfig,
    RankLimits,
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


def build(o: dict[str, Any]) -> list[EngineConfig]:
    """One config per engine (P/D engines each get their own bootstrap port)."""
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
    persona = pd.persona if pd is not None else o["persona"]
    kv = KvEventsConfig()
    if o["kv_events_config"]:
        kv = KvEventsConfig.from_json(o["kv_events_config"])
    tokenizer = o["tokenizer"]
    if tokenizer is not None and ensure_tokenizer(Path(tokenizer)):
        click.echo(f"wrote the simulator's tokenizer files to {tokenizer}", err=True)
    config = EngineConfig(
        persona=persona,
        dp_size=o["dp_size"],
        tp_size=o["tp_size"],
        dp_attention=o["dp_attention"],
        dispatch=o["dispatch"],
        legacy_sglang=o["legacy_sglang"],
        stats_interval=o["stats_interval"],
        reserve_locally=o["reserve_locally"],
        model=o["model"],
        time_scale=o["time_scale"],
        limits=RankLimits(
            max_running=o["max_running"], kv_tokens=o["kv_tokens"], max_model_len=o["max_model_len"]
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


@click.command()
@click.option("--persona", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True)
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
def sim(host: str, port: int, **options: Any) -> None:
    """Start N simulated engines with DP ranks and serve until interrupted."""
    try:
        configs = build(options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(serve_cluster(configs, host, port))


async def serve_cluster(configs: list[EngineConfig], host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    c = configs[0]
    prefix = c.persona if c.pd is None else f"{c.pd.role}"
    try:
        cluster = SimCluster(configs, host, port, prefix=prefix)
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
