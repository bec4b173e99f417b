"""A prompt another request is computing on the rank chosen for it: wait for it there.

SGLang puts a prompt's blocks in its radix cache once they are computed (after each
prefill chunk, ``cache_unfinished_req``), so the requests that join the prefill batch
computing a prefix compute it again: a GRPO group's samples sent together to one rank
compute their prompt as often as the batch's token budget holds it. vLLM caches a
block when it schedules it, so a request scheduled after it, even in the same step,
hits it. So a request sent to an SGLang rank where its prompt is pending -- sent
there by the router, not yet stored by the rank's events -- waits in the router until
the events store those blocks (or ``WAIT`` passes), then goes: it hits them. The
policy counted it on that rank from its choice, so the rest of a group spreads over
other ranks once the holder's load reaches the policy's bound.
"""

from __future__ import annotations

import asyncio
import time

from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.lookup import Found
from dprouter.fleet.targets import Target

AFTER_COMPUTE = frozenset({"sglang"})  # dialects whose engines cache a prefix once computed
WAIT = 2.0  # seconds at most (then it goes and computes the prompt itself, as without)
POLL = 0.005  # seconds between looks at the index (events land every engine step)


def being_computed(index: KvIndex, found: Found, target: Target) -> list[int]:
    """The prompt's block keys pending on ``target`` (another request is computing them
    there), where its engine caches blocks only once computed; else none. Call it
    before recording this request's own blocks as pending there."""
    if target.worker.dialect not in AFTER_COMPUTE or not index.pending:
        return []
    on = found.ranks.by_label.get(target.label)
    if on is None:
        return []
    rank, group = on
    bit, pending = 1 << rank.bit, index.pending
    return [k for k in found.keys[group] if pending.get(k, 0) & bit]


def pending_on(index: KvIndex, target: Target, keys: list[int]) -> bool:
    """Whether any of ``keys`` is still pending on ``target`` (not stored, removed,
    flushed or expired)."""
    rank = index.ranks.get((target.worker.id, target.rank or 0))
    if rank is None:
        return False
    bit, pending = 1 << rank.bit, index.pending
    return any(pending.get(k, 0) & bit for k in keys)


async def wait_computed(
    index: KvIndex, target: Target, keys: list[int], wait: float = WAIT
) -> None:
    """Return once ``target``'s events have stored ``keys`` (or after ``wait``)."""
    until = time.monotonic() + wait
    # polled: the index is the feed's, updated as each rank's events arrive, with no
    # signal per key; a held request looks a few hundred times at most
    while pending_on(index, target, keys) and time.monotonic() < until:  # noqa: ASYNC110
        await asyncio.sleep(POLL)
