"""The policy protocol: pick one target from a snapshot, with no I/O."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from dprouter.fleet.targets import Target
from dprouter.policies import kernels

Assignment = Literal["random", "min_load", "min_group"]


class Queued(Protocol):
    """Prompt tokens the router sent to each target that its events have not stored yet:
    the target's prefill still to do, as a row in the order of any pool."""

    def of(self, targets: Sequence[Target]) -> npt.NDArray[np.int64]: ...


@dataclass(frozen=True, slots=True)
class QueuedBy:
    """A literal ``Queued``: tokens by target label (a target left out has none)."""

    tokens: Mapping[str, int]

    def of(self, targets: Sequence[Target]) -> npt.NDArray[np.int64]:
        return np.array([self.tokens.get(t.label, 0) for t in targets], np.int64)


@dataclass(frozen=True, slots=True)
class Prefix:
    """How much of a prompt each target holds in its KV cache, as its engine's events
    said or the router has sent there since (pending): ``held[label]`` of the prompt's
    ``tokens``, in leading blocks (a target holding none is left out); ``queued``: each
    target's pending tokens (None: nothing pending anywhere); ``stored``: of ``held``,
    what the events have stored (None: all of it)."""

    tokens: int
    held: Mapping[str, int]
    queued: Queued | None = None
    stored: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestInfo:
    """What a policy may know about a request (named on construction, never by position)."""

    key: str | None = None  # routing key (session), if the client sent one
    text: str = ""  # prompt text, for prefix affinity
    # the LoRA adapter it runs (``Snapshot.adapter``; None: the base model): an engine
    # caches each adapter's prompts apart, so affinity, to a prefix or a key, is kept
    # per adapter, and the base model's once, whatever name a path gives it
    adapter: str | None = None
    tokens: int = 0  # estimated prompt + output tokens
    now: float = 0.0  # monotonic seconds, for expiring idle keys
    pool: Hashable = None  # which pool the targets come from (role, model, ...): counters per pool
    attempt: int = 0  # > 0: a retry after a failed attempt, over the targets not yet tried
    prefix: Prefix | None = None  # for a policy that ``needs_tokens``: the cached prefix


@dataclass(frozen=True)
class PolicyOptions:
    seed: int = 0
    assignment: Assignment = "random"  # manual: how a new key is placed
    key_ttl: float = 3600.0  # manual: an idle key is forgotten after this many seconds
    session_bound: float = 1.5  # manual: a key leaves a target loaded past bound x mean + 2
    cache_threshold: float = 0.5  # cache_aware: least prefix share that keeps affinity
    cache_bound: float = 1.5  # cache_aware: affinity holds while the holder's load is at
    # most bound x (the pool's mean load + 1)
    prefix_weight: float = 4.0  # prefix: worth of holding the whole prompt...
    prefix_bound: float = 1.5  # ...counted while the target's load <= bound x (mean + 1)
    load_weight: float = 1.0  # prefix: cost of requests in flight, relative to the mean
    token_weight: float = 1.0  # prefix: cost of tokens in flight, relative to the mean
    queue_weight: float = 1.0  # prefix: cost of prefill queued, in prompts like this one


class Policy(Protocol):
    name: str

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        """``targets`` is never empty; return one of them."""
        ...


def affinity_key(request: RequestInfo) -> str | None:
    """The routing key as a policy keeps it: per adapter (one session sent to two adapters
    is two, each where its own adapter's prompts are cached); None: the request has no
    key."""
    key = request.key
    if key is None or request.adapter is None:
        return key
    return f"{key}\x1f{request.adapter}"  # a separator no header and no sane key holds


def needs_tokens(policy: Policy) -> bool:
    """The policy reads ``RequestInfo.prefix``: the request path tokenises the prompt and
    looks it up for it. An attribute only such policies declare, so the protocol stays
    one method."""
    return bool(getattr(policy, "needs_tokens", False))


CACHED = 16  # pools a policy keeps readers for (a snapshot's pools; retries make more)
I64 = npt.NDArray[np.int64]


def rotated(targets: Sequence[Target], start: int) -> Iterable[Target]:
    """``targets`` from index ``start`` round to just before it."""
    s = start % len(targets)
    return chain(targets[s:], targets[:s]) if s else targets


class Reader:
    """One pool's slots on the board, in the pool's order, for the compiled scans
    (``kernels``): a row of the board is read through them. Every target of a pool is on
    its registry's board."""

    __slots__ = ("board", "index", "pool", "scratch", "worker_index")

    def __init__(self, pool: Sequence[Target]) -> None:
        self.pool = pool
        self.board = pool[0].board
        self.index = np.array([t.slot for t in pool], np.intp)
        self.worker_index = np.array([t.worker.slot for t in pool], np.intp)
        self.scratch = np.zeros(len(pool), np.int64)  # a row read for a scan

    def least(self, row: I64, start: int) -> int:
        """Where ``row`` (any per-slot row) is least over the pool, the first at or after
        ``start`` (wrapping round): a rotating tie-break."""
        return int(kernels.least_at(row, self.index, start % len(self.pool)))

    def total_load(self) -> int:
        return int(kernels.total(self.board.load, self.index))


class Pooled(Protocol):
    pool: Sequence[Target]


P = TypeVar("P", bound=Pooled)


class ByPool(Generic[P]):
    """What a policy keeps per pool (``make(pool)``), by pool identity: a snapshot's pools
    are kept tuples. The last pool's is found without a lookup."""

    def __init__(self, make: Callable[[Sequence[Target]], P], scans: bool = True) -> None:
        if scans:  # the compiled scans loaded when the policy is made, not on a request
            kernels.warm()
        self.make = make
        self._kept: dict[int, P] = {}
        self._last: P | None = None

    def of(self, pool: Sequence[Target]) -> P:
        last = self._last
        if last is not None and last.pool is pool:
            return last
        found = self._kept.get(id(pool))
        if found is None or found.pool is not pool:
            if len(self._kept) >= CACHED:
                self._kept.clear()
            found = self._kept[id(pool)] = self.make(pool)
        self._last = found
        return found


def readers(scans: bool = True) -> ByPool[Reader]:
    """A policy's readers of the board, by pool; ``scans`` False: for a reader that only
    gathers rows with numpy, which need no compiled kernel (nor numba's ~135 MB)."""
    return ByPool(Reader, scans)


def first_least(values: npt.NDArray[np.float64], start: int) -> int:
    """Where the least value is, the first at or after ``start`` (< n), wrapping round,
    with numpy's argmin: vectorised, it beats a compiled loop from ~2,048 values (4,096:
    ~3 us against 5-9, the loop's search for the least running on after its pass)."""
    after = int(values[start:].argmin()) + start
    if not start:
        return after
    before = int(values[:start].argmin())
    return after if values.item(after) <= values.item(before) else before


def least_loaded(targets: Sequence[Target], start: int, reader: Reader) -> Target:
    """Fewest outstanding; ties go to the first from ``start`` (callers rotate it)."""
    if len(targets) == 1:
        return targets[0]
    return targets[reader.least(reader.board.load, start)]


def make_rng(options: PolicyOptions) -> random.Random:
    return random.Random(options.seed)
