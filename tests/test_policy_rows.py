"""``Rows``: a pool's loads and tokens read off the board, by a gather or by strides."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dprouter.policies.rows import GRID, Rows
from dprouter.registry import Registry
from dprouter.targets import Target, Worker


def fleet(*dp_sizes: int) -> tuple[Target, ...]:
    registry = Registry()
    for i, dp in enumerate(dp_sizes):
        w = registry.add(Worker(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", dialect="vllm"))
        w.ranks = dp
        registry.mark_ready(w)
    return registry.snapshot.pool()


def loaded(pool: tuple[Target, ...]) -> tuple[Target, ...]:
    rng = random.Random(3)
    for t in pool:
        t.outstanding = rng.randint(0, 20)
        t.outstanding_tokens = t.outstanding * rng.randint(200, 4000)
    return pool


def expected(pool: tuple[Target, ...]) -> list[float]:
    return [float(t.load) for t in pool] + [float(t.token_load) for t in pool]


@pytest.mark.parametrize(
    ("pool", "by_grid"),
    [
        (fleet(16, 16, 16, 16), False),  # small: a gather
        (fleet(*[16] * (GRID // 16)), True),  # equal-DP workers: a grid
        (fleet(*[16] * (GRID // 16), 8), False),  # one DP apart: no grid
        (fleet(GRID), True),  # one worker: its ranks in a row
    ],
)
def test_a_pool_reads_its_targets_loads_then_tokens(
    pool: tuple[Target, ...], by_grid: bool
) -> None:
    rows = Rows(loaded(pool))
    assert (rows.grid is not None) == by_grid
    rows.read(pool[0].board)
    assert rows.both.tolist() == expected(pool)


def test_a_shuffled_pool_is_gathered_in_its_order() -> None:
    pool = list(loaded(fleet(*[16] * (GRID // 16))))
    random.Random(1).shuffle(pool)
    rows = Rows(tuple(pool))
    assert rows.grid is None
    rows.read(pool[0].board)
    assert rows.both.tolist() == expected(tuple(pool))
    assert np.array_equal(rows.loads, [t.load for t in pool])
