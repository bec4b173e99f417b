"""The per-target series of a router alone in its process, kept as plain numbers.

prometheus_client takes a lock per value and walks the buckets in Python: two
histogram observations and a counter per request cost 4 to 8 us, a tenth of
what the router adds to a request over a bare proxy (``bench overhead``). One
event loop needs no lock, so these are plain numbers, turned into the same
Prometheus families (``_total``, ``_bucket``, ``_count``, ``_sum``, ``_created``)
when scraped. Serving processes of ``--processes N`` keep prometheus_client's
multiprocess values instead: the parent sums their files.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]
# prometheus_client's own switch for the _created series, read the way it reads it
CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true",
    "1",
    "t",
)


class Count:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Histogram:
    """Counts per bucket (not cumulative: one add per observation), and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds  # ascending, +Inf last
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount
        self.sum += amount


class CounterFamily:
    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.children: dict[Labels, Count] = {}

    def child(self, labels: Labels) -> Count:
        found = self.children.get(labels)
        if found is None:
            found = self.children[labels] = Count()
        return found

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, c in self.children.items():
            family.add_metric(labels, c.value, created=c.created if CREATED else None)
        return family


class HistogramFamily:
    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.bounds = (*(float(b) for b in buckets), float("inf"))
        self.les = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]
        self.children: dict[Labels, Histogram] = {}

    def child(self, labels: Labels) -> Histogram:
        found = self.children.get(labels)
        if found is None:
            found = self.children[labels] = Histogram(self.bounds)
        return found

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, h in self.children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self.les, h.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(labels, buckets, h.sum)
            if CREATED:
                family.add_sample(
                    self.name + "_created", dict(zip(self.labels, labels, strict=True)), h.created
                )
        return family


class Tally(Collector):
    """Families kept by this process alone, collected in the order they were made."""

    def __init__(self) -> None:
        self.families: list[CounterFamily | HistogramFamily] = []

    def counter(self, name: str, documentation: str, labels: Sequence[str]) -> CounterFamily:
        self.families.append(family := CounterFamily(name, documentation, labels))
        return family

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> HistogramFamily:
        self.families.append(family := HistogramFamily(name, documentation, labels, buckets))
        return family

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.family()
