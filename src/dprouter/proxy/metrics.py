"""The router's own Prometheus series, in a registry of its own (two routers, two registries)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import HOLDS, Target
from dprouter.proxy.local_metrics import CounterFamily, HistogramFamily, Tally

TARGET = ["role", "worker", "dp_rank"]
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
REQUESTS = (
    "dprouter_requests",
    "Requests answered, by target and HTTP status.",
    [*TARGET, "status"],
)
ERRORS = ("dprouter_upstream_errors", "Failed attempts, by target and cause.", [*TARGET, "cause"])
DURATION = (
    "dprouter_request_duration_seconds",
    "Time from request to last byte, by target.",
    TARGET,
)
# what a request held in the router waits for: a free running slot (the dispatcher), or a
# worker that may serve it (every one that could is held, or older than the weights asked)
Why = Literal["slot", "worker"]
WHYS: tuple[Why, ...] = ("slot", "worker")
HELD = "dprouter_held_requests"
FIRST_BYTE = (
    "dprouter_time_to_first_byte_seconds",
    "Time from request to the first response byte (TTFT for streams), by target.",
    TARGET,
)


class _Live(Collector):
    """Gauges read from the targets at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        outstanding = GaugeMetricFamily(
            "dprouter_outstanding", "Requests in flight per target.", labels=TARGET
        )
        reported = GaugeMetricFamily(
            "dprouter_engine_load", "Running + waiting the engine last reported.", labels=TARGET
        )
        engine_tokens = GaugeMetricFamily(
            "dprouter_engine_tokens",
            "Tokens the engine last reported holding (KV cache; SGLang: + queued uncached).",
            labels=TARGET,
        )
        token_load = GaugeMetricFamily(
            "dprouter_token_load",
            "Tokens min_tokens compares: the router's in flight (prompt + output budget "
            "left), or the engine's report plus what was sent since, if more.",
            labels=TARGET,
        )
        ready = GaugeMetricFamily(
            "dprouter_worker_ready",
            "1 when the worker is discovered and routable: healthy, with a rank whose breaker "
            "is closed.",
            labels=["worker"],
        )
        stale = GaugeMetricFamily(
            "dprouter_discovery_stale",
            "1 while the membership source (etcd, Kubernetes) cannot be read: the last "
            "membership read keeps routing.",
        )
        stale.add_metric([], 1.0 if self.registry.stale else 0.0)
        moves = CounterMetricFamily(
            "dprouter_session_moves",
            "Routing keys manual moved off a target loaded past --session-bound.",
        )
        moves.add_metric([], self.registry.board.moves)
        held = GaugeMetricFamily(
            "dprouter_worker_held",
            "1 for the hold the worker is in (paused, updating its weights, asleep: the "
            "engine commands relayed), 0 for the others.",
            labels=["worker", "state"],
        )
        version = InfoMetricFamily(
            "dprouter_worker_weight_version",
            "The weights' version the worker serves, as its engine last said it.",
            labels=["worker"],
        )
        for w in self.registry.workers.values():
            routable = w.ready and not all(t.tripped for t in w.targets)
            ready.add_metric([w.id], 1.0 if routable else 0.0)
            hold = w.hold
            for state in HOLDS.values():
                held.add_metric([w.id, state], 1.0 if state == hold else 0.0)
            if w.weight_version is not None:
                version.add_metric([w.id], {"version": w.weight_version})
            for t in w.targets:
                outstanding.add_metric([w.role, w.id, t.rank_label], t.outstanding)
                reported.add_metric([w.role, w.id, t.rank_label], t.reported)
                engine_tokens.add_metric([w.role, w.id, t.rank_label], t.reported_tokens)
                token_load.add_metric([w.role, w.id, t.rank_label], t.token_load)
        yield outstanding
        yield reported
        yield engine_tokens
        yield token_load
        yield ready
        yield held
        yield version
        yield stale
        yield moves


