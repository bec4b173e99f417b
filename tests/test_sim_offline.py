"""The offline cluster simulator: routing callback, report, and scale."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from dprouter.sim.model.config import EngineConfig
from dprouter.sim.offline.offline import Arrival, Cluster, OfflineSim, Route

SYSTEM = list(range(10_000, 10_512))  # a shared 512-token system prompt


def workload(n: int, seconds: float, seed: int = 0) -> Iterator[Arrival]:
    rng = random.Random(seed)
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(n / seconds)
        tail = [rng.getrandbits(20) for _ in range(rng.randint(16, 128))]
        yield Arrival(t, SYSTEM + tail, rng.randint(8, 48))


def flat_route(engines: int, dp: int) -> Route:
    """One counter over the flat slot space: w0r0, w1r0, ..., w0r1, w1r1, ..."""
    slots: Iterator[tuple[int, int | None]] = itertools.cycle(
        [(e, r) for r in range(dp) for e in range(engines)]
    )

    def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        return next(slots)

    return route


def test_flat_routing_uses_every_rank_evenly_and_reports() -> None:
    route = flat_route(4, 4)
    report = OfflineSim([EngineConfig(dp_size=4)] * 4, route).run(workload(1600, 4.0))
    assert report.requests == 1600
    assert [r.requests for r in report.ranks] == [100] * 16
    assert all(0 < r.busy <= 1 for r in report.ranks)
    assert all(r.prefix_hit_rate > 0.5 for r in report.ranks)  # the system prompt is shared
    assert report.ttft.p50 <= report.ttft.p90 <= report.ttft.p99
    assert report.tpot.p50 >= EngineConfig().cost.step_base
    assert report.throughput > 0


def test_engine_balancer_decides_when_the_route_names_no_rank() -> None:
    config = EngineConfig(persona="sglang", dp_size=4)  # round_robin inside the engine

    def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        return 0, None

    report = OfflineSim([config], route).run(workload(400, 2.0))
    assert [r.requests for r in report.ranks] == [100] * 4


def test_route_sees_live_load() -> None:
    """A least-loaded callback reads the same per-rank counts a router would scrape."""
    engines = 2
    configs = [EngineConfig(dp_size=2)] * engines

    def least_loaded(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        loads = [
            (rank.num_running + rank.num_waiting, e, rank.index)
            for e, eng in enumerate(cluster.engines)
            for rank in eng.ranks
        ]
        _, e, r = min(loads)
        return e, r

    burst = [Arrival(0.0, [i, i + 1, i + 2], 100) for i in range(40)]
    report = OfflineSim(configs, least_loaded).run(burst)
    assert [r.requests for r in report.ranks] == [10, 10, 10, 10]


@pytest.mark.slow
def test_a_thousand_ranks_and_a_hundred_thousand_requests() -> None:
    configs = [EngineConfig(dp_size=16)] * 64
    report = OfflineSim(configs, flat_route(64, 16)).run(workload(100_000, 20.0))
    assert report.requests == 100_000
    counts = sorted(r.requests for r in report.ranks)
    assert len(counts) == 1024
    assert counts[0] == 97 and counts[-1] == 98  # 100,000 / 1,024 spread exactly
    assert min(r.busy for r in report.ranks) > 0
