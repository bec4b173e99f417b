"""The last minute of per-target numbers, from the router's own Prometheus series.

Once a second the window reads the cumulative series (answers, failed attempts
by cause, the time-to-first-byte histogram, P/D pairs) and keeps a minute of
them; rates and quantiles are differences between the oldest and newest read,
as Prometheus's ``rate`` and ``histogram_quantile`` would compute them. Reading
the series rather than hooking the request path costs the hot path nothing, and
under ``--processes N`` the series are already the whole router's (summed from
every process's files), so any process answers for all of them.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

Key = tuple[str, str, str]  # role, worker, dp_rank: the series' target labels
Pair = tuple[str, str, str, str]  # prefill worker, rank, decode worker, rank


@dataclass
class Totals:
    """One target's cumulative counts at one read."""

    answered: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


@dataclass
class Sample:
    at: float
    targets: dict[Key, Totals] = field(default_factory=dict)
    pairs: dict[Pair, float] = field(default_factory=dict)
    lag: float = 0.0


def read(registry: CollectorRegistry, at: float) -> Sample:
    sample = Sample(at)
    for family in registry.collect():
        for s in family.samples:
            labels = s.labels
            if s.name == "dprouter_event_loop_lag_seconds":
                sample.lag = max(sample.lag, s.value)
                continue
            if s.name == "dprouter_pd_pairs_total":
                pair = tuple(labels[k] for k in PAIR_LABELS)
                sample.pairs[pair] = s.value  # type: ignore[index]
                continue
            if s.name not in WANTED:
                continue
            key = (labels["role"], labels["worker"], labels["dp_rank"])
            totals = sample.targets.setdefault(key, Totals())
            if s.name == "dprouter_requests_total":
                totals.answered += s.value
            elif s.name == "dprouter_upstream_errors_total":
                cause = labels["cause"]
                totals.errors[cause] = totals.errors.get(cause, 0.0) + s.value
            else:
                le = float(labels["le"])
                totals.buckets[le] = totals.buckets.get(le, 0.0) + s.value
    return sample


PAIR_LABELS = ("prefill_worker", "prefill_rank", "decode_worker", "decode_rank")
WANTED = {
    "dprouter_requests_total",
    "dprouter_upstream_errors_total",
    "dprouter_time_to_first_byte_seconds_bucket",
}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts; None: no request."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last finite bound: that bound, as Prometheus says
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


@dataclass
class Rates:
    """One target over the window."""

    per_second: float
    ttfb_p50: float | None
    ttfb_p99: float | None
    errors: dict[str, int]


class Window:
    def __init__(
        self, read_now: Callable[[], Sample], span: float = 60.0, every: float = 1.0
    ) -> None:
        self.read_now = read_now
        self.span = span
        self.every = every
        self.samples: deque[Sample] = deque()

    def tick(self) -> None:
        sample = self.read_now()
        self.samples.append(sample)
        # keep one read at or before the span's start, so the window covers all of it
        while len(self.samples) > 2 and self.samples[1].at <= sample.at - self.span:
            self.samples.popleft()

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.every)

    @property
    def seconds(self) -> float:
        return self.samples[-1].at - self.samples[0].at if len(self.samples) > 1 else 0.0

    def rates(self) -> dict[Key, Rates]:
        if not self.samples:
            return {}
        old, new, seconds = self.samples[0], self.samples[-1], max(self.seconds, 1e-9)
        found: dict[Key, Rates] = {}
        for key, now in new.targets.items():
            was = old.targets.get(key, Totals())
            buckets = {le: n - was.buckets.get(le, 0.0) for le, n in now.buckets.items()}
            errors = {c: n - was.errors.get(c, 0.0) for c, n in now.errors.items()}
            found[key] = Rates(
                per_second=(now.answered - was.answered) / seconds if self.seconds else 0.0,
                ttfb_p50=quantile(0.5, buckets),
                ttfb_p99=quantile(0.99, buckets),
                errors={c: round(n) for c, n in errors.items() if n > 0},
            )
        return found

    def pairs(self) -> dict[Pair, float]:
        """Requests per P/D pair over the window."""
        if not self.samples:
            return {}
        old, new = self.samples[0], self.samples[-1]
        deltas = {p: n - old.pairs.get(p, 0.0) for p, n in new.pairs.items()}
        return {p: n for p, n in deltas.items() if n > 0}
