"""Subscribers for every rank of every routable worker that publishes KV events.

Follows the registry: a worker that is ready and healthy gets one ``RankStream`` per
rank; one that leaves, fails its health checks or changes its ranks has its streams
stopped, and a stopped stream empties its rank in the index. Each serving process
(and each replica) runs its own, so all build the same index from the same events.

Where rank r publishes (``sources``): ``kv_events=tcp://HOST:PORT`` means PORT + r (+
the worker's ``rank_offset``: the engines offset by the global rank); ``kv_events=auto``
asks the engine, once per worker for all its ranks. An engine that says it publishes
nothing (or vLLM's endpoint answers 404) is logged once with the reason and asked again
every ``quiet`` seconds, or when the worker comes back; one that does not answer, every
``retry`` seconds, logged once per reason.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import zmq.asyncio

from dprouter.core.tls import EngineAccess
from dprouter.engines.kvevents import sources
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.subscriber import RankStream
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import keys

log = logging.getLogger("dprouter.kvevents")
RETRY = 2.0  # seconds between asks of an engine that did not answer
QUIET = 60.0  # ...and of one that said it publishes nothing


class Feed:
    def __init__(
        self,
        registry: Registry,
        index: KvIndex,
        probe: float = 10.0,
        retry: float = RETRY,
        quiet: float = QUIET,
        access: EngineAccess | None = None,
    ) -> None:
        self.registry = registry
        self.index = index
        self.access = access or EngineAccess()  # the lookups carry the engines' TLS and keys
        self.probe, self.retry, self.quiet = probe, retry, quiet
        self.ctx = zmq.asyncio.Context()
        self.streams: dict[tuple[str, int], tuple[RankStream, asyncio.Task[None]]] = {}
        # kv_events=auto: one question per worker (and rank count) for all its ranks
        self.asking: dict[str, tuple[int, asyncio.Task[sources.Sources]]] = {}
        self.asks = 0  # questions put to engines, answered or not
        self._session: aiohttp.ClientSession | None = None
        self._sync: asyncio.Task[None] | None = None
        self._due = False

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        key_of = keys(self.registry.workers.values, self.access)
        self._session = self.access.session(key_of, timeout=timeout)
        self.registry.listeners.append(self.changed)
        self.changed()

    async def stop(self) -> None:
        if self.changed in self.registry.listeners:
            self.registry.listeners.remove(self.changed)
        tasks = [t for _, t in self.streams.values()] + [t for _, t in self.asking.values()]
        if self._sync is not None:
            tasks.append(self._sync)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.streams.clear()
        self.asking.clear()
        if self._session is not None:
            await self._session.close()
        self.ctx.term()

    def changed(self) -> None:
        """The registry changed: streams follow (once, however many changes came)."""
        if not self._due:
            self._due = True
            self._sync = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        await asyncio.sleep(0)
        self._due = False
        wanted: dict[tuple[str, int], Worker] = {}
        for w in self.registry.snapshot.workers:
            if w.kv_events:
                for rank in range(max(w.ranks, 1)):
                    wanted[(w.id, rank)] = w
        for name in [n for n in self.streams if n not in wanted]:
            _, task = self.streams.pop(name)
            task.cancel()  # its rank is emptied as it stops
        workers = {w.id: w for w in wanted.values()}
        for wid, (ranks, asking) in list(self.asking.items()):
            if wid not in workers or ranks != max(workers[wid].ranks, 1):
                del self.asking[wid]  # gone, or other ranks: asked afresh when wanted
                asking.cancel()
                for name in [n for n in self.streams if n[0] == wid]:
                    self.streams.pop(name)[1].cancel()  # they awaited that answer
        for name, worker in wanted.items():
            if name not in self.streams or self.streams[name][1].done():
                self._start(name, worker)

    def _start(self, name: tuple[str, int], worker: Worker) -> None:
        if worker.kv_block_size:
            self.index.expect_size(worker.id, worker.kv_block_size)
            self.index.rank(*name)  # listed at once: empty, but sized for pending blocks
        stream = RankStream(self.ctx, self.index, name, "", probe=self.probe)
        task = asyncio.create_task(self._run(stream, worker), name=f"kv-events {name}")
        self.streams[name] = (stream, task)

    async def _run(self, stream: RankStream, worker: Worker) -> None:
        by = stream.rank + (worker.rank_offset or 0)  # the engine's own (global) rank
        if worker.kv_events == "auto":
            found = await asyncio.shield(self._asked(worker))
            stream.endpoint, stream.replay_endpoint = found[by]
        else:
            stream.endpoint, stream.replay_endpoint = sources.configured(worker, by)
        log.info("KV events of %s/%d from %s", *stream.name, stream.endpoint)
        try:
            await stream.run()
        except zmq.ZMQError as exc:  # followed again when the worker comes back
            log.warning("KV events of %s/%d from %s: %s", *stream.name, stream.endpoint, exc)

    def _asked(self, worker: Worker) -> asyncio.Task[sources.Sources]:
        ranks = max(worker.ranks, 1)
        held = self.asking.get(worker.id)
        if held is not None and held[1].done():  # an answer is kept, a failure asked again
            failed = held[1].cancelled() or held[1].exception() is not None
            held = None if failed else held
        if held is None or held[0] != ranks:
            task = asyncio.create_task(self._ask(worker), name=f"kv-event sources {worker.id}")
            held = self.asking[worker.id] = (ranks, task)
        return held[1]

    async def _ask(self, worker: Worker) -> sources.Sources:
        """Ask until the engine names every rank's publisher; each reason to ask again
        is logged once, not once a retry (nor once a rank)."""
        assert self._session is not None
        first = worker.rank_offset or 0
        needed = set(range(first, first + max(worker.ranks, 1)))
        said = None
        while True:
            self.asks += 1
            wait = self.quiet
            try:
                found = await sources.ask(self._session, worker)
                missing = needed - set(found)
                if not missing:
                    return found
                reason = f"the engine names no publisher of its ranks {sorted(missing)}"
            except sources.NoEvents as exc:
                reason = str(exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # str, not repr: an aiohttp error's repr holds the request's headers (the key)
                what = f"{type(exc).__name__}: {exc}".rstrip(": ")
                reason, wait = f"asking where it publishes: {what}", self.retry
            if reason != said:
                said = reason
                log.warning(
                    "%s (%s) has kv_events=auto but no KV events to follow: %s; "
                    "asking again every %g s",
                    worker.id,
                    worker.url,
                    reason,
                    wait,
                )
            await asyncio.sleep(wait)
