"""``dprouter demo``: a simulated cluster, the router in front, a short load, a table.

The same load runs twice through two routers in this process: DP-aware (the
default) and with ``--dp-aware off``, where each engine's own balancer picks
the rank. The table shows every rank used in the first run and what the
engines do on their own in the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import click

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig, RankLimits
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.model.vocab import ensure_tokenizer

Key = tuple[str, int]  # (engine id, rank) as the engine reports it


MAX_RUNNING = 4  # small batches per rank, so a crowded rank queues visibly


def demo_cluster(tokenizer: str | None = None, kv_events: bool = False) -> list[EngineConfig]:
    """``tokenizer``: a directory of tokenizer files; ``kv_events``: every rank publishes
    its KV-cache events on free loopback ports (printed at the start)."""
    limits = RankLimits(max_running=MAX_RUNNING)
    kv = KvEventsConfig(
        enable_kv_cache_events=kv_events,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        topic="kv",
    )
    vllm = EngineConfig(persona="vllm", dp_size=8, model="demo", limits=limits)
    sglang = EngineConfig(
        persona="sglang", dp_size=4, dp_attention=True, model="demo", limits=limits
    )
    return [replace(c, tokenizer=tokenizer, kv_events=kv) for c in (vllm, vllm, sglang)]


async def drive(url: str, requests: int, concurrency: int) -> dict[Key, list[float]]:
    """Streamed completions; returns the client-side TTFT of each, by engine rank."""
    ttft: dict[Key, list[float]] = defaultdict(list)
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, n: int) -> None:
        body = {"model": "demo", "prompt": f"demo request {n}", "max_tokens": 24, "stream": True}
        async with gate:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                await r.content.readuntil(b"\n\n")
                first = time.perf_counter() - t0
                await r.read()
                ttft[(r.headers["x-sim-engine"], int(r.headers["x-sim-dp-rank"]))].append(first)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, n) for n in range(requests)))
    return ttft


async def run_demo(
    requests: int,
    concurrency: int,
    linger: float = 0.0,
    tokenizer: str | None = None,
    kv_events: bool = False,
) -> None:
    async with SimCluster(demo_cluster(tokenizer, kv_events), prefix="sim") as cluster:
        for s in cluster.servers:
            c = s.config
            extra = " with DP attention" if c.dp_attention else ""
            click.echo(f"{s.engine_id}: {c.persona} engine, dp_size={c.dp_size}{extra}, {s.url}")
            if s.kv is not None:
                click.echo(f"  kv events, rank r at {s.kv.endpoints[0]} + r")
        workers = tuple(WorkerSpec(u) for u in cluster.urls)
        runs: dict[str, dict[Key, list[float]]] = {}
        outstanding = 0
        # the DP-aware router stays up through both runs, its dashboard with it: in the
        # second run its heat map shows the engine-reported queues of the engines' own picks
        config = RouterConfig(workers=workers, port=0, dashboard=True)
        with routers_log():
            click.echo(f"\nrouter 1, DP-aware (the default). Its warning is expected: {NO_KEYS}.")
            async with Router(config) as router:
                await router.settled(10)
                click.echo(
                    f"dashboard: {router.url}/dashboard (live while the demo runs; "
                    f"or: dprouter top {router.url})"
                )
                runs["auto"] = await drive(router.url, requests, concurrency)
                outstanding += sum(t.outstanding for t in router.registry.targets())
                off = RouterConfig(workers=workers, port=0, dp_aware="off")
                click.echo(
                    "\nrouter 2, --dp-aware off, to compare. Its warnings are expected: each "
                    f"engine's own balancer places its requests, and {NO_KEYS}."
                )
                async with Router(off) as second:
                    await second.settled(10)
                    runs["off"] = await drive(second.url, requests, concurrency)
                    outstanding += sum(t.outstanding for t in second.registry.targets())
                table(cluster, runs, requests, concurrency, outstanding)
                if linger > 0:
                    click.echo(f"\ndashboard up for {linger:g} s more: {router.url}/dashboard")
                    await asyncio.sleep(linger)
                else:
                    click.echo(
                        "\n(dprouter demo --linger 120 keeps the dashboard up after the runs)"
                    )


NO_KEYS = "the demo gives it no API keys"


class Echo(logging.Handler):
    """The routers' log lines, indented under the demo's own lines that say why they come."""

    def emit(self, record: logging.LogRecord) -> None:
        level = "" if record.levelno == logging.WARNING else f"{record.levelname}: "
        click.echo(f"  log: {level}{self.format(record)}")


@contextlib.contextmanager
def routers_log() -> Iterator[None]:
    """The routers' warnings (and worse) shown as the demo's output, for as long as it runs;
    the logger is left as it was found."""
    logger = logging.getLogger("dprouter")
    handler, propagate = Echo(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def table(
    cluster: SimCluster,
    runs: dict[str, dict[Key, list[float]]],
    requests: int,
    concurrency: int,
    outstanding: int,
) -> None:
    aware, off = runs["auto"], runs["off"]
    click.echo(
        f"\n{requests} streamed requests, {concurrency} at a time, round_robin; "
        f"each rank runs at most {MAX_RUNNING} at once\n"
    )
    # two groups of two columns: the DP-aware router's, then the engines' own picks
    click.echo(f"{'':<12}{'DP-aware router':>21}{'engines pick':>25}")
    click.echo(f"{'target':<12}{'requests':>10}{'TTFT p90':>11}{'requests':>14}{'TTFT p90':>11}")
    total = 0
    for s in cluster.servers:
        for r in range(s.config.dp_size):
            key, total = (s.engine_id, r), total + 1
            a, o = aware.get(key, []), off.get(key, [])
            click.echo(f"{s.engine_id} r{r:<6}{len(a):>10}{_ms(a):>11}{len(o):>14}{_ms(o):>11}")
    used = Counter({"DP-aware": len(aware), "engines pick": len(off)})
    click.echo(
        f"\nranks used: DP-aware {used['DP-aware']}/{total}, "
        f"engines pick {used['engines pick']}/{total}; "
        f"outstanding after the runs: {outstanding}"
    )


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.quantiles(values, n=10)[-1] * 1e3:.0f} ms" if len(values) > 1 else "-"


@click.command()
@click.option("--requests", type=click.IntRange(1, 5000), default=240, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 512), default=24, show_default=True)
@click.option(
    "--linger",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to keep the cluster and the dashboard up after the runs (Ctrl-C ends).",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="DIR",
    help="The engines tokenise with DIR/tokenizer.json (the simulator's own files are "
    "written there when DIR has none).",
)
@click.option("--kv-events", is_flag=True, help="Every rank publishes its KV-cache events.")
def demo(
    requests: int, concurrency: int, linger: float, tokenizer: str | None, kv_events: bool
) -> None:
    """Simulated cluster on loopback with the router in front: every rank used."""
    if tokenizer is not None and ensure_tokenizer(Path(tokenizer)):
        click.echo(f"wrote the simulator's tokenizer files to {tokenizer}")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_demo(requests, concurrency, linger, tokenizer, kv_events))
