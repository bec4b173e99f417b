"""The policies' scans over a pool, compiled (numba): one pass where numpy takes several.

A numpy call costs ~0.5-1 us before it reads a cell, and a policy that gathers a
pool's rows, combines them and then finds the first least from a rotating start makes
ten; at 4,096 targets each also passes over 32 KB. These loops read the board's rows
through the pool's slots and decide in one or two passes, with the same comparisons as
the plain definitions (for floats, in the float steps each kernel documents), so the
choices are exactly theirs (``tests/test_policy_kernels.py``). Compiled once and cached
on disk (``cache=True``; the first start of a new install compiles, ~2 s); ``warm``
loads them before the first request. No fastmath: it would reorder the float steps.

numba is imported on the first use of a kernel, not with this module: importing it
costs ~65 MB and ~0.15 s, and loading the kernels ~70 MB more, which a router whose
policy scans nothing (``round_robin``, the default; ``random``; ``power_of_two``;
``min_tokens``, numpy alone) never pays, in each of its serving processes. Call a
kernel as ``kernels.name``: a name imported from here before ``load`` stays the
stand-in that loads them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

BLOCK = 64  # bytes per block of ``block_hashes`` (a constant to numba: frozen when compiled)


def _least_at(row: Any, slots: Any, start: int) -> int:
    """The first least of a board row read through the pool's slots, from ``start``."""
    n = slots.shape[0]
    best, least = start, row[slots[start]]
    for i in range(start + 1, n):
        if row[slots[i]] < least:
            best, least = i, row[slots[i]]
    for i in range(start):
        if row[slots[i]] < least:
            best, least = i, row[slots[i]]
    return best


def _total(row: Any, slots: Any) -> int:
    """The sum of a board row over the pool's slots."""
    found = 0
    for i in range(slots.shape[0]):
        found += row[slots[i]]
    return found


def _affinity(row: Any, slots: Any, match: int, bound: float, start: int) -> int:
    """``cache_aware``'s balance rule: ``match`` (a place in the pool; -1: none) while its
    row value is at most ``bound`` x (the pool's mean + 1), else the first least from
    ``start``. One call where the sum and the search took two."""
    if match >= 0:
        n = slots.shape[0]
        found = 0
        for i in range(n):
            found += row[slots[i]]
        if row[slots[match]] <= bound * (found / n + 1.0):
            return match
    return least_at(row, slots, start)


