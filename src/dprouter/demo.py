"""``dprouter demo``: the simulated cluster, and what each engine does with a burst."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import aiohttp
import click

from dprouter.sim.cluster import SimCluster
from dprouter.sim.config import EngineConfig
from dprouter.sim.server import SimServer


@dataclass(frozen=True)
class Slot:
    server: SimServer
    rank: int


def demo_cluster() -> list[EngineConfig]:
    vllm = EngineConfig(persona="vllm", dp_size=8, model="demo")
    sglang = EngineConfig(persona="sglang", dp_size=4, dp_attention=True, model="demo")
    return [vllm, vllm, sglang]


def pin(slot: Slot, body: dict[str, object]) -> tuple[dict[str, str], dict[str, object]]:
    if slot.server.config.persona == "vllm":
        return {"X-data-parallel-rank": str(slot.rank)}, body
    return {}, {**body, "routed_dp_rank": slot.rank}


async def _send(
    session: aiohttp.ClientSession, server: SimServer, n: int, slot: Slot | None
) -> None:
    body: dict[str, object] = {"model": "demo", "prompt": f"demo request {n}", "max_tokens": 32}
    headers: dict[str, str] = {}
    if slot is not None:
        headers, body = pin(slot, body)
    async with session.post(server.url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        await r.read()


async def _burst(cluster: SimCluster, per_engine: int, pinned: bool) -> Counter[tuple[str, int]]:
    slots = [Slot(s, r) for r in range(8) for s in cluster.servers if r < s.config.dp_size]
    for s in cluster.servers:
        s.received.clear()
    async with aiohttp.ClientSession() as session:
        jobs = []
        for n in range(per_engine * len(cluster)):
            if pinned:
                slot = slots[n % len(slots)]
                jobs.append(_send(session, slot.server, n, slot))
            else:
                jobs.append(_send(session, cluster[n % len(cluster)], n, None))
        await asyncio.gather(*jobs)
    return Counter(
        (s.engine_id, rec.rank)
        for s in cluster.servers
        for rec in s.received
        if rec.rank is not None
    )


async def run_demo(per_engine: int) -> None:
    async with SimCluster(demo_cluster(), prefix="sim") as cluster:
        for s in cluster.servers:
            c = s.config
            extra = " dp_attention" if c.dp_attention else ""
            click.echo(f"{s.engine_id}: {c.persona} dp_size={c.dp_size}{extra} at {s.url}")
        own = await _burst(cluster, per_engine, pinned=False)
        flat = await _burst(cluster, per_engine, pinned=True)
    click.echo(f"\n{'target':<14}{'engine picks':>14}{'flat slots':>12}")
    for s in cluster.servers:
        for r in range(s.config.dp_size):
            key = (s.engine_id, r)
            click.echo(f"{s.engine_id + ' r' + str(r):<14}{own[key]:>14}{flat[key]:>12}")
    used_own = sum(1 for v in own.values() if v)
    total = sum(s.config.dp_size for s in cluster.servers)
    click.echo(
        f"\nranks used: engine picks {used_own}/{total}, flat slots "
        f"{sum(1 for v in flat.values() if v)}/{total}"
    )


@click.command()
@click.option(
    "--requests-per-engine",
    "per_engine",
    type=click.IntRange(1, 2000),
    default=40,
    show_default=True,
)
def demo(per_engine: int) -> None:
    """Start a simulated cluster on loopback and show how a burst lands on its ranks."""
    asyncio.run(run_demo(per_engine))
