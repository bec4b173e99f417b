"""The sim-scale study: how fast the offline simulator runs a large cluster (one process).

The same seeded workload (shared 512-token system prompt, 16-128 token tails,
8-48 output tokens, Poisson arrivals over 20 virtual seconds) on 64 engines x
DP16, routed by flat round robin, runs twice: once with every decode step
simulated as its own event and once with the multi-step fast path. Both runs
must produce the same timeline; the table shows they do. It studies the
simulator, not dprouter: not part of ``bench all``.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from dprouter.bench.report.results import Cell, Result, Table
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.offline.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.offline.report import SimReport

ENGINES, DP = 64, 16
MODES = (("every step an event", 1), ("multi-step fast path", 1 << 20))  # (name, max_steps)


def workload(n: int, seconds: float, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    system = list(range(10_000, 10_512))
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(n / seconds)
        tail = [rng.getrandbits(20) for _ in range(rng.randint(16, 128))]
        out.append(Arrival(t, system + tail, rng.randint(8, 48)))
    return out


def simulate(arrivals: list[Arrival], max_steps: int) -> SimReport:
    slots: Iterator[tuple[int, int | None]] = itertools.cycle(
        [(e, r) for r in range(DP) for e in range(ENGINES)]
    )

    def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        return next(slots)

    configs = [EngineConfig(dp_size=DP)] * ENGINES
    return OfflineSim(configs, route, max_steps=max_steps).run(arrivals)


def same_timeline(a: SimReport, b: SimReport) -> bool:
    # sums of many step times differ from one product in the last bits only
    pairs = [(a.makespan, b.makespan)]
    pairs += [
        (getattr(x, q), getattr(y, q))
        for x, y in ((a.ttft, b.ttft), (a.tpot, b.tpot))
        for q in ("p50", "p90", "p99")
    ]
    return all(math.isclose(x, y, rel_tol=1e-9) for x, y in pairs)


def run(quick: bool, out: Path, sizes: Sequence[int] = ()) -> Result:
    sizes = sizes or ((10_000,) if quick else (100_000,))
    rows: list[list[Cell]] = []
    found: dict[str, dict[str, float]] = {}
    same: dict[int, bool] = {}
    for n in sizes:
        t0 = time.process_time()
        arrivals = workload(n, 20.0)
        found[f"{n} workload"] = {"generation_cpu_s": time.process_time() - t0}
        reports = {name: simulate(arrivals, steps) for name, steps in MODES}
        for name, rep in reports.items():
            found[f"{n} {name}"] = {
                "cpu_s": rep.cpu_seconds,
                "requests_per_cpu_s": rep.requests / rep.cpu_seconds,
                "ttft_p99_ms": rep.ttft.p99 * 1e3,
                "tpot_p50_ms": rep.tpot.p50 * 1e3,
            }
            m = found[f"{n} {name}"]
            rows.append(
                [n, name, m["cpu_s"], m["requests_per_cpu_s"], m["ttft_p99_ms"], m["tpot_p50_ms"]]
            )
        single, fast = reports.values()
        same[n] = same_timeline(single, fast)
        found[f"{n} workload"]["speed_up"] = single.cpu_seconds / fast.cpu_seconds
    largest = sizes[-1]
    return Result(
        scenario="sim-scale",
        title="Sim scale: the offline simulator on a large cluster",
        method=(
            f"{ENGINES} engines x DP{DP} = {ENGINES * DP} ranks, flat round robin over "
            "(engine, rank); seeded workload: a shared 512-token system prompt, 16-128 token "
            "tails, 8-48 output tokens, Poisson arrivals over 20 virtual seconds (its "
            "generation not counted). CPU seconds of one process, each mode on the same "
            "arrivals."
        ),
        tables=[
            Table(["requests", "mode", "cpu s", "req/cpu s", "TTFT p99 ms", "TPOT p50 ms"], rows)
        ],
        verdict=(
            f"The multi-step fast path runs {largest:,} requests "
            f"{found[f'{largest} workload']['speed_up']:.2f}x faster than one event per "
            f"decode step; identical timeline: {same[largest]}."
        ),
        checks={"both modes produce the same timeline": all(same.values())},
        data=found,
    )
