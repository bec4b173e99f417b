"""Workers from etcd: one key per worker under a prefix, its value the worker's spec.

Read the whole prefix, then watch it from the revision read. After any gap --
the watch broke, etcd compacted the revision, or ``resync`` seconds passed --
read the whole prefix again and reconcile (``etcd_follow``): a worker whose key
is gone is removed, whatever events were missed (the stale-membership bug class
of the peers' watchers). While etcd cannot be read, the last membership read stays
and keeps routing; the registry is marked stale until a read succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from dprouter.core.errors import ConfigError, Duplicate, EtcdError
from dprouter.fleet.membership.etcd_client import Change, Entry, Etcd
from dprouter.fleet.membership.etcd_follow import follow
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.fleet.worker_spec import WorkerSpec, worker_from_mapping

log = logging.getLogger("dprouter")


def worker_key(prefix: str, name: str) -> str:
    return prefix + name


class EtcdMembership:
    name = "etcd"

    def __init__(
        self,
        endpoints: list[str],
        prefix: str,
        registry: Registry,
        monitor: Monitor,
        check: Callable[[WorkerSpec], WorkerSpec],
        resync: float = 30.0,
    ) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.registry = registry
        self.monitor = monitor
        self.check = check  # a worker as the running router takes it, or ConfigError
        self.resync = resync
        self.members: dict[str, tuple[str, bytes]] = {}  # key -> (worker id, value)
        self.synced = asyncio.Event()  # set once the prefix has been read whole
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._etcd: Etcd | None = None

    @property
    def etcd(self) -> Etcd:
        if self._etcd is None:  # its own session: watches outlive any request timeout
            self._session = aiohttp.ClientSession()
            self._etcd = Etcd(self.endpoints, self._session)
        return self._etcd

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(self.etcd), name="etcd-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def write(self, name: str, spec: dict[str, Any]) -> str:
        """Register a worker for every replica (the admin API): a key with no lease, which
        stays until deleted. Its key."""
        key = worker_key(self.prefix, name)
        await self.etcd.put(key, orjson.dumps(spec))
        return key

    async def erase(self, worker_id: str) -> str | None:
        """Deregister a worker that came from etcd, for every replica; its key (None: it
        did not come from etcd)."""
        key = next((k for k, (w, _) in self.members.items() if w == worker_id), None)
        if key is not None:
            await self.etcd.delete(key)
        return key

    async def _run(self, etcd: Etcd) -> None:
        await follow(etcd, self.prefix, self, self.resync)

    def whole(self, entries: list[Entry], revision: int) -> None:
        self.reconcile({e.key: e.value for e in entries})

    def changed(self, changes: list[Change]) -> None:
        for change in changes:
            self.apply(change.key, change.value)

    def reconcile(self, wanted: dict[str, bytes]) -> None:
        """Make the members exactly the keys read (level-triggered)."""
        for key in [k for k in self.members if k not in wanted]:
            self.apply(key, None)
        for key, value in wanted.items():
            self.apply(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        """One key's new value (None: deleted)."""
        held = self.members.get(key)
        if held is not None and held[1] == value:
            return
        if held is not None:
            del self.members[key]
            worker_id = held[0]
            if worker_id in self.registry.workers:
                self.monitor.forget(worker_id)
                self.registry.remove(worker_id)
                log.info("etcd: worker %s left (%s)", worker_id, key)
        if value is not None:
            self._add(key, value)

    def _add(self, key: str, value: bytes) -> None:
        try:
            raw: Any = orjson.loads(value)
            if not isinstance(raw, dict):
                raise ConfigError("the value must be a JSON object describing one worker")
            spec = worker_from_mapping(raw)
            spec = replace(spec, id=spec.id or key[len(self.prefix) :])
            spec = self.check(spec)
            worker = self.registry.add(worker_from_spec(spec, self.registry))
        except (orjson.JSONDecodeError, ConfigError, TypeError, Duplicate) as exc:
            self.members[key] = ("", value)  # not again until the value changes
            log.error("etcd: key %s ignored: %s", key, exc)
            return
        self.members[key] = (worker.id, value)
        self.monitor.watch(worker)
        log.info("etcd: worker %s joined: %s (%s)", worker.id, worker.url, key)

    def reachable(self) -> None:
        if self.registry.mark_stale(False):
            log.warning("etcd reachable again: membership is current")
        self.synced.set()

    def unreachable(self, exc: EtcdError) -> None:
        if self.registry.mark_stale(True):
            log.error(
                "etcd unreachable (%s): keeping the last membership read (%d workers) and retrying",
                exc,
                len(self.members),
            )
