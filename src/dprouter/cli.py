"""The ``dprouter`` command: a thin layer over the Python API."""

from __future__ import annotations

import asyncio
import signal

import click

from dprouter.demo import demo
from dprouter.serve import serve
from dprouter.sim.cluster import SimCluster, fleet
from dprouter.sim.config import SGLANG_DISPATCH, CostModel, EngineConfig, Faults, RankLimits


@click.group()
@click.version_option(package_name="dprouter")
def main() -> None:
    """dprouter: route LLM requests to (worker, dp_rank) targets."""


@main.command()
@click.option("--persona", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True)
@click.option("--engines", type=click.IntRange(1, 256), default=1, show_default=True)
@click.option("--dp-size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--tp-size", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--dp-attention", is_flag=True, help="Ranks of an engine step in lock-step.")
@click.option(
    "--dispatch",
    type=click.Choice(SGLANG_DISPATCH),
    default=None,
    help="SGLang internal balancer (default round_robin).",
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
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="First engine's port; engine i listens on PORT+i (0: any free port).",
)
def sim(
    persona: str,
    engines: int,
    dp_size: int,
    tp_size: int,
    dp_attention: bool,
    dispatch: str | None,
    stats_interval: float,
    reserve_locally: bool,
    time_scale: float,
    model: str,
    max_running: int,
    kv_tokens: int,
    max_model_len: int,
    slow_ranks: tuple[str, ...],
    fail_rate: float,
    host: str,
    port: int,
) -> None:
    """Start N simulated engines with DP ranks and serve until interrupted."""
    try:
        slow = {int(k): float(v) for k, v in (s.split("=", 1) for s in slow_ranks)}
        config = EngineConfig(
            persona=persona,  # type: ignore[arg-type]
            dp_size=dp_size,
            tp_size=tp_size,
            dp_attention=dp_attention,
            dispatch=dispatch,  # type: ignore[arg-type]
            stats_interval=stats_interval,
            reserve_locally=reserve_locally,
            model=model,
            time_scale=time_scale,
            cost=CostModel(),
            limits=RankLimits(
                max_running=max_running, kv_tokens=kv_tokens, max_model_len=max_model_len
            ),
            faults=Faults(slow_ranks=slow, fail_rate=fail_rate),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(_serve_cluster(fleet(engines, config), host, port))


async def _serve_cluster(configs: list[EngineConfig], host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        cluster = SimCluster(configs, host, port, prefix=configs[0].persona)
        await cluster.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    c = configs[0]
    shape = f"dp_size={c.dp_size}" + (" dp_attention" if c.dp_attention else "")
    for server in cluster.servers:
        click.echo(f"{server.engine_id} {c.persona} {shape} {server.url}")
    click.echo("ready", err=True)
    try:
        await stop.wait()
    finally:
        await cluster.stop()


main.add_command(demo)
main.add_command(serve)
