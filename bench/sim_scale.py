"""How fast the offline simulator runs a large cluster (CPU seconds, one process).

    .venv/bin/python bench/sim_scale.py [--requests 100000] [--engines 64] [--dp 16]

Runs the same seeded workload (shared 512-token system prompt, 16-128 token
tails, 8-48 output tokens, Poisson arrivals over 20 virtual seconds) routed by
flat round robin, once with every decode step simulated as its own event and
once with the multi-step fast path, and prints both side by side. Both runs
must produce the same timeline; the table shows they do.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from collections.abc import Iterator

from dprouter.sim.config import EngineConfig
from dprouter.sim.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.report import SimReport


def workload(n: int, seconds: float, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    system = list(range(10_000, 10_512))
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(n / seconds)
        tail = [rng.getrandbits(20) for _ in range(rng.randint(16, 128))]
        out.append(Arrival(t, system + tail, rng.randint(8, 48)))
    return out


def run(engines: int, dp: int, arrivals: list[Arrival], max_steps: int) -> SimReport:
    slots: Iterator[tuple[int, int | None]] = itertools.cycle(
        [(e, r) for r in range(dp) for e in range(engines)]
    )

    def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        return next(slots)

    configs = [EngineConfig(dp_size=dp)] * engines
    return OfflineSim(configs, route, max_steps=max_steps).run(arrivals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--dp", type=int, default=16)
    args = ap.parse_args()
    t0 = time.process_time()
    arrivals = workload(args.requests, 20.0)
    gen = time.process_time() - t0
    single = run(args.engines, args.dp, arrivals, max_steps=1)
    fast = run(args.engines, args.dp, arrivals, max_steps=1 << 20)
    ranks = args.engines * args.dp
    print(
        f"{args.requests} requests on {args.engines} engines x DP{args.dp} = {ranks} ranks "
        f"(workload generation {gen:.1f} s CPU, not counted)"
    )
    print(f"{'mode':<22}{'cpu s':>8}{'req/cpu s':>11}{'TTFT p99 ms':>13}{'TPOT p50 ms':>13}")
    for name, rep in (("every step an event", single), ("multi-step fast path", fast)):
        print(
            f"{name:<22}{rep.cpu_seconds:>8.1f}{rep.requests / rep.cpu_seconds:>11.0f}"
            f"{rep.ttft.p99 * 1e3:>13.2f}{rep.tpot.p50 * 1e3:>13.2f}"
        )
    # sums of many step times differ from one product in the last bits only
    pairs = [(single.makespan, fast.makespan)]
    pairs += [
        (getattr(a, q), getattr(b, q))
        for a, b in ((single.ttft, fast.ttft), (single.tpot, fast.tpot))
        for q in ("p50", "p90", "p99")
    ]
    same = all(math.isclose(x, y, rel_tol=1e-9) for x, y in pairs)
    print(f"speed-up {single.cpu_seconds / fast.cpu_seconds:.2f}x; identical timeline: {same}")


if __name__ == "__main__":
    main()
