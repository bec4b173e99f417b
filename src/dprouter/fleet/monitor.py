"""Background work on workers: discovery until each is ready, then load scraping.

A worker gets no traffic until discovery settles its dialect and ranks; a
worker that cannot be reached is retried with capped backoff, and one that
contradicts its configuration is parked in the ``error`` state, loudly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp

from dprouter.core.errors import Contradiction, DiscoveryError
from dprouter.core.tls import EngineAccess
from dprouter.fleet import engine_load, probe
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import keys

log = logging.getLogger("dprouter.monitor")
FRESH = 0.25  # seconds: versions read this recently are not read again on request


@dataclass(frozen=True)
class MonitorOptions:
    timeout: float = 2.0  # per probe or scrape request
    retry_min: float = 0.2  # discovery backoff starts here...
    retry_max: float = 5.0  # ...and doubles up to here
    scrape_interval: float = 1.0  # engine-reported load; 0 turns scraping off
    health_interval: float = 5.0  # GET /health of each ready worker; 0 turns checks off
    health_failures: int = 3  # consecutive failed checks before the worker is taken out
    health_successes: int = 2  # consecutive good checks before it is taken back
    health_timeout: float = 2.0  # seconds one check may take
    # seconds between reads of each worker's weights version (SGLang's /model_info, vLLM's
    # /weight_info), held workers included: an update sent straight to an engine, not
    # through the router, is seen within this; 0 turns the reads off
    version_interval: float = 5.0


class Monitor:
    def __init__(
        self,
        registry: Registry,
        options: MonitorOptions | None = None,
        access: EngineAccess | None = None,
    ) -> None:
        self.registry = registry
        self.options = options or MonitorOptions()
        # discovery, health checks and load scrapes carry the engines' TLS context and keys
        self.access = access or EngineAccess()
        self._session: aiohttp.ClientSession | None = None
        self._discovering: dict[str, asyncio.Task[None]] = {}
        self._scraper: asyncio.Task[None] | None = None
        self._checker: asyncio.Task[None] | None = None
        self._versioner: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None  # the versions' read under way
        self._read_at = -1e9  # when the last read of the versions began (time.monotonic())
        self._unhealthy: dict[str, int] = {}  # worker id -> consecutive failed checks
        self.changed = asyncio.Event()  # set whenever a worker settles

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.options.timeout)
            key_of = keys(self.registry.workers.values, self.access)
            self._session = self.access.session(key_of, timeout=timeout)
        return self._session

    async def start(self) -> None:
        for worker in list(self.registry.workers.values()):
            self.watch(worker)
        if self.options.scrape_interval > 0:
            self._scraper = asyncio.create_task(self._scrape_loop(), name="scrape")
        if self.options.health_interval > 0:
            self._checker = asyncio.create_task(self._health_loop(), name="health")
        if self.options.version_interval > 0:
            self._versioner = asyncio.create_task(self._version_loop(), name="versions")

    async def stop(self) -> None:
        loops = [
            t
            for t in (self._scraper, self._checker, self._versioner, self._reading)
            if t is not None
        ]
        tasks = [*self._discovering.values(), *loops]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._discovering.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def watch(self, worker: Worker) -> None:
        """Discover ``worker`` in the background (again, if it was known)."""
        self.forget(worker.id)
        self.registry.mark_discovering(worker)
        task = asyncio.create_task(self._discover(worker), name=f"discover-{worker.id}")
        self._discovering[worker.id] = task

    def suspect(self, worker: Worker) -> None:
        """A connection to ``worker`` was refused: no traffic until it answers again."""
        if worker.ready and worker.id in self.registry.workers:
            log.warning("worker %s refused a connection: out until it answers again", worker.id)
            self.watch(worker)

    def stated(self, worker: Worker, version: str, asked: float) -> None:
        """An answer of ``worker`` stated the weights' ``version`` it serves. Taken unless
        the router changed the worker's version after the request was sent (``asked``,
        ``time.monotonic()``): an answer made before an update may arrive after it."""
        if version != worker.weight_version and asked >= worker.version_since:
            self.registry.set_weight_version(worker, version)

    async def read_versions(self) -> None:
        """Read every ready worker's weights version now (a request waits for weights that
        an engine may have already: updated straight, not through the router). Reads
        under way are joined, not repeated; a new one starts at most every ``FRESH`` s."""
        if self._reading is None:
            if time.monotonic() - self._read_at < FRESH:
                return
            self._read_at = time.monotonic()
            self._reading = asyncio.create_task(self._read_versions(), name="read-versions")
            self._reading.add_done_callback(self._read_done)
        await asyncio.shield(self._reading)

    def _read_done(self, task: asyncio.Task[None]) -> None:
        self._reading = None

    async def _read_versions(self) -> None:
        # vLLM says its version only with its RL routes on (VLLM_SERVER_DEV_MODE=1): a
        # worker whose discovery found none is not asked again
        ready = [
            w
            for w in self.registry.workers.values()
            if w.ready and (w.dialect == "sglang" or w.weight_version is not None)
        ]
        said = await asyncio.gather(*(self._version(w) for w in ready))
        for worker, version in zip(ready, said, strict=True):
            if version is not None and worker.id in self.registry.workers:
                self.registry.set_weight_version(worker, version)

    async def _version(self, worker: Worker) -> str | None:
        path = "/model_info" if worker.dialect == "sglang" else "/weight_info"
        try:
            async with asyncio.timeout(self.options.timeout):
                return await probe.weight_version(self.session, worker.url, path)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("weights version of %s unavailable: %s", worker.id, exc)
            return None

    async def _version_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.version_interval)
            await self.read_versions()

    def forget(self, worker_id: str) -> None:
        task = self._discovering.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def settled(self, *workers: Worker) -> None:
        """Return once none of ``workers`` (default: all) is still discovering.

        Bound the wait with ``asyncio.timeout``."""
        while True:
            self.changed.clear()
            watched = workers or tuple(self.registry.workers.values())
            if not any(w.state == "discovering" for w in watched):
                return
            await self.changed.wait()

    async def settled_within(self, seconds: float) -> bool:
        """``settled`` for at most ``seconds``; False if some worker is still discovering."""
        try:
            async with asyncio.timeout(seconds):
                await self.settled()
        except TimeoutError:
            return False
        return True

    async def _discover(self, worker: Worker) -> None:
        delay = self.options.retry_min
        while True:
            try:
                if self.options.health_interval > 0:
                    await self._recovered(worker)
                found = await probe.probe(self.session, worker)
            except Contradiction as exc:
                log.error("worker %s refused: %s", worker.id, exc)
                self.registry.mark_error(worker, str(exc))
                break
            except (DiscoveryError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # ValueError covers malformed JSON and metrics text: a worker still starting
                worker.error = f"{type(exc).__name__}: {exc}"
                log.warning("worker %s not ready (%s); retrying in %.1fs", worker.id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.options.retry_max)
                continue
            except Exception as exc:  # a bug or a bizarre answer: park the worker, loudly
                log.exception("discovery of worker %s failed", worker.id)
                self.registry.mark_error(worker, f"discovery failed: {type(exc).__name__}: {exc}")
                break
            probe.apply(worker, found)
            self.registry.mark_ready(worker)
            if self.options.scrape_interval > 0:
                await self._scrape(worker)  # its running caps known before its first request
            if worker.ranks > 1 and not self.registry.dp_aware:
                log.warning(
                    "worker %s runs %d DP ranks%s but DP-aware routing is OFF: its own "
                    "balancer places every request",
                    worker.id,
                    worker.ranks,
                    " with DP attention" if worker.dp_attention else "",
                )
            log.info(
                "worker %s ready: %s, %d rank(s)%s",
                worker.id,
                worker.dialect,
                worker.ranks,
                ", DP attention" if worker.dp_attention else "",
            )
            break
        self._discovering.pop(worker.id, None)
        self.changed.set()

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.scrape_interval)
            ready = [w for w in self.registry.workers.values() if w.ready]
            await asyncio.gather(*(self._scrape(w) for w in ready))

    async def _scrape(self, worker: Worker) -> None:
        caps: dict[int, int] = {}
        kv: dict[int, int] = {}
        try:
            per_rank, caps, kv = await engine_load.read(self.session, worker)
        except Exception as exc:  # one odd worker must not stop scraping the others
            log.debug("load of %s unavailable: %s", worker.id, exc)
            per_rank = {}  # unknown now: fall back on the router's own counts
        engine_load.assign(worker, per_rank, caps, kv)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval)
            # a held engine (paused for a weight update, say) may not answer a health
            # check that generates: a pause is not a failure
            ready = [w for w in self.registry.workers.values() if w.ready and w.held is None]
            verdicts = await asyncio.gather(*(self._check(w) for w in ready))
            for worker, problem in zip(ready, verdicts, strict=True):
                if problem is None:
                    self._unhealthy.pop(worker.id, None)
                    continue
                failed = self._unhealthy[worker.id] = self._unhealthy.get(worker.id, 0) + 1
                if failed >= self.options.health_failures and worker.ready:
                    log.warning(
                        "worker %s failed %d health checks (%s): out", worker.id, failed, problem
                    )
                    self._unhealthy.pop(worker.id, None)
                    self.watch(worker)  # back in once /health and discovery answer again

    async def _check(self, worker: Worker) -> str | None:
        """What is wrong with ``worker``'s ``GET /health``, or None: it answered 2xx in time.
        A 404 is a failure too: a worker URL with a path (``/v1``) would pass it otherwise."""
        timeout = aiohttp.ClientTimeout(total=self.options.health_timeout)
        try:
            async with self.session.get(worker.url + "/health", timeout=timeout) as r:
                return None if 200 <= r.status < 300 else f"GET /health answered {r.status}"
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            return "connection refused" if refused else f"cannot connect ({exc.os_error})"
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                return f"GET /health gave no answer within {self.options.health_timeout:g} s"
            return f"GET /health failed ({type(exc).__name__} {exc})".replace(" )", ")")

    async def _recovered(self, worker: Worker) -> None:
        """``health_successes`` good checks in a row, a little apart, or DiscoveryError."""
        for i in range(self.options.health_successes):
            if i:
                await asyncio.sleep(min(self.options.retry_min, self.options.health_interval))
            problem = await self._check(worker)
            if problem is not None:
                raise DiscoveryError(problem)
