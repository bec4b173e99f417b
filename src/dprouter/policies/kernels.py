"""The policies' scans over a pool, compiled (numba): one pass where numpy takes several.

A numpy call costs ~0.5-1 us before it reads a cell, and a policy that gathers a
pool's rows, combines them and then finds the first least from a rotating start makes
ten; at 4,096 targets each also passes over 32 KB. These loops read the board's rows
through the pool's slots and decide in one or two passes, with the same comparisons
(and, for floats, the same IEEE steps in the same order) as the plain definitions, so
the choices are exactly theirs. Compiled once and cached on disk (``cache=True``; the
first start of a new install compiles, ~2 s); ``warm`` loads them before the first
request. No fastmath: it would reorder the float steps.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit


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


def _fewest_tokens(tokens: Any, slots: Any, workers: Any, start: int) -> int:
    """The target with the fewest tokens, then whose worker has the fewest, the first from
    ``start`` (wrapping): ``tokens`` a board row, ``slots``/``workers`` the pool's."""
    n = slots.shape[0]
    best = start
    least, engine = tokens[slots[start]], tokens[workers[start]]
    for k in range(1, n):
        i = start + k
        if i >= n:
            i -= n
        t = tokens[slots[i]]
        if t < least or (t == least and tokens[workers[i]] < engine):
            best, least, engine = i, t, tokens[workers[i]]
    return best


def _rendezvous(seeds: Any, key: np.uint64) -> int:
    """Where splitmix64(key ^ seed) is highest, the first of equal scores."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    m1 = np.uint64(0xBF58476D1CE4E5B9)
    m2 = np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    best = 0
    top = np.uint64(0)
    for i in range(seeds.shape[0]):
        x = (seeds[i] ^ key) + golden
        x = (x ^ (x >> s30)) * m1
        x = (x ^ (x >> s27)) * m2
        x = x ^ (x >> s31)
        if x > top or i == 0:
            best, top = i, x
    return best


def _first_least(values: Any, start: int) -> int:
    """The first least value at or after ``start`` (< n), wrapping round, in two passes:
    the least value with four independent minima (one chain waits on each compare: four
    times slower at 4,096), then the first from ``start`` holding it. Exact: a minimum
    does not depend on the order."""
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
    m = min(min(m0, m1), min(m2, m3))
    for j in range(start, n):
        if values[j] == m:
            return j
    for j in range(start):
        if values[j] == m:
            return j
    return start


def _prefix_pick(
    load: Any,
    token_load: Any,
    slots: Any,
    request_tokens: int,
    weights: Any,
    queued: Any,
    where: Any,
    bonus: Any,
    held: int,
    start: int,
    loads: Any,
    tokens: Any,
    cost: Any,
) -> int:
    """``prefix``'s choice over the pool (the formula is in ``PrefixPolicy``'s docstring).

    ``weights``: load, token, queue weight and the bound; ``queued``: each target's
    prefill queued (empty: none anywhere); ``bonus[:held]`` for the targets at
    ``where[:held]``, counted while their load is within bound x (mean load + 1).
    ``loads``, ``tokens``, ``cost``: scratch of the pool's size. The terms are products
    with one quotient each (a division per target was half the time: a division costs
    what eight products do), in these steps: load x (load weight / (mean load + 1)) +
    tokens x (token weight / (mean tokens + request tokens + 1)) + queued x (queue weight /
    (request tokens + 1)) - bonus."""
    n = slots.shape[0]
    load_sum = 0
    token_sum = 0
    for i in range(n):  # the gather, with integer sums (exact)
        a, b = load[slots[i]], token_load[slots[i]]
        load_sum += a
        token_sum += b
        loads[i] = a
        tokens[i] = b
    mean_load = float(load_sum) / n
    per_load = weights[0] / (mean_load + 1.0)
    per_token = weights[1] / (float(token_sum) / n + request_tokens + 1.0)
    for i in range(n):  # contiguous: vectorised
        cost[i] = loads[i] * per_load + tokens[i] * per_token
    if queued.shape[0] == n:
        per_queued = weights[2] / (request_tokens + 1.0)
        for i in range(n):
            cost[i] = cost[i] + queued[i] * per_queued
    limit = weights[3] * (mean_load + 1.0)
    for k in range(held):
        i = where[k]
        if loads[i] <= limit:
            cost[i] = cost[i] - bonus[k]
    return first_least(cost, start)  # the compiled one: numba resolves it at compile time


JIT = njit(cache=True, nogil=True, boundscheck=False)
first_least: Callable[[Any, int], int] = JIT(_first_least)
least_at: Callable[[Any, Any, int], int] = JIT(_least_at)
total: Callable[[Any, Any], int] = JIT(_total)
fewest_tokens: Callable[[Any, Any, Any, int], int] = JIT(_fewest_tokens)
rendezvous: Callable[[Any, np.uint64], int] = JIT(_rendezvous)
prefix_pick: Callable[..., int] = JIT(_prefix_pick)


@cache
def warm() -> None:
    """Load (or compile) every kernel with the types the policies call it with: once per
    process, when its first policy is made (~0.25 s from the disk cache), not on a request."""
    i64, f64 = np.zeros(2, np.int64), np.zeros(2, np.float64)
    slots = np.zeros(2, np.intp)
    least_at(i64, slots, 1)
    total(i64, slots)
    fewest_tokens(i64, slots, slots, 1)
    rendezvous(np.zeros(2, np.uint64), np.uint64(1))
    prefix_pick(i64, i64, slots, 1, np.ones(4), i64, slots, f64, 1, 1, i64.copy(), i64.copy(), f64)
