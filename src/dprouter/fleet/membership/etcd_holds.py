"""Holds and weight versions across replicas: what the engine commands relayed by one
replica left each worker in, shared through etcd, so every replica routes around it.

One key per worker under ``PREFIX.holds/`` (beside the workers' prefix: the membership
watch does not see it), named by the worker's URL -- the one name every replica gives an
engine (ids from each replica's own ``--worker`` list may differ) -- its value the
standing and the last version a command set, as JSON, with the replica that wrote it.
The replica that relays a command writes the key (in one transaction for every worker
the command reached) on a lease of its own, kept alive while it lives; every replica
reads the prefix whole at start (one that joins later serves the holds from its first
request), then follows it (``etcd_follow``) and applies what it reads: the hold, and the
version when a command changed it.

Each replica's view is etcd's, with its own writes not yet acknowledged laid over it: a
change applies here at once, and an older value read back meanwhile (its own, or another
replica's written just before) does not undo it. A replica never writes what it read, so
nothing loops between replicas; the last write to a key wins on every replica alike.

A hold cannot outlive its replica: killed, stopped, or cut off from etcd, its lease runs
out within ``--hold-lease`` seconds, its keys go, and every replica -- itself included,
once it reads etcd again -- releases those workers (versions stay as they are). A worker
that leaves takes its key with it (deleted by the replica that wrote it last).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any

import orjson

from dprouter.core.errors import EtcdError
from dprouter.fleet.membership.etcd import EtcdMembership
from dprouter.fleet.membership.etcd_client import Change, Entry
from dprouter.fleet.membership.etcd_follow import follow
from dprouter.fleet.membership.etcd_writes import LeasedWrites
from dprouter.fleet.registry import Registry
from dprouter.fleet.standing import Standing, Standings
from dprouter.fleet.targets import Worker

log = logging.getLogger("dprouter")
FIRST_READ = 2.0  # seconds start() waits for the holds' first read
STOP_WAIT = 1.0  # seconds stop() waits for what is pending to be written


def holds_prefix(workers_prefix: str) -> str:
    return f"{workers_prefix.rstrip('/')}.holds/"


class EtcdHolds(Standings):
    """``Standings`` for every replica; a source (``start``, ``stop``, ``synced``) beside
    the etcd membership whose client and prefix it shares."""

    name = "etcd-holds"

    def __init__(
        self, membership: EtcdMembership, registry: Registry, lease: int, resync: float = 30.0
    ) -> None:
        super().__init__(registry)
        self.membership = membership
        self.prefix = holds_prefix(membership.prefix)
        self.resync = resync
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.synced = asyncio.Event()  # set once the prefix has been read whole
        self.known: dict[str, tuple[int, bytes | None]] = {}  # url -> etcd's (revision, value)
        self.applied: dict[str, tuple[str, bytes | None]] = {}  # url -> (worker id, value)
        # ours, by url, until etcd took them
        self.writes = LeasedWrites(self.prefix, lease, self._written)
        self._tasks: list[asyncio.Task[None]] = []
        registry.listeners.append(self._members)

    async def start(self) -> None:
        """Started before the membership: the holds are read (for up to ``FIRST_READ``
        seconds) before any worker joins, so none is routed to before its hold is known."""
        etcd = self.membership.etcd
        self._tasks = [
            asyncio.create_task(follow(etcd, self.prefix, self, self.resync), name="etcd-holds"),
            *self.writes.start(etcd),
        ]
        try:
            async with asyncio.timeout(FIRST_READ):
                await self.synced.wait()
        except TimeoutError:
            pass  # etcd is away: no worker joins from it either, until it answers

    async def stop(self) -> None:
        """What is pending goes out first (a second at most: a release just relayed is not
        lost); the lease is left to run out: a replica stopped mid-update holds the
        workers a while longer everywhere, as if it had been killed."""
        if self._tasks:
            await self.writes.published(STOP_WAIT)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- this replica's changes --

    def set(self, worker: Worker, standing: Standing) -> None:
        super().set(worker, standing)
        self._publish(worker, standing, self._version_of(worker.url))

    def version(self, worker: Worker, version: str) -> None:
        super().version(worker, version)
        self._publish(worker, self.of(worker), version)

    async def published(self, seconds: float) -> None:
        """Wait up to ``seconds`` for etcd to take every change made so far (etcd away: the
        change holds here, and goes out when it answers)."""
        if not await self.writes.published(seconds):
            log.warning("etcd took no hold within %g s: the other replicas learn it later", seconds)

    def _publish(self, worker: Worker, standing: Standing, version: str | None) -> None:
        """Written unless this replica wrote it last already: a command repeated here, or
        one that changes nothing, writes nothing; relayed by another replica, the hold is
        that replica's from now (on its lease)."""
        value = orjson.dumps({**standing.fields(), "weight_version": version, "by": self.replica})
        if value == self._effective(worker.url):
            return
        self.applied[worker.url] = (worker.id, value)
        self.writes.put(worker.url, value)

    def _version_of(self, url: str) -> str | None:
        """The last version a command set for the worker at ``url``, through any replica."""
        return _decoded(self._effective(url)).get("weight_version")

    # -- what etcd says (etcd_follow.Follower) --

    def whole(self, entries: list[Entry], revision: int) -> None:
        found = {e.key[len(self.prefix) :]: e for e in entries}
        for url in [u for u in self.known if u not in found]:
            self._learn(url, revision, None)
        for url, entry in found.items():
            self._learn(url, entry.mod_revision, entry.value)

    def changed(self, changes: list[Change]) -> None:
        for change in changes:
            self._learn(change.key[len(self.prefix) :], change.revision, change.value)

    def reachable(self) -> None:
        self.synced.set()

    def unreachable(self, exc: EtcdError) -> None:
        """The membership says so in its log and metric; the holds are read with it."""

    def _learn(self, url: str, revision: int, value: bytes | None) -> None:
        if revision < self.known.get(url, (0, None))[0]:
            return  # older than what we know
        self.known[url] = (revision, value)
        self._apply(url)

    def _written(self, url: str, value: bytes | None, revision: int) -> None:
        """etcd took our ``value`` at ``revision``: unless another replica wrote since."""
        if revision >= self.known.get(url, (0, None))[0]:
            self.known[url] = (revision, value)
        self._apply(url)

    def _effective(self, url: str) -> bytes | None:
        """Ours not yet taken, else etcd's."""
        pending = self.writes.pending
        return pending[url] if url in pending else self.known.get(url, (0, None))[1]

    def _apply(self, url: str) -> None:
        """The worker at ``url`` (if this replica has it) as etcd and our pending writes say."""
        worker = next((w for w in self.registry.workers.values() if w.url == url), None)
        if worker is None:
            return
        value = self._effective(url)
        before = self.applied.get(url)
        if before == (worker.id, value):
            return
        self.applied[url] = (worker.id, value)  # first: hold() below calls _members again
        found = _decoded(value)
        Standings.set(self, worker, Standing.of(found))
        version = found.get("weight_version")
        same = before is not None and before[0] == worker.id  # not one that left since
        said = _decoded(before[1]).get("weight_version") if before and same else None
        if isinstance(version, str) and version != said:
            Standings.version(self, worker, version)

    def _members(self) -> None:
        """A worker that joined takes what etcd says of it; one that left takes its key with it,
        when this replica wrote the key last."""
        here = {w.url: w.id for w in self.registry.workers.values()}
        for url, (worker_id, _) in list(self.applied.items()):
            if here.get(url) != worker_id:
                del self.applied[url]
                if _decoded(self._effective(url)).get("by") == self.replica:
                    self.writes.put(url, None)
        for url in here:
            if url not in self.applied and (url in self.known or url in self.writes.pending):
                self._apply(url)


def _decoded(value: bytes | None) -> dict[str, Any]:
    if not value:
        return {}
    try:
        found = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return found if isinstance(found, dict) else {}
