"""``consistent_hash``'s compiled scan picks ``max``'s winner, also where scores share their top
31 bits (built here on purpose by inverting mix: the numpy scan before it skipped mix's last
step unless they did) and where two scores are equal (the first wins)."""

from __future__ import annotations

import random

import numpy as np

from dprouter.policies.consistent_hash import MASK, mix
from dprouter.policies.kernels import rendezvous

GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def unshift(x: int, s: int) -> int:
    """The inverse of ``x ^ (x >> s)``."""
    y = x
    for _ in range(64 // s + 1):
        y = x ^ (y >> s)
    return y


def seed_for(before_last: int) -> int:
    """The seed whose score, with key 0, is ``before_last`` just before mix's last step."""
    x = unshift(before_last * pow(M2, -1, 1 << 64) & MASK, 27)
    return (unshift(x * pow(M1, -1, 1 << 64) & MASK, 30) - GOLDEN) & MASK


def test_scores_sharing_their_top_bits_still_pick_the_highest_mix() -> None:
    rng = random.Random(5)
    for _ in range(300):
        top = rng.getrandbits(31) << 33
        near = [top | rng.getrandbits(33) for _ in range(rng.randint(2, 4))]
        values = near + [rng.getrandbits(62) for _ in range(rng.randint(0, 40))]
        rng.shuffle(values)
        seeds = [seed_for(v) for v in values]
        seeds += seeds[: rng.randint(0, 2)]  # and equal scores: the first of them wins
        found = rendezvous(
            np.array(seeds, np.uint64), np.uint64(0), np.zeros(len(seeds), np.uint64)
        )
        assert found == max(range(len(seeds)), key=lambda j: mix(seeds[j]))
