"""The router's plain-number series expose exactly what prometheus_client's would."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dprouter.proxy.local_metrics import Tally
from dprouter.proxy.metrics import ERRORS, LATENCY_BUCKETS, REQUESTS

AMOUNTS = (0.0, 0.001, 0.005, 0.0050001, 0.3, 1, 2.5, 299.0, 300.0, 301.0, 1e9)
LABELS = [("regular", "w0", "0"), ("regular", "w0", "1"), ("prefill", "w1", "")]


def text(registry: CollectorRegistry) -> str:
    """The exposition, the _created timestamps (the time each series was made) left out."""
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())


def test_the_same_observations_read_the_same_as_prometheus_clients() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    tally = Tally()
    ours.register(tally)
    name, doc, labelled = "dprouter_request_duration_seconds", "To last byte.", ["a", "b", "c"]
    histogram = Histogram(name, doc, labelled, buckets=LATENCY_BUCKETS, registry=theirs)
    observed = tally.histogram(name, doc, labelled, LATENCY_BUCKETS)
    for i, labels in enumerate(LABELS):
        for amount in AMOUNTS[i:]:
            histogram.labels(*labels).observe(amount)
            observed.child(labels).observe(amount)
    for spec in (REQUESTS, ERRORS):
        counter, counted = Counter(*spec, registry=theirs), tally.counter(*spec)
        for i, labels in enumerate(LABELS[:2]):
            for last in ("200", "503", "connect")[i:]:
                counter.labels(*labels, last).inc()
                counted.child((*labels, last)).inc()
    assert text(ours) == text(theirs)