class TargetSeries:
    """One target's children of the labelled series, looked up once and kept."""

    def __init__(self, metrics: RouterMetrics, target: Target) -> None:
        labels = (target.worker.role, target.worker.id, target.rank_label)
        self.target = target
        self._labels = labels
        self._metrics = metrics
        self._answered: dict[int, Incs] = {}
        self._failed: dict[str, Incs] = {}
        self.first_byte: Observes = metrics.first_byte.child(labels)
        self.duration: Observes = metrics.duration.child(labels)

    def answered(self, status: int) -> None:
        child = self._answered.get(status)
        if child is None:
            child = self._metrics.requests.child((*self._labels, str(status)))
            self._answered[status] = child
        child.inc()

    def failed(self, cause: str) -> None:
        child = self._failed.get(cause)
        if child is None:
            child = self._failed[cause] = self._metrics.errors.child((*self._labels, cause))
        child.inc()


class Observes(Protocol):
    def observe(self, amount: float) -> None: ...


class Incs(Protocol):
    def inc(self, amount: float = 1.0) -> None: ...


class Shared:
    """A prometheus_client metric as a ``local_metrics`` family: for serving processes, whose
    values live in per-process files."""

    def __init__(self, metric: Counter | Histogram) -> None:
        self.metric = metric

    def child(self, labels: tuple[str, ...]) -> Any:
        return self.metric.labels(*labels)


