"""How an engine places a request that pins no rank (its internal balancer)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.rank import Rank
from dprouter.sim.model.request import SimRequest


class DispatchError(ValueError):
    """The engine cannot place this request (its message goes to the client)."""


class Dispatcher(Protocol):
    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int: ...


class VllmScore:
    """vLLM's DP load balancer: lowest ``waiting*4 + running``, first minimum wins.

    The counts come from a snapshot published at most every ``interval``
    seconds (taken at the first pick after the interval expired), so a burst
    inside one interval sees the same stale counts. With
    ``reserve_locally`` each pick adds one waiting request to the snapshot until
    the next one replaces it (what vLLM >= 0.10 does between coordinator updates).
    """

    def __init__(self, interval: float, reserve_locally: bool) -> None:
        self.interval = interval
        self.reserve_locally = reserve_locally
        self.snapshot: list[list[int]] = []
        self.published = float("-inf")

    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int:
        if now - self.published >= self.interval:
            self.snapshot = [[r.num_waiting, r.num_running] for r in ranks]
            self.published = now
        best, best_score = 0, None
        for i, (waiting, running) in enumerate(self.snapshot):
            score = waiting * 4 + running
            if best_score is None or score < best_score:
                best, best_score = i, score
        if self.reserve_locally:
            self.snapshot[best][0] += 1
        return best


class RoundRobin:
    """SGLang ``round_robin``: a counter over ranks, blind to load."""

    def __init__(self) -> None:
        self.counter = 0

    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int:
        rank = self.counter % len(ranks)
        self.counter += 1
        return rank


class ShortestQueue:
    """SGLang ``shortest_queue``: fewest running + waiting; ties rotate."""

    def __init__(self) -> None:
        self.start = 0

    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int:
        n = len(ranks)
        order = [(self.start + i) % n for i in range(n)]
        best = min(order, key=lambda i: ranks[i].num_running + ranks[i].num_waiting)
        self.start = (best + 1) % n
        return best


class SglangBudget:
    """SGLang 0.5.23's ``total_requests`` / ``total_tokens``: the rank with the fewest
    running + waiting requests (or tokens, requests breaking ties), first minimum wins.

    The counts are re-read from the schedulers at most every ``interval`` seconds (20 ms
    in SGLang); each pick adds its request (and prompt tokens) to the chosen rank until
    the next read replaces them, so a burst spreads instead of landing on one rank.
    """

    def __init__(self, tokens: bool, interval: float = 0.02) -> None:
        self.tokens = tokens
        self.interval = interval
        self.requests: list[int] = []
        self.token_counts: list[int] = []
        self.read = float("-inf")

    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int:
        if now - self.read >= self.interval:
            self.requests = [r.num_running + r.num_waiting for r in ranks]
            self.token_counts = [r.kv_used + sum(w.prompt_len for w in r.waiting) for r in ranks]
            self.read = now
        if self.tokens:
            best = min(range(len(ranks)), key=lambda i: (self.token_counts[i], self.requests[i]))
        else:
            best = self.requests.index(min(self.requests))
        self.requests[best] += 1
        self.token_counts[best] += req.prompt_len
        return best


class FollowBootstrapRoom:
    """SGLang ``follow_bootstrap_room`` (a P/D prefill's default): rank = room % dp_size."""

    def pick(self, ranks: Sequence[Rank], req: SimRequest, now: float) -> int:
        if req.bootstrap_room is None:
            raise DispatchError(
                "req.bootstrap_room should not be None. Do not send requests directly to "
                "prefill or decode instances; send to the router instead."
            )
        return req.bootstrap_room % len(ranks)


def make_dispatcher(config: EngineConfig) -> Dispatcher:
    mode = config.dispatch_mode
    if mode == "vllm":
        return VllmScore(config.stats_interval, config.reserve_locally)
    if mode == "round_robin":
        return RoundRobin()
    if mode == "shortest_queue":
        return ShortestQueue()
    if mode in ("total_requests", "total_tokens"):
        return SglangBudget(tokens=mode == "total_tokens")
    return FollowBootstrapRoom()
