"""Keeping one engine registered in etcd while it is healthy (``dprouter register``).

Waits until the engine answers ``/health``, writes the worker's key on a lease of
``ttl`` seconds and keeps the lease alive. When the engine stops answering
(``misses`` checks in a row) or on stop it revokes the lease, so the key goes at
once for every replica; when the engine answers again it registers again. Killed
outright, it stops refreshing the lease, and etcd drops the key ``ttl`` seconds later.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

import aiohttp
import orjson

from dprouter.core.errors import EtcdError
from dprouter.fleet.membership import worker_name
from dprouter.fleet.membership.etcd_client import Etcd
from dprouter.fleet.worker_spec import WorkerSpec, check_worker

log = logging.getLogger("dprouter")


def spec_value(spec: WorkerSpec) -> bytes:
    """The key's value: the worker's spec, the fields ``--worker`` takes (set ones only)."""
    spec = check_worker(spec)
    return orjson.dumps({k: v for k, v in asdict(spec).items() if v is not None})


class Registrar:
    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        spec: WorkerSpec,
        ttl: int,
        health_interval: float,
        misses: int = 2,
    ) -> None:
        self.etcd = etcd
        self.spec = check_worker(spec)
        # the routers read etcd://HOST/PREFIX as the keys under /PREFIX/
        self.key = "/" + prefix.strip("/") + "/" + (spec.id or worker_name(self.spec.url))
        self.value = spec_value(spec)
        self.ttl = ttl
        self.every = min(health_interval, ttl / 3)  # the lease is refreshed at least 3x a TTL
        self.misses = misses
        self.registered = asyncio.Event()  # set while the key is in etcd (for tests, logs)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: registered while the engine is healthy, not while it is not."""
        while not stop.is_set():
            if not await self._until(stop, healthy=True):
                return
            lease = await self._register(stop)
            if lease is None:
                return
            try:
                await self._keep(lease, stop)
            finally:
                self.registered.clear()
                await self._revoke(lease)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.etcd.revoke(lease)
            log.info("deregistered %s", self.key)
        except EtcdError as exc:
            log.error("cannot revoke (%s): %s goes when its lease expires", exc, self.key)

    async def _healthy(self) -> bool:
        timeout = aiohttp.ClientTimeout(total=max(self.every, 1.0))
        try:
            async with self.etcd.session.get(self.spec.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _until(self, stop: asyncio.Event, healthy: bool) -> bool:
        """Wait until the engine is healthy; False if stopped first."""
        while not stop.is_set():
            if await self._healthy() is healthy:
                return True
            await _pause(stop, self.every)
        return False

    async def _register(self, stop: asyncio.Event) -> int | None:
        """Write the key on a fresh lease, retrying while etcd is away; the lease."""
        delay = 0.2
        while not stop.is_set():
            try:
                lease = await self.etcd.grant(self.ttl)
                await self.etcd.put(self.key, self.value, lease)
            except EtcdError as exc:
                log.error("cannot register %s yet: %s", self.key, exc)
                await _pause(stop, delay)
                delay = min(delay * 2, 5.0)
                continue
            self.registered.set()
            log.info("registered %s -> %s (lease %d s)", self.key, self.spec.url, self.ttl)
            return lease
        return None

    async def _keep(self, lease: int, stop: asyncio.Event) -> None:
        """Refresh the lease while the engine is healthy; return when it is not, when the
        lease is lost, or on stop."""
        missed = 0
        while not stop.is_set():
            await _pause(stop, self.every)
            if stop.is_set():
                return
            try:
                if await self.etcd.keepalive(lease) == 0:  # expired while etcd was away
                    log.warning("lease of %s expired: registering again", self.key)
                    return
            except EtcdError as exc:
                log.error("cannot refresh the lease of %s: %s", self.key, exc)
            missed = 0 if await self._healthy() else missed + 1
            if missed >= self.misses:
                log.warning("%s fails its health check: deregistering it", self.spec.url)
                return


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass
