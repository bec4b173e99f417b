"""The policies' compiled scans against their plain definitions, on real boards: the same
numbers (floats bit for bit, in the formula's steps) and the same picks, ties included."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pytest

from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import PolicyOptions, Prefix, QueuedBy, RequestInfo, kernels, make_policy
from dprouter.policies.base import first_least
from dprouter.policies.cache_aware import CAPACITY, CacheAware, text_blocks


def fleet(*dp_sizes: int) -> tuple[Target, ...]:
    registry = Registry()
    for i, dp in enumerate(dp_sizes):
        w = registry.add(Worker(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", dialect="vllm"))
        w.ranks = dp
        registry.mark_ready(w)
    return registry.snapshot.pool()


def loaded(pool: tuple[Target, ...], rng: random.Random) -> tuple[Target, ...]:
    for t in pool:
        t.outstanding = rng.choice((0, 0, 1, 3, 20))
        t.outstanding_tokens = t.outstanding * rng.randint(200, 4000)
    return pool


def plain_pick(
    pool: list[Target],
    request: int,
    weights: tuple[float, float, float, float],
    queued: list[int],
    bonus: dict[int, float],
    start: int,
) -> int:
    """prefix's choice in plain Python, in the kernel's documented float steps."""
    n = len(pool)
    mean_load = sum(t.load for t in pool) / n
    per_load = weights[0] / (mean_load + 1.0)
    per_token = weights[1] / (sum(t.token_load for t in pool) / n + request + 1.0)
    per_queued = weights[2] / (request + 1.0)
    cost: list[float] = []
    for i, t in enumerate(pool):
        c = float(t.load) * per_load + float(t.token_load) * per_token
        if queued:
            c = c + float(queued[i]) * per_queued
        if i in bonus and t.load <= weights[3] * (mean_load + 1.0):
            c = c - bonus[i]
        cost.append(c)
    return int(min([*range(start, n), *range(start)], key=lambda i: cost[i]))


@pytest.mark.parametrize("shape", [(2, 3), (16,) * 4, (16,) * 40, (8, 16, 4)])
@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.5), (0.7, 2.5, 3.0, 1.2)])
def test_prefix_pick_is_the_plain_definition(
    shape: tuple[int, ...], weights: tuple[float, float, float, float]
) -> None:
    rng = random.Random(len(shape))
    pool = list(fleet(*shape))
    rng.shuffle(pool)  # any order: the pool's, not the board's
    n, board = len(pool), pool[0].board
    ints, floats = np.zeros((4, n), np.int64), np.zeros((2, n))
    ints[0] = [t.slot for t in pool]
    for step in range(60):
        loaded(tuple(pool), rng)
        queued = [rng.choice((0, 0, 512)) for _ in pool] if step % 2 else []
        holders = {i: rng.choice((0.5, 1.0, 4.0)) for i in rng.sample(range(n), min(n, 3))}
        for k, (i, b) in enumerate(holders.items()):
            ints[3, k], floats[1, k] = i, b
        start = step % n
        found = kernels.prefix_pick(
            board.whole,
            board.load_base,
            board.token_load_base,
            ints,
            floats,
            np.array(queued, np.int64),
            1234,
            *weights,
            len(holders),
            start,
        )
        assert found == plain_pick(pool, 1234, weights, queued, holders, start)


@pytest.mark.parametrize("n", [2, 5, 64, 4096])
def test_first_least_takes_the_first_from_a_rotating_start(n: int) -> None:
    rng = random.Random(n)
    for values in (
        np.array([rng.choice((0, 1, 1, 2)) for _ in range(n)], np.int64),
        np.array([rng.choice((0.5, 0.25, 1.0)) for _ in range(n)], np.float64),
    ):
        for start in {0, 1, n // 2, n - 1}:
            order = [*range(start, n), *range(start)]
            want = min(order, key=lambda i: float(values[i]))
            assert kernels.first_least(values, start) == want
            # the numpy one, for large pools
            assert first_least(values.astype(np.float64), start) == want


def test_prefix_on_a_large_pool_picks_the_plain_definition() -> None:
    """From 2,048 targets the least cost is found with numpy: the same pick."""
    rng = random.Random(9)
    pool = fleet(*[16] * 256)
    policy = make_policy("prefix")
    for step in range(1, 40):
        loaded(pool, rng)
        holders = rng.sample(range(len(pool)), 3)
        held = {pool[i].label: rng.choice((256, 1024)) for i in holders}
        info = RequestInfo(tokens=1000, prefix=Prefix(1024, held))
        bonus = {i: 4.0 * held[pool[i].label] / 1024 for i in holders}
        want = plain_pick(list(pool), 1000, (1.0, 1.0, 1.0, 1.5), [], bonus, step % len(pool))
        assert policy.select(pool, info) is pool[want]


# the kernels the policies call from Python (the rest are called by these, compiled in)
CALLED = (
    "least_at",
    "total",
    "affinity",
    "rendezvous",
    "prefix_pick",
    "block_hashes",
)


def test_no_request_compiles_a_kernel_again() -> None:
    """Every policy, options from a config file included (weights written as ints), calls
    the kernels with the types ``warm`` compiled them for: another type would compile on
    a request (~0.5 s)."""
    pool = loaded(fleet(16, 16), random.Random(2))
    options = PolicyOptions(
        assignment="min_group", load_weight=1, token_weight=2, queue_weight=1, prefix_bound=2
    )
    queued = QueuedBy({pool[0].label: 64})
    info = RequestInfo(key="k", text="a prompt " * 40, tokens=300, prefix=Prefix(64, {}, queued))
    for name in ("least_load", "manual", "cache_aware", "min_tokens", "consistent_hash", "prefix"):
        policy = make_policy(name, options)
        for i in range(3):
            policy.select(pool, info)
            policy.select(pool, RequestInfo(key=f"new{i}", tokens=10))
    for kernel in CALLED:
        assert len(getattr(kernels, kernel).signatures) == 1, kernel


def test_a_policy_made_directly_loads_the_kernels_before_its_first_request() -> None:
    """The parent of --processes makes manual (key placement) and consistent_hash (etcd
    claims) itself, not through make_policy: made, they have their kernels loaded, so no
    placement waits on a compile."""
    code = (
        "import sys\n"
        "from dprouter.policies import kernels, PolicyOptions\n"
        "from dprouter.policies.manual import Manual\n"
        "from dprouter.policies.consistent_hash import ConsistentHash\n"
        "assert 'numba' not in sys.modules\n"
        "Manual(PolicyOptions(assignment='min_load')), ConsistentHash(PolicyOptions())\n"
        f"assert all(getattr(kernels, k).signatures for k in {CALLED})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class PlainCacheAware:
    """cache_aware in plain Python: per-target LRU sets of chained block hashes (deepest
    block remembered first, so evicted first), the holders narrowed block by block from
    the first, and the balance rule summed in Python."""

    def __init__(self, capacity: int, threshold: float = 0.5, bound: float = 1.5) -> None:
        self.capacity, self.threshold, self.bound = capacity, threshold, bound
        self.seen: dict[str, OrderedDict[int, None]] = {}
        self.start = 0

    def select(self, pool: Sequence[Target], text: str) -> Target:
        self.start += 1
        blocks = text_blocks(text)
        holders, depth = {t.label for t in pool}, 0
        for h in blocks:
            narrower = {label for label in holders if h in self.seen.get(label, ())}
            if not narrower:
                break
            holders, depth = narrower, depth + 1
        order = [*range(self.start % len(pool), len(pool)), *range(self.start % len(pool))]
        least = pool[min(order, key=lambda i: pool[i].load)]
        chosen = least
        if depth and depth >= self.threshold * len(blocks):
            match = min((t for t in pool if t.label in holders), key=lambda t: (t.load, t.label))
            if match.load <= self.bound * (sum(t.load for t in pool) / len(pool) + 1):
                chosen = match
        seen = self.seen.setdefault(chosen.label, OrderedDict())
        for h in reversed(blocks):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return chosen


@pytest.mark.parametrize("capacity", [24, CAPACITY])
def test_cache_aware_picks_what_the_plain_definition_picks(capacity: int) -> None:
    """The holders' run found by bisection is the one found block by block, with prompts
    sharing prefixes of every length and targets evicting (capacity 24 blocks)."""
    rng = random.Random(capacity)
    pool = fleet(8, 8, 16)
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    policy.capacity = capacity
    plain = PlainCacheAware(capacity)
    stems = ["".join(rng.choice("abcdefgh ") for _ in range(64 * 12)) for _ in range(6)]
    for step in range(2000):
        loaded(pool, rng) if step % 5 == 0 else None
        stem = rng.choice(stems)
        text = stem[: rng.randrange(0, len(stem))] + rng.choice(("", "tail", "x" * 200))
        assert policy.select(pool, RequestInfo(text=text)) is plain.select(pool, text), step


def test_a_router_whose_policy_scans_nothing_never_imports_numba() -> None:
    """numba and the kernels cost ~135 MB per serving process: round_robin (the default),
    random and power_of_two never load them, serving or not."""
    code = (
        "import sys\n"
        "import dprouter.cli, dprouter.server.app, dprouter.multiproc.supervisor\n"
        "from dprouter.policies import make_policy, RequestInfo\n"
        "from dprouter.fleet.registry import Registry\n"
        "from dprouter.fleet.targets import Worker\n"
        "registry = Registry()\n"
        "w = registry.add(Worker(id='w', url='http://127.0.0.1:1', dialect='vllm'))\n"
        "w.ranks = 4\n"
        "registry.mark_ready(w)\n"
        "for name in ('round_robin', 'random', 'power_of_two'):\n"
        "    make_policy(name).select(registry.snapshot.pool(), RequestInfo())\n"
        "assert 'numba' not in sys.modules\n"
        "make_policy('least_load')\n"
        "assert 'numba' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_block_hashes_name_a_prefix_and_nothing_else() -> None:
    """Each 64-byte block's hash covers the blocks before it: prompts share leading hashes
    exactly as far as they share whole leading blocks; the last block counts though short;
    any text hashes (a lone surrogate from JSON too), whatever scratch it is given."""
    rng = random.Random(5)
    base = "".join(rng.choice("abcdef ") for _ in range(700))
    for cut in (0, 1, 63, 64, 65, 300, len(base) - 1):
        other = base[:cut] + "#" + base[cut + 1 :]
        a, b = text_blocks(base), text_blocks(other, np.empty(1, np.int64))
        assert len(a) == len(b) == -(-len(base) // 64)
        same = cut // 64
        assert a[:same] == b[:same]
        assert all(x != y for x, y in zip(a[same:], b[same:], strict=True))
    assert len(text_blocks("é" * 32)) == 1 and len(text_blocks("é" * 33)) == 2  # bytes, not chars
    assert text_blocks("") == text_blocks("", np.empty(4, np.int64)) and len(text_blocks("")) == 1
    assert len(text_blocks("\ud800 lone")) == 1
    assert text_blocks("short") != text_blocks("short\x00")  # the padding is no text
    code = "from dprouter.policies.cache_aware import text_blocks; print(text_blocks('x' * 99))"
    seeds = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    ]
    assert seeds[0] == seeds[1] == f"{text_blocks('x' * 99)}\n"
