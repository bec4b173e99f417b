"""Choosing a (prefill, decode) pair: each role by its own policy, never locked together.

Every full cycle of the pair space -- the least common multiple of the two
pools' sizes -- the decode pool is offered rotated by one. Round robin on both
sides then walks every (prefill, decode) pair, and each side still covers its
own slots evenly; a shared counter (or two in step) would pair prefill i with
decode i forever.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from dprouter.fleet.targets import Target
from dprouter.policies import Policy, RequestInfo


class Pairing:
    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode
        self.count = 0

    def choose(
        self,
        prefills: Sequence[Target],
        decodes: Sequence[Target],
        info: RequestInfo,
        model: str | None = None,
    ) -> tuple[Target, Target]:
        n, self.count = self.count, self.count + 1
        shift = (n // math.lcm(len(prefills), len(decodes))) % len(decodes)
        rotated = [*decodes[shift:], *decodes[:shift]]
        prefill = self.prefill.select(prefills, replace(info, pool=("prefill", model)))
        decode = self.decode.select(rotated, replace(info, pool=("decode", model)))
        return prefill, decode