def _rendezvous(seeds: Any, key: np.uint64, scores: Any) -> int:
    """Where splitmix64(key ^ seed) is highest, the first of equal scores: every score
    first (a loop with no branch, vectorised), then the highest with four independent
    maxima, then where it is -- twice as fast as one loop keeping the best as it goes."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    m1 = np.uint64(0xBF58476D1CE4E5B9)
    m2 = np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    n = seeds.shape[0]
    for i in range(n):
        x = (seeds[i] ^ key) + golden
        x = (x ^ (x >> s30)) * m1
        x = (x ^ (x >> s27)) * m2
        scores[i] = x ^ (x >> s31)
    t0 = t1 = t2 = t3 = scores[0]
    i = 0
    while i + 4 <= n:
        a, b, c, d = scores[i], scores[i + 1], scores[i + 2], scores[i + 3]
        t0 = a if a > t0 else t0
        t1 = b if b > t1 else t1
        t2 = c if c > t2 else t2
        t3 = d if d > t3 else t3
        i += 4
    for j in range(i, n):
        t0 = scores[j] if scores[j] > t0 else t0
    top = max(max(t0, t1), max(t2, t3))
    for j in range(n):
        if scores[j] == top:
            return j
    return 0


def _least_value(values: Any) -> Any:
    """The least of ``values``, with four independent minima: one chain waits on each
    compare, four times slower at 4,096. Exact: a minimum does not depend on the order."""
    n = values.shape[0]
    m0 = m1 = m2 = m3 = values[0]
    i = 0
    while i + 4 <= n:
        v0, v1, v2, v3 = values[i], values[i + 1], values[i + 2], values[i + 3]
        m0 = v0 if v0 < m0 else m0
        m1 = v1 if v1 < m1 else m1
        m2 = v2 if v2 < m2 else m2
        m3 = v3 if v3 < m3 else m3
        i += 4
    for j in range(i, n):
        m0 = values[j] if values[j] < m0 else m0
    return min(min(m0, m1), min(m2, m3))


def _first_least(values: Any, start: int) -> int:
    """The first least value at or after ``start`` (< n), wrapping round, in two passes:
    the least value, then the first from ``start`` holding it."""
    n = values.shape[0]
    m = least_value(values)
    for j in range(start, n):
        if values[j] == m:
            return j
    for j in range(start):
        if values[j] == m:
            return j
    return start


def _prefix_pick(
    whole: Any,
    load_base: int,
    token_base: int,
    ints: Any,
    floats: Any,
    queued: Any,
    request_tokens: int,
    load_weight: float,
    token_weight: float,
    queue_weight: float,
    bound: float,
    held: int,
    start: int,
) -> int:
    """``prefix``'s choice over the pool (the formula is in ``PrefixPolicy``'s docstring).

    ``start`` < 0: only the costs, into ``floats[0]`` (returns -1). ``whole``: the
    board's cells, its load row at ``load_base``, its token row at
    ``token_base``; ``ints``: the pool's slots, then scratch for its loads and tokens,
    then the positions of the targets holding part of the prompt; ``floats``: scratch
    for the costs, then those holders' bonuses (``held`` of them), counted while their
    load is within ``bound`` x (mean load + 1); ``queued``: each target's prefill queued
    (empty: none anywhere). Few arguments, each array packed: unpacking an array
    argument costs ~0.25 us a call, more than the whole scan at 64 targets.

    Each term is a product with one quotient (a division per target took half the time:
    a division costs what eight products do), in these steps: load x (load weight /
    (mean load + 1)) + tokens x (token weight / (mean tokens + request tokens + 1)) +
    queued x (queue weight / (request tokens + 1)) - bonus."""
    slots, loads, tokens, where = ints[0], ints[1], ints[2], ints[3]
    cost, bonus = floats[0], floats[1]
    n = slots.shape[0]
    load_sum = 0
    token_sum = 0
    for i in range(n):  # the gather, with integer sums (exact)
        a, b = whole[load_base + slots[i]], whole[token_base + slots[i]]
        load_sum += a
        token_sum += b
        loads[i] = a
        tokens[i] = b
    mean_load = float(load_sum) / n
    per_load = load_weight / (mean_load + 1.0)
    per_token = token_weight / (float(token_sum) / n + request_tokens + 1.0)
    for i in range(n):  # contiguous: vectorised
        cost[i] = loads[i] * per_load + tokens[i] * per_token
    if queued.shape[0] == n:
        per_queued = queue_weight / (request_tokens + 1.0)
        for i in range(n):
            cost[i] = cost[i] + queued[i] * per_queued
    limit = bound * (mean_load + 1.0)
    for k in range(held):
        i = where[k]
        if loads[i] <= limit:
            cost[i] = cost[i] - bonus[k]
    if start < 0:
        return -1  # the caller finds the least cost
    return first_least(cost, start)  # the compiled one: numba resolves it at compile time


def _block_hashes(data: Any, out: Any) -> int:
    """``cache_aware``'s chained block hashes of a prompt's UTF-8 ``data`` (bytes), in
    blocks of ``BLOCK`` bytes (the last zero-padded, its length mixed in; an empty prompt
    is one block): ``out[b]`` the hash of blocks 0..b; returns how many blocks. Each 64-bit
    word is mixed in by xor, a multiply by the golden ratio and a shift: that chain, not
    reading the bytes, sets the cost (whole-word reads measured 10-20 % faster at most)."""
    n = len(data)
    blocks = max((n + BLOCK - 1) // BLOCK, 1)
    h = np.uint64(0x243F6A8885A308D3)
    golden = np.uint64(0x9E3779B97F4A7C15)
    shift = np.uint64(32)
    for b in range(blocks):
        for k in range(BLOCK // 8):
            at = b * BLOCK + k * 8
            word = np.uint64(0)
            for j in range(8):
                if at + j < n:
                    word |= np.uint64(data[at + j]) << np.uint64(8 * j)
            h = (h ^ word) * golden
            h ^= h >> shift
        if b * BLOCK + BLOCK > n:  # a short last block: its length too, or zero bytes pad it
            h = (h ^ np.uint64(n - b * BLOCK)) * golden
        out[b] = np.int64(h)
    return blocks


def JIT(function: Callable[..., Any]) -> Any:
    """Compiled, and cached on disk where numba finds a writable place (beside this module,
    ``NUMBA_CACHE_DIR``, or the user's cache folder); with none (a read-only install and
    home) it compiles on each start (~1.5 s) rather than failing the import."""
    from numba import njit  # here, not at the top: see the module's docstring

    try:
        return njit(cache=True, nogil=True, boundscheck=False)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return njit(nogil=True, boundscheck=False)(function)


# a kernel calling another finds it in this module's names when numba compiles it (on its
# first call, after ``load``)
DEFINITIONS: dict[str, Callable[..., Any]] = {
    "least_value": _least_value,
    "first_least": _first_least,
    "least_at": _least_at,
    "affinity": _affinity,
    "total": _total,
    "rendezvous": _rendezvous,
    "prefix_pick": _prefix_pick,
    "block_hashes": _block_hashes,
}


def _later(name: str) -> Any:
    """Stands for a kernel until ``load``: called first, it loads them all and calls it."""

    def first_call(*args: Any) -> Any:
        load()
        return globals()[name](*args)

    return first_call


least_value: Callable[[Any], Any] = _later("least_value")
first_least: Callable[[Any, int], int] = _later("first_least")
least_at: Callable[[Any, Any, int], int] = _later("least_at")
affinity: Callable[[Any, Any, int, float, int], int] = _later("affinity")
total: Callable[[Any, Any], int] = _later("total")
rendezvous: Callable[[Any, np.uint64, Any], int] = _later("rendezvous")
prefix_pick: Callable[..., int] = _later("prefix_pick")
block_hashes: Callable[[bytes, Any], int] = _later("block_hashes")


@cache
def load() -> None:
    """numba imported and every kernel made, in this module's names (each compiled, or
    read from the disk cache, on its first call)."""
    found = globals()
    for name, definition in DEFINITIONS.items():
        found[name] = JIT(definition)


@cache
def warm() -> None:
    """Load (or compile) every kernel with the types the policies call it with: once per
    process, when its first policy that scans is made (~0.25 s from the disk cache), never
    on a request. Each such policy calls it (``ByPool``, ``ConsistentHash``):
    the parent of ``--processes`` makes ``manual`` and ``consistent_hash`` itself."""
    load()
    i64 = np.zeros(2, np.int64)
    slots = np.zeros(2, np.intp)
    least_at(i64, slots, 1)
    total(i64, slots)
    affinity(i64, slots, 1, 1.5, 1)
    rendezvous(np.zeros(2, np.uint64), np.uint64(1), np.zeros(2, np.uint64))
    prefix_pick(
        i64, 0, 1, np.zeros((4, 2), np.int64), np.zeros((2, 2)), i64, 1, 1.0, 1.0, 1.0, 1.5, 1, 1
    )
    block_hashes(b"warm", i64)
