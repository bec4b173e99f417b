"""The policy protocol: pick one target from a snapshot, with no I/O."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Literal, Protocol

from dprouter.targets import Target

Assignment = Literal["random", "min_load", "min_group"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestInfo:
    """What a policy may know about a request (named on construction, never by position)."""

    key: str | None = None  # routing key (session), if the client sent one
    text: str = ""  # prompt text, for prefix affinity
    tokens: int = 0  # estimated prompt + output tokens
    now: float = 0.0  # monotonic seconds, for expiring idle keys
    pool: Hashable = None  # which pool the targets come from (role, model, ...): counters per pool
    attempt: int = 0  # > 0: a retry after a failed attempt, over the targets not yet tried


@dataclass(frozen=True)
class PolicyOptions:
    seed: int = 0
    assignment: Assignment = "random"  # manual: how a new key is placed
    key_ttl: float = 3600.0  # manual: an idle key is forgotten after this many seconds
    cache_threshold: float = 0.5  # cache_aware: least prefix share that keeps affinity
    balance_abs: int = 32  # cache_aware: load gap that triggers balancing...
    balance_rel: float = 1.5  # ...when the busiest also has this many times the least


class Policy(Protocol):
    name: str

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        """``targets`` is never empty; return one of them."""
        ...


LOAD = attrgetter("load")


def rotated(targets: Sequence[Target], start: int) -> Iterable[Target]:
    """``targets`` from index ``start`` round to just before it."""
    s = start % len(targets)
    return chain(targets[s:], targets[:s]) if s else targets


def least_loaded(targets: Sequence[Target], start: int = 0) -> Target:
    """Fewest outstanding; ties go to the first from ``start`` (callers rotate it)."""
    return min(rotated(targets, start), key=LOAD)


def make_rng(options: PolicyOptions) -> random.Random:
    return random.Random(options.seed)
