"""The KV-event series, read off the feed and its index at scrape time (each serving
process follows every stream itself, so its own figures are the whole router's)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dprouter.engines.kvevents.feed import Feed

RANK = ["worker", "dp_rank"]
STREAM = (
    ("batches", "dprouter_kv_events", "KV-event batches applied, by rank."),
    ("replays", "dprouter_kv_replays", "Replays asked of the engine (join, gap, probe)."),
    ("gaps", "dprouter_kv_gaps", "Sequence gaps seen on the live stream."),
    ("restarts", "dprouter_kv_restarts", "Sequences that went back: the engine restarted."),
    ("lost", "dprouter_kv_lost", "Silent streams that did not answer a probe: emptied."),
    ("bad", "dprouter_kv_bad_frames", "Frames that were not KV-event batches."),
)


class KvCollector(Collector):
    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def collect(self) -> Iterator[Metric]:
        index = self.feed.index
        blocks = GaugeMetricFamily(
            "dprouter_kv_blocks",
            "Blocks the index holds for each rank, as its events said.",
            labels=RANK,
        )
        for (worker, rank), found in index.ranks.items():
            blocks.add_metric([worker, str(rank)], len(found.blocks))
        yield blocks
        for attr, name, text in STREAM:
            family = CounterMetricFamily(name, text, labels=RANK)
            for (worker, rank), (stream, _) in self.feed.streams.items():
                family.add_metric([worker, str(rank)], getattr(stream.counts, attr))
            yield family
        counts = index.counts
        for attr, text in (
            ("orphans", "Stored blocks whose parent was never seen (not indexed)."),
            ("dropped", "Stored blocks not indexed: past --kv-capacity."),
            ("ignored", "Events of another medium (CPU), KV group or token kind."),
        ):
            family = CounterMetricFamily(f"dprouter_kv_{attr}", text)
            family.add_metric([], getattr(counts, attr))
            yield family
