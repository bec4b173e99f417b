"""Choosing a (prefill, decode) pair: each role by its own policy, never locked together.

Every full cycle of the pair space -- the least common multiple of the two
pools' sizes -- the decode pool is offered rotated by one. Round robin on both
sides then walks every (prefill, decode) pair, and each side still covers its
own slots evenly; a shared counter (or two in step) would pair prefill i with
decode i forever.

A side whose policy ``needs_tokens`` reads what that side's targets hold of the prompt
(``prefixes``, looked up over that side's pool): the prefill engines' KV events for the
prefill, the decode engines' for the decode when they publish.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from dprouter.core.types import Side
from dprouter.fleet.targets import Target
from dprouter.policies import Policy, Prefix, RequestInfo


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
        prefixes: Mapping[Side, Prefix] | None = None,
    ) -> tuple[Target, Target]:
        held = prefixes or {}
        n, self.count = self.count, self.count + 1
        shift = (n // math.lcm(len(prefills), len(decodes))) % len(decodes)
        rotated = [*decodes[shift:], *decodes[:shift]]
        prefill_info = replace(info, pool=("prefill", model), prefix=held.get("prefill"))
        decode_info = replace(info, pool=("decode", model), prefix=held.get("decode"))
        return self.prefill.select(prefills, prefill_info), self.decode.select(rotated, decode_info)
