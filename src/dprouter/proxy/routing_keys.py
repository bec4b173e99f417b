"""Routing keys across replicas: ``manual``'s first placement of a key, claimed in etcd.

The first replica to see a key places it by its own rule (``--assignment``) and
claims it in etcd, in one transaction that writes only if no replica claimed it
first; a replica that loses reads the winner's target and follows it. After
that each replica trusts its own table and checks the claim again every half
``--key-ttl`` of use (which also keeps the claim alive); a key whose target left
is placed afresh and its claim replaced, so the replicas move it alike.

Claims live under ``PREFIX.sessions/`` on leases of twice ``--key-ttl``, one
lease per ``--key-ttl`` window: a claim not used for that long goes by itself.
With etcd unreachable, a new key is placed by rendezvous hashing over the
targets, which every replica computes alike, and the fallback is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from dprouter.core.errors import EtcdError
from dprouter.fleet.membership.etcd_client import Etcd
from dprouter.fleet.targets import Target
from dprouter.policies import PolicyOptions, RequestInfo, affinity_key
from dprouter.policies.consistent_hash import ConsistentHash
from dprouter.policies.manual import Manual

log = logging.getLogger("dprouter")
RETRY = 1.0  # seconds after a failed call before a new key waits on etcd again


def claims_prefix(workers_prefix: str, role: str = "regular") -> str:
    """Beside the workers' prefix, not under it (the membership watch must not see them);
    P/D: one per role (a key has a prefill and a decode)."""
    kind = "sessions" if role == "regular" else f"{role}-sessions"
    return f"{workers_prefix.rstrip('/')}.{kind}/"


class Places(Protocol):
    """Places a routing key before the policy is called (several processes: the parent's
    table; several replicas: a claim in etcd), when ``placeable`` says so."""

    async def place(self, targets: Sequence[Target], info: RequestInfo) -> None: ...


def placeable(info: RequestInfo) -> bool:
    """A routing key is placed on its request's first attempt; a retry goes where the
    policy's table says, and one failed attempt does not move the key for good."""
    return info.key is not None and not info.attempt


class Claims:
    def __init__(self, etcd: Etcd, prefix: str, policy: Manual) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.policy = policy
        self.window = max(policy.ttl, 1.0)
        self.fresh = self.window / 2
        self.rendezvous = ConsistentHash(PolicyOptions())
        self.unreachable = False
        self._checked: dict[str, float] = {}  # key -> when its claim was last read or written
        self._lease = (0, float("-inf"))  # (id, granted at)
        self._retry_at = float("-inf")

    async def place(self, targets: Sequence[Target], info: RequestInfo) -> None:
        key = affinity_key(info)  # as the policy keeps it: per adapter
        if key is None:
            return
        held = self.policy.sticky.get(key)
        mine = held[0] if held is not None and held[0] in targets else None
        if mine is not None and info.now - self._checked.get(key, -self.fresh) < self.fresh:
            return
        if mine is None:  # a new key, or its target left: place it here first
            mine = self.policy.select(targets, info)
        try:
            if info.now < self._retry_at:  # etcd failed just now: no wait on it per key
                raise EtcdError("failed less than a second ago")
            found = await self._claim(key, mine, targets, info.now, held is not None)
        except EtcdError as exc:
            if not self.unreachable:
                log.error("etcd unreachable (%s): new keys placed by rendezvous hashing", exc)
            self.unreachable = True
            self._retry_at = info.now + RETRY
            found = self.rendezvous.select(targets, info)
        else:
            if self.unreachable:
                log.warning("etcd reachable again: new keys are claimed there")
            self.unreachable = False
        self._checked[key] = info.now
        if len(self._checked) > 2 * max(len(self.policy.sticky), 1024):
            self._checked = {k: t for k, t in self._checked.items() if k in self.policy.sticky}
        if found is not mine:
            self._adopt(key, found, info.now)

    async def _claim(
        self, key: str, mine: Target, targets: Sequence[Target], now: float, known: bool
    ) -> Target:
        """The target the key is claimed for: ``mine``, unless another replica claimed it for
        a target among ours first."""
        lease = await self._current_lease(now)
        label = mine.label.encode()
        path = self.prefix + key
        written, held = await self.etcd.claim(path, label, lease, None)
        if written:
            return mine
        if held == label:
            if known:  # ours already: refresh it on this window's lease
                await self.etcd.claim(path, label, lease, label)
            return mine
        theirs = next((t for t in targets if t.label.encode() == held), None)
        if theirs is not None:
            return theirs
        # claimed for a target that left: replace the claim (unless another replica just did)
        written, now_held = await self.etcd.claim(path, label, lease, held)
        if written or now_held is None:
            return mine
        return next((t for t in targets if t.label.encode() == now_held), mine)

    async def _current_lease(self, now: float) -> int:
        lease, granted = self._lease
        if now - granted >= self.window:
            lease = await self.etcd.grant(int(2 * self.window) + 1)
            self._lease = (lease, now)
        return lease

    def _adopt(self, key: str, target: Target, now: float) -> None:
        held = self.policy.sticky.get(key)
        if held is not None:
            self.policy.count(held[0], -1)
        self.policy.count(target, 1)
        self.policy.sticky[key] = (target, now)


def claims(sources: Sequence[object], policy: Manual, role: str = "regular") -> Claims | None:
    """Claims over the etcd the workers come from, if they come from etcd."""
    from dprouter.fleet.membership.etcd import EtcdMembership

    found = next((s for s in sources if isinstance(s, EtcdMembership)), None)
    if found is None:
        return None
    return Claims(found.etcd, claims_prefix(found.prefix, role), policy)
