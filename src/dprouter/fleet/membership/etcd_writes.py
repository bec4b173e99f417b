"""Keys one replica writes on a lease of its own (the holds it relayed, ``etcd_holds``).

A key's latest value waits in ``pending`` until etcd took it; a newer value for the same
key replaces it there, so only the last is written. What is pending goes out in batches,
one transaction each, retried with backoff while etcd is away. The lease is granted at
the first write, refreshed three times per TTL, and replaced at the next write once it
ran out (its keys went with it, from every replica).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dprouter.core.errors import EtcdError
from dprouter.fleet.membership.etcd_client import Etcd
from dprouter.fleet.membership.etcd_follow import BACKOFF

log = logging.getLogger("dprouter")
BATCH = 64  # keys written in one transaction at most (etcd's default cap: 128 operations)
Written = Callable[[str, bytes | None, int], None]  # (name, value, revision)


class LeasedWrites:
    def __init__(self, prefix: str, ttl: int, written: Written) -> None:
        self.etcd: Etcd | None = None  # from start() on
        self.prefix = prefix  # each key is the prefix and a name
        self.ttl = ttl
        self.written = written  # told of each value etcd took
        self.pending: dict[str, bytes | None] = {}  # name -> value (None: delete the key)
        self._lease = 0
        self._wake = asyncio.Event()
        self._quiet = asyncio.Event()  # nothing pending
        self._quiet.set()
        self._unreachable = False

    def start(self, etcd: Etcd) -> list[asyncio.Task[None]]:
        """The writer and the lease's refresher: cancel both to stop. The lease is left to
        run out."""
        self.etcd = etcd
        return [
            asyncio.create_task(self._run(), name="etcd-writes"),
            asyncio.create_task(self._keep(), name="etcd-lease"),
        ]

    def put(self, name: str, value: bytes | None) -> None:
        self.pending[name] = value
        self._quiet.clear()
        self._wake.set()

    async def published(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for etcd to take every value put so far; False if it did
        not (they go out when it answers)."""
        try:
            async with asyncio.timeout(seconds):
                await self._quiet.wait()
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        delay = BACKOFF[0]
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                batch = list(self.pending.items())[:BATCH]
                try:
                    revision = await self._send(batch)
                except EtcdError as exc:
                    if not self._unreachable:
                        log.error("etcd unreachable (%s): holds kept here, written later", exc)
                    self._unreachable = True
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, BACKOFF[1])
                    continue
                if self._unreachable:
                    log.warning("etcd reachable again: holds written")
                self._unreachable, delay = False, BACKOFF[0]
                for name, value in batch:
                    if self.pending.get(name, b"") == value:  # nothing newer meanwhile
                        del self.pending[name]
                    self.written(name, value, revision)
            self._quiet.set()

    async def _keep(self) -> None:
        assert self.etcd is not None
        while True:
            await asyncio.sleep(self.ttl / 3)
            if not self._lease:
                continue
            try:
                left = await self.etcd.keepalive(self._lease)
            except EtcdError:
                continue  # the writer and the followers say so
            if not left:
                log.warning("the holds' lease ran out (etcd was away): they are released")
                self._lease = 0

    async def _send(self, batch: list[tuple[str, bytes | None]]) -> int:
        assert self.etcd is not None
        keys = [(self.prefix + name, value) for name, value in batch]
        for _ in range(2):
            if not self._lease:
                self._lease = await self.etcd.grant(self.ttl)
            try:
                return await self.etcd.write(keys, self._lease)
            except EtcdError as exc:
                if "lease not found" not in str(exc):
                    raise
                self._lease = 0  # it ran out while etcd was away: a new one
        raise EtcdError("etcd refused two fresh leases")
