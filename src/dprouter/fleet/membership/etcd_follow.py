"""Following a prefix of etcd: read it whole, then watch it from the revision read.

After any gap -- the watch broke, etcd compacted the revision, or ``resync`` seconds
passed -- read it whole again: whatever events a gap lost, the next whole read makes up
for (level-triggered). While etcd cannot be read the follower is told so, and the read
is tried again with backoff. Workers (``etcd``) and holds (``etcd_holds``) follow their
prefixes so.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from dprouter.core.errors import Compacted, EtcdError
from dprouter.fleet.membership.etcd_client import Change, Entry, Etcd

log = logging.getLogger("dprouter")
BACKOFF = (0.2, 5.0)  # seconds between attempts to reach etcd: first, most


class Follower(Protocol):
    def whole(self, entries: list[Entry], revision: int) -> None:
        """Every key under the prefix, read at ``revision``."""

    def changed(self, changes: list[Change]) -> None:
        """One batch of changes, in revision order."""

    def reachable(self) -> None: ...

    def unreachable(self, exc: EtcdError) -> None: ...


async def follow(etcd: Etcd, prefix: str, follower: Follower, resync: float) -> None:
    """Until cancelled."""
    delay = BACKOFF[0]
    while True:
        try:
            entries, revision = await etcd.read(prefix)
            follower.whole(entries, revision)
            follower.reachable()
            delay = BACKOFF[0]
            async with asyncio.timeout(resync):  # then read whole again
                async for changes in etcd.watch(prefix, revision + 1):
                    follower.changed(changes)
        except TimeoutError:
            continue
        except Compacted:
            log.info("etcd compacted past the watch: reading %s whole again", prefix)
        except EtcdError as exc:
            follower.unreachable(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF[1])
