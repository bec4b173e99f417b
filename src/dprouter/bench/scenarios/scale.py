"""Scenario 7, scale: what a decision costs at thousands of targets, and how it routes.

Decision cost: the router's policies choosing among N targets whose loads
vary, timed on this machine's CPU (process time per decision). Routing
quality: the offline simulator with 1,024 and 4,096 ranks (64 and 256 engines
x DP16) under a steady chat-like load, each policy driving it.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from dprouter.bench.harness.sim_router import SimRouter
from dprouter.bench.report.plots import lines
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import POLICIES, PolicyOptions, Prefix, RequestInfo, make_policy
from dprouter.sim.model.config import EngineConfig, RankLimits
from dprouter.sim.offline.offline import Arrival, OfflineSim

SIZES = (64, 256, 1024, 4096)
BEFORE = Path(__file__).parents[4] / "bench" / "baselines" / "scale-before.json"
LIMITS = {64: 5.0, 4096: 20.0}  # us per decision the policies are held to
REPEATS = 5
QUALITY = ("round_robin", "least_load", "power_of_two", "cache_aware")


def targets(n: int, seed: int = 0) -> tuple[Target, ...]:
    registry = Registry()
    for i in range(n // 16):
        w = registry.add(
            Worker(id=f"e{i}", url=f"http://10.1.{i // 250}.{i % 250}:8000", dialect="vllm")
        )
        w.ranks = 16
        registry.mark_ready(w)
    pool = registry.snapshot.pool()
    rng = random.Random(seed)
    for t in pool:
        t.outstanding = rng.randint(0, 20)
        t.outstanding_tokens = t.outstanding * rng.randint(200, 4000)
    return pool


def held_prefix(pool: tuple[Target, ...], tokens: int, rng: random.Random) -> Prefix:
    """What the KV-event index tells ``prefix``: a few targets hold part of the prompt
    (a shared system prompt, in 16-token blocks), the rest none."""
    holders = rng.sample(pool, rng.randint(1, 4))
    return Prefix(tokens, {t.label: rng.randrange(0, tokens, 16) for t in holders})


def decision_us(policy: str, n: int, decisions: int, repeats: int = REPEATS) -> float:
    """CPU us per decision: the best of ``repeats`` identical runs, each with a fresh
    policy (so a run of a sticky policy places as many new keys as the first): on a
    shared machine the best run is the one least disturbed."""
    pool = targets(n)
    rng = random.Random(1)
    infos = []
    for i in range(decisions):
        tokens = rng.randint(100, 4000)
        infos.append(
            RequestInfo(
                key=f"s{rng.randrange(n * 4)}",
                text=f"system {rng.randrange(8)} " * 40,
                tokens=tokens,
                now=i * 0.01,
                prefix=held_prefix(pool, tokens, rng),
            )
        )
    best = float("inf")
    for _ in range(repeats):
        chooser = make_policy(policy, PolicyOptions(assignment="min_load"))
        t0 = time.process_time()
        for info in infos:
            chooser.select(pool, info)
        best = min(best, time.process_time() - t0)
    return best / decisions * 1e6


def quality(policy: str, ranks: int, requests: int) -> dict[str, float]:
    configs = [EngineConfig(dp_size=16, limits=RankLimits(max_running=64))] * (ranks // 16)
    router = SimRouter(configs, policy)
    rng = random.Random(7)
    systems = [[rng.getrandbits(24) for _ in range(512)] for _ in range(16)]
    # ~60% of what the ranks can serve: busy, not saturated
    rate = ranks * 4.0
    t, arrivals = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        tail = [rng.getrandbits(24) for _ in range(rng.randint(32, 256))]
        arrivals.append(Arrival(t, systems[rng.randrange(16)] + tail, rng.randint(16, 128)))
    sim = OfflineSim(configs, router.route, on_finish=router.finished)
    report = sim.run(arrivals)
    counts = [r.requests for r in report.ranks]
    return {
        "imbalance": max(counts) / statistics.mean(counts),
        "ttft_p99": report.ttft.p99,
        "cpu_s": report.cpu_seconds,
    }


def run(quick: bool, out: Path) -> Result:
    sizes = SIZES[:3] if quick else SIZES
    decisions = 2000 if quick else 5000
    cost = {
        p: [decision_us(p, n, decisions if n < 4096 else decisions // 2) for n in sizes]
        for p in POLICIES
    }
    lines(
        out / "scale.png",
        sizes,
        cost,
        "policy decision cost against targets",
        "targets",
        "us per decision (CPU)",
        logx=True,
    )
    before = json.loads(BEFORE.read_text()) if BEFORE.exists() else None
    old = before["decision_us"] if before else {}
    rows: list[list[Cell]] = [
        [p, *cost[p], *(old.get(p, [None] * len(SIZES))[: len(sizes)] if before else [])]
        for p in POLICIES
    ]
    columns = ["policy", *(f"us @ {n}" for n in sizes)]
    if before:
        columns += [f"before @ {n}" for n in sizes]
    checks = {
        f"{p} decides in under {limit:g} us at {n} targets": cost[p][sizes.index(n)] < limit
        for p in POLICIES
        for n, limit in LIMITS.items()
        if n in sizes
    }
    found: dict[str, dict[str, float]] = {}
    for ranks in (1024,) if quick else (1024, 4096):
        for p in QUALITY:
            found[f"{p}@{ranks}"] = quality(p, ranks, 5_000 if quick else 20_000)
    quality_rows: list[list[Cell]] = [
        [name, m["imbalance"], m["ttft_p99"] * 1e3] for name, m in found.items()
    ]
    widest = max(cost["round_robin"][-1], 1e-9)
    slowest = max(POLICIES, key=lambda p: cost[p][-1])
    return Result(
        scenario="scale",
        title="7. Scale: decision cost and routing at thousands of ranks",
        method=(
            f"Decision cost: CPU time of {decisions} policy decisions among N targets with "
            f"random loads (one core, the policies as the router runs them), the best of "
            f"{REPEATS} identical runs with a fresh policy each (the 'before' figures: one "
            "run). Quality: "
            "offline simulator, engines x DP16, Poisson chat-like load at ~60% of capacity, "
            f"{'5,000' if quick else '20,000'} requests; imbalance = busiest rank's "
            "requests / mean."
        ),
        tables=[
            Table(
                columns,
                rows,
                "decision cost (CPU us)"
                + (f"; before: {before['run']['when']}, {before['note']}" if before else ""),
            ),
            Table(["policy @ ranks", "imbalance", "TTFT p99 ms"], quality_rows, "routing quality"),
        ],
        verdict=(
            f"round_robin decides in {widest:.1f} us at {sizes[-1]} targets; the costliest, "
            f"{slowest}, takes {cost[slowest][-1]:.0f} us there."
        ),
        checks=checks,
        plots=["scale.png"],
        data={"decision_us": cost, "quality": found},
    )
