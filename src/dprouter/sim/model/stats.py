"""Cumulative counters of one rank, read by the metrics endpoints and reports."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# vLLM's bucket bounds for vllm:time_to_first_token_seconds
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = TTFT_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class RankStats:
    success: int = 0  # finished with reason "length"
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    busy_time: float = 0.0  # virtual seconds this rank had its own work in a step
    steps: int = 0
    # steps that decoded (SGLang logs one "Decode batch" line per rank for each) and
    # steps that ran a prefill chunk: under DP attention the busiest rank's decode
    # steps are the cost of a burst, whatever the wall time
    decode_steps: int = 0
    prefill_steps: int = 0
    # requests that arrived with no running slot left for them (those waiting ahead
    # counted): each waited in the engine for another to end
    queued: int = 0
    ttft: Histogram = field(default_factory=Histogram)
