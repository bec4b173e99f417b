"""Routing policies: one module each behind ``Policy.select``; this registry feeds
the command line, the docs and the metric labels."""

from __future__ import annotations

from collections.abc import Callable

from dprouter.policies.base import (
    Policy,
    PolicyOptions,
    Prefix,
    Queued,
    QueuedBy,
    RequestInfo,
    affinity_key,
    needs_tokens,
)
from dprouter.policies.cache_aware import CacheAware
from dprouter.policies.consistent_hash import ConsistentHash
from dprouter.policies.least_load import LeastLoad
from dprouter.policies.manual import Manual
from dprouter.policies.min_tokens import MinTokens
from dprouter.policies.power_of_two import PowerOfTwo
from dprouter.policies.prefix import PrefixPolicy
from dprouter.policies.random_pick import RandomPick
from dprouter.policies.round_robin import RoundRobin

POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomPick,
        LeastLoad,
        PowerOfTwo,
        ConsistentHash,
        Manual,
        CacheAware,
        MinTokens,
        PrefixPolicy,
    )
}


def make_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory(options or PolicyOptions())


__all__ = [
    "POLICIES",
    "Policy",
    "PolicyOptions",
    "Prefix",
    "Queued",
    "QueuedBy",
    "RequestInfo",
    "affinity_key",
    "make_policy",
    "needs_tokens",
]
