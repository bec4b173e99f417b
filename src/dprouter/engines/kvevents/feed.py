"""Subscribers for every rank of every routable worker that publishes KV events.

Follows the registry: a worker that is ready and healthy gets one ``RankStream`` per
rank; one that leaves, fails its health checks or changes its ranks has its streams
stopped, and a stopped stream empties its rank in the index. Each serving process
(and each replica) runs its own, so all build the same index from the same events.

Where rank r publishes: ``kv_events=tcp://HOST:PORT`` means PORT + r (+ the worker's
``rank_offset``: vLLM offsets by the global rank), as vLLM and SGLang lay their
publishers out; ``kv_events=auto`` asks vLLM's ``GET /kv_event_sources``, whose
``tcp://*:P`` means the worker's own host.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq.asyncio

from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.subscriber import RankStream
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker

log = logging.getLogger("dprouter.kvevents")
RETRY = 2.0  # seconds between asks of /kv_event_sources that failed


def offset(endpoint: str, by: int) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + by}"


def on_host(endpoint: str, worker_url: str) -> str:
    """``tcp://*:P`` (or 0.0.0.0) as the engine binds it -> the worker's host."""
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    for wild in ("*", "0.0.0.0", "[::]"):
        endpoint = endpoint.replace(f"//{wild}:", f"//{host}:")
    return endpoint


def sources(answer: Any, worker: Worker) -> dict[int, tuple[str, str | None]]:
    """vLLM's ``/kv_event_sources``: rank -> (endpoint, replay endpoint)."""
    found: dict[int, tuple[str, str | None]] = {}
    if isinstance(answer, dict):
        for rank, source in answer.items():
            if isinstance(source, dict) and isinstance(source.get("endpoint"), str):
                replay = source.get("replay_endpoint")
                found[int(rank)] = (
                    on_host(source["endpoint"], worker.url),
                    on_host(replay, worker.url) if isinstance(replay, str) else None,
                )
    return found


class Feed:
    def __init__(self, registry: Registry, index: KvIndex, probe: float = 10.0) -> None:
        self.registry = registry
        self.index = index
        self.probe = probe
        self.ctx = zmq.asyncio.Context()
        self.streams: dict[tuple[str, int], tuple[RankStream, asyncio.Task[None]]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._sync: asyncio.Task[None] | None = None
        self._due = False

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.registry.listeners.append(self.changed)
        self.changed()

    async def stop(self) -> None:
        if self.changed in self.registry.listeners:
            self.registry.listeners.remove(self.changed)
        for task in [self._sync, *(task for _, task in self.streams.values())]:
            if task is not None:
                task.cancel()
        tasks = [t for _, t in self.streams.values()]
        await asyncio.gather(*tasks, *([self._sync] if self._sync else []), return_exceptions=True)
        self.streams.clear()
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
        base = worker.kv_events
        by = stream.rank + (worker.rank_offset or 0)
        if base == "auto":
            found: dict[int, tuple[str, str | None]] = {}
            while by not in found:  # keyed by the engine's own (global) rank
                found = await self._ask(worker)
                if by not in found:
                    await asyncio.sleep(RETRY)
            stream.endpoint, stream.replay_endpoint = found[by]
        elif base is not None:
            stream.endpoint = offset(base, by)
            stream.replay_endpoint = offset(worker.kv_replay, by) if worker.kv_replay else None
        log.info("KV events of %s/%d from %s", *stream.name, stream.endpoint)
        await stream.run()

    async def _ask(self, worker: Worker) -> dict[int, tuple[str, str | None]]:
        assert self._session is not None
        try:
            async with self._session.get(f"{worker.url}/kv_event_sources") as answer:
                if answer.status == 200:
                    return sources(await answer.json(content_type=None), worker)
                log.warning("%s/kv_event_sources answered %d", worker.url, answer.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("%s/kv_event_sources: %s", worker.url, exc)
        return {}
