"""Routing keys across serving processes: ``manual``'s table lives in the parent.

A serving process asks the control plane where a key goes the first time it
sees the key, and seeds its own ``manual`` with the answer; after that the
answer is trusted for ``fresh`` seconds, then asked again, which keeps the
parent's key alive for as long as any process uses it. The policy itself stays
a plain function with no I/O: the asking happens before it is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import orjson

from dprouter.follower import BASE, Channel
from dprouter.policies import RequestInfo
from dprouter.policies.manual import Manual
from dprouter.targets import Role, Target


class Places(Protocol):
    """Places a routing key before the policy is called (several processes: the parent's
    table; several replicas: a claim in etcd)."""

    async def place(self, targets: Sequence[Target], info: RequestInfo) -> None: ...


class Placer:
    def __init__(self, channel: Channel, policy: Manual, role: Role = "regular") -> None:
        self.channel = channel
        self.policy = policy
        self.role = role  # P/D: each role has its own table (a key has a prefill and a decode)
        self.fresh = min(1.0, policy.ttl / 2)
        self._asked: dict[str, float] = {}

    async def place(self, targets: Sequence[Target], info: RequestInfo) -> None:
        key = info.key
        if key is None or info.attempt:
            return
        held = self.policy.sticky.get(key)
        if held is not None and held[0] in targets and info.now - self._asked[key] < self.fresh:
            return
        asked = {"key": key, "slots": [t.slot for t in targets], "role": self.role}
        async with self.channel.session.post(
            BASE + "/control/place", data=orjson.dumps(asked)
        ) as r:
            if r.status != 200:
                return  # the local table decides this once
            slot = orjson.loads(await r.read())["slot"]
        chosen = next((t for t in targets if t.slot == slot), None)
        if chosen is not None:
            if held is not None:
                self.policy.count(held[0], -1)
            self.policy.count(chosen, 1)
            self.policy.sticky[key] = (chosen, info.now)
            self._asked[key] = info.now
            if len(self._asked) > 2 * max(len(self.policy.sticky), 1024):
                self._asked = {k: v for k, v in self._asked.items() if k in self.policy.sticky}
