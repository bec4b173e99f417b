"""What an offline simulation measured: latency percentiles and per-rank use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dprouter.sim.model.request import SimRequest


@dataclass(frozen=True)
class RankUse:
    engine: int
    rank: int
    requests: int
    busy: float  # share of the makespan this rank had its own work in a step
    mean_waiting: float  # time-weighted waiting-queue length
    max_waiting: int
    prefix_hit_rate: float
    mean_load: float = 0.0  # time-weighted running + waiting (outstanding on the rank)
    max_load: int = 0


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class SimReport:
    requests: int
    makespan: float  # virtual seconds from 0 to the last finish
    throughput: float  # output tokens per virtual second
    ttft: Percentiles
    tpot: Percentiles
    ranks: list[RankUse]
    cpu_seconds: float  # process CPU time the simulation itself took

    def table(self) -> str:
        lines = [
            f"requests {self.requests}  makespan {self.makespan:.2f}s  "
            f"throughput {self.throughput:.0f} tok/s  cpu {self.cpu_seconds:.2f}s",
            f"TTFT p50/p90/p99 {_ms(self.ttft)}   TPOT p50/p90/p99 {_ms(self.tpot)}",
            f"{'engine':>6} {'rank':>4} {'reqs':>6} {'busy':>6} "
            f"{'wait~':>7} {'wait^':>6} {'hit':>5}",
        ]
        for r in self.ranks:
            lines.append(
                f"{r.engine:>6} {r.rank:>4} {r.requests:>6} {r.busy:>6.0%} "
                f"{r.mean_waiting:>7.2f} {r.max_waiting:>6} {r.prefix_hit_rate:>5.0%}"
            )
        return "\n".join(lines)


def _ms(p: Percentiles) -> str:
    return f"{p.p50 * 1e3:.1f}/{p.p90 * 1e3:.1f}/{p.p99 * 1e3:.1f} ms"


def percentiles(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0, 0.0)
    s = sorted(values)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return Percentiles(at(0.50), at(0.90), at(0.99))


def summarise(
    done: Sequence[SimRequest], ranks: list[RankUse], makespan: float, cpu: float
) -> SimReport:
    ttft = [r.first_token_at - r.arrival for r in done if r.first_token_at is not None]
    tpot = [
        (r.finished_at - r.first_token_at) / (r.generated - 1)
        for r in done
        if r.finished_at is not None and r.first_token_at is not None and r.generated > 1
    ]
    tokens = sum(r.generated for r in done)
    return SimReport(
        requests=len(done),
        makespan=makespan,
        throughput=tokens / makespan if makespan else 0.0,
        ttft=percentiles(ttft),
        tpot=percentiles(tpot),
        ranks=ranks,
        cpu_seconds=cpu,
    )
