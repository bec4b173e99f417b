"""vLLM's per-rank Prometheus series, read from the engine model at scrape time.

Each engine owns its ``CollectorRegistry``; every series carries the rank as
``engine="<rank>"`` and ``model_name``, as vLLM's ``/metrics`` does. Time
values are in the model's virtual seconds (what the simulated GPU took).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dprouter.sim.model.engine import Engine

LABELS = ["engine", "model_name"]
# (series, help, attribute of Rank) for gauges and of RankStats for counters
GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
)
COUNTERS = (
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", "prefix_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", "prefix_hits"),
)


class VllmCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        model = self.engine.config.model
        ranks = self.engine.ranks
        for name, doc, attr in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            for r in ranks:
                g.add_metric([str(r.index), model], float(getattr(r, attr)))
            yield g
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for r in ranks:
            success.add_metric([str(r.index), model, "length"], r.stats.success)
            success.add_metric([str(r.index), model, "abort"], r.stats.aborted)
        yield success
        # what vLLM exports once per engine (``log_metrics_info``): its CacheConfig as
        # labels of a gauge set to 1; a router reads the KV capacity from it
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
        )
        for r in ranks:
            limits = r.limits
            blocks = str(limits.kv_tokens // limits.block_size)
            info.add_metric([str(limits.block_size), "True", blocks, str(r.index)], 1.0)
        yield info
        for name, doc, attr in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            for r in ranks:
                c.add_metric([str(r.index), model], getattr(r.stats, attr))
            yield c
        h = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=LABELS,
        )
        for r in ranks:
            h.add_metric([str(r.index), model], r.stats.ttft.cumulative(), r.stats.ttft.total)
        yield h


def vllm_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmCollector(engine))
    return registry