class RouterMetrics:
    """``shared_dir``: one serving process of several; counters and histograms are kept
    in per-process files there (prometheus_client's multiprocess mode) and summed on
    exposition; the gauges are read off the shared board, so they are the whole
    router's already. ``classes``: the priority classes (``--classes``), highest first."""

    def __init__(
        self, registry: Registry, shared_dir: str | None = None, *, classes: Sequence[str]
    ) -> None:
        self.shared_dir = shared_dir
        self.classes = tuple(classes)
        self.live = _Live(registry)
        self.extra: list[Collector] = []  # read at scrape time too (``add``)
        self.prom = CollectorRegistry(auto_describe=False)
        p = self.prom
        # per target, on every request: plain numbers in one process (see ``local_metrics``)
        self.requests: CounterFamily | Shared
        self.errors: CounterFamily | Shared
        self.duration: HistogramFamily | Shared
        self.first_byte: HistogramFamily | Shared
        if shared_dir is None:
            tally = Tally()
            p.register(tally)
            self.requests = tally.counter(*REQUESTS)
            self.errors = tally.counter(*ERRORS)
            self.duration = tally.histogram(*DURATION, LATENCY_BUCKETS)
            self.first_byte = tally.histogram(*FIRST_BYTE, LATENCY_BUCKETS)
        else:
            self.requests = Shared(Counter(*REQUESTS, registry=p))
            self.errors = Shared(Counter(*ERRORS, registry=p))
            self.duration = Shared(Histogram(*DURATION, buckets=LATENCY_BUCKETS, registry=p))
            self.first_byte = Shared(Histogram(*FIRST_BYTE, buckets=LATENCY_BUCKETS, registry=p))
        self.rejected = Counter(
            "dprouter_rejected", "Requests refused before routing, by cause.", ["cause"], registry=p
        )
        self.pairs = Counter(
            "dprouter_pd_pairs",
            "P/D requests answered, by the prefill and the decode target that served them.",
            ["prefill_worker", "prefill_rank", "decode_worker", "decode_rank"],
            registry=p,
        )
        self.held = Gauge(
            HELD,
            "Requests held in the router now, by class and what they wait for: a free "
            "running slot (slot: the dispatcher) or a worker that may serve them (worker: "
            "every one that could is held, or older than the weights asked for).",
            ["class", "why"],
            registry=p,
            multiprocess_mode="livesum",
        )
        # every class's series from the start, at 0 (a query finds them before any is held)
        self._held = {
            (priority, why): self.held.labels(name, why)
            for priority, name in enumerate(self.classes)
            for why in WHYS
        }
        # livemax: under --processes, the most lagging live process (a dead one's file goes)
        self.loop_lag = Gauge(
            "dprouter_event_loop_lag_seconds",
            "How late a 100 ms timer fired on the event loop: the worst of the last 10 s.",
            registry=p,
            multiprocess_mode="livemax",
        )
        # the front door, by tenant (a listed one's name, else "default") and class
        self.admitted = Counter(
            "dprouter_tenant_admitted",
            "Requests the front door let in, by tenant and class.",
            ["tenant", "class"],
            registry=p,
        )
        self.limited = Counter(
            "dprouter_tenant_limited",
            "Requests refused with a 429 by a tenant's limit, by tenant and limit.",
            ["tenant", "limit"],
            registry=p,
        )
        self.shed = Counter(
            "dprouter_tenant_shed",
            "Held requests answered 503 (shed for a higher class, or held too long), by "
            "tenant, class and why.",
            ["tenant", "class", "why"],
            registry=p,
        )
        self.queued = Histogram(
            "dprouter_tenant_queued_seconds",
            "Time requests were held in the router before a running slot freed, by tenant "
            "and class.",
            ["tenant", "class"],
            buckets=LATENCY_BUCKETS,
            registry=p,
        )
        if shared_dir is None:
            p.register(self.live)
        self._series: dict[int, TargetSeries] = {}
        self._pairs: dict[tuple[int, int], tuple[Target, Target, Any]] = {}

    def holding(self, why: Why, priority: int, change: int) -> None:
        """``change`` more requests of class ``priority`` (an index into ``classes``) held
        in this process, waiting for ``why``."""
        self._held[(priority, why)].inc(change)

    def held_now(self) -> dict[tuple[str, str], int]:
        """Requests held now in the whole router (every serving process's, summed), by
        (class, why)."""
        if self.shared_dir is None:
            families = self.held.collect()
        else:
            # the livesum gauges' files alone (this gauge's: prometheus_client names each
            # file by kind, mode and pid), not every series: 0.1 ms, where all of a busy
            # router's histograms take 10 ms
            files = glob.glob(os.path.join(self.shared_dir, "gauge_livesum_*.db"))
            families = MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call]
        found: dict[tuple[str, str], int] = {(c, w): 0 for c in self.classes for w in WHYS}
        for family in families:
            if family.name == HELD:
                for s in family.samples:
                    key = (s.labels["class"], s.labels["why"])
                    found[key] = found.get(key, 0) + round(s.value)
        return found

    def add(self, collector: Collector) -> None:
        """More series read at scrape time (the KV-event feed's)."""
        self.extra.append(collector)
        if self.shared_dir is None:
            self.prom.register(collector)

    def series(self, target: Target) -> TargetSeries:
        found = self._series.get(id(target))
        if found is None or found.target is not target:
            found = self._series[id(target)] = TargetSeries(self, target)
        return found

    def paired(self, prefill: Target, decode: Target) -> None:
        """One P/D answer more for the pair; its child is looked up once, as ``series``'
        are (the entry holds both targets, so their ids are not reused meanwhile)."""
        found = self._pairs.get((id(prefill), id(decode)))
        if found is None:
            labels = (prefill.worker.id, prefill.rank_label, decode.worker.id, decode.rank_label)
            found = self._pairs[(id(prefill), id(decode))] = (
                prefill,
                decode,
                self.pairs.labels(*labels),
            )
        found[2].inc()

    def whole(self) -> CollectorRegistry:
        """The whole router's series: under --processes, every process's summed."""
        if self.shared_dir is None:
            return self.prom
        whole = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(whole, self.shared_dir)  # type: ignore[no-untyped-call]
        whole.register(self.live)
        for collector in self.extra:
            whole.register(collector)
        return whole

    def exposition(self) -> bytes:
        return generate_latest(self.whole())
