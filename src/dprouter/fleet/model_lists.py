"""The engines' model lists, read again while the router runs, so that LoRA adapters
loaded or unloaded straight at an engine (by an RL framework, by an operator) are routed
accordingly within a bound: ``interval`` + ``timeout`` seconds (2 + 2 by default; in
practice the interval, a read taking milliseconds).

Both engines list their loaded adapters in ``GET /v1/models`` (vLLM 0.32 with their
``parent``; SGLang 0.5.23 has no other listing), a body of a few hundred bytes per
worker. Every ready worker's is read every ``interval`` seconds, all at once, and one
worker's at once when its engine answers that it does not serve a request's model or
adapter (``relist``, at most once per ``spacing`` seconds a worker: a burst of such
answers reads it once). A list that changed, in what the router reads of it (the names,
each card's ``parent``, ``root`` and ``max_model_len``), rebuilds the snapshot; one that
did not does not (vLLM's cards carry the time they were read and a random permission
id: compared whole, every read would rebuild it). A worker that does not answer, or
lists nothing (an engine always lists its model), keeps the list it had.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from dprouter.core.tls import EngineAccess
from dprouter.fleet import probe
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import keys

log = logging.getLogger("dprouter.models")


@dataclass(frozen=True)
class ListOptions:
    interval: float = 2.0  # seconds between reads of every ready worker's list; 0: never
    timeout: float = 2.0  # seconds one read may take
    spacing: float = 0.5  # seconds between two reads of one worker's list asked for at once


def served(registry: Registry, worker: Worker, cards: Sequence[dict[str, Any]]) -> bool:
    """``worker`` lists ``cards`` now (its ``/v1/models``); True when that is news: the
    snapshot is rebuilt, so the adapters' pools follow at once."""
    models = tuple(card["id"] for card in cards)
    fresh = {card["id"]: card for card in cards}
    news = models != worker.models or _read(fresh) != _read(worker.cards)
    worker.cards = fresh
    if news:
        worker.models = models
        registry.rebuild()
    return news


READ = ("parent", "root", "max_model_len")  # what the router reads of a card


def _read(cards: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    return {k: tuple(c.get(f) for f in READ) for k, c in cards.items()}


class ModelLists:
    def __init__(
        self,
        registry: Registry,
        options: ListOptions | None = None,
        access: EngineAccess | None = None,
    ) -> None:
        self.registry = registry
        self.options = options or ListOptions()
        self.access = access or EngineAccess()
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.Task[None] | None = None
        self._reading: dict[str, asyncio.Task[bool]] = {}  # by worker id: one read at a time
        self._asked: dict[str, float] = {}  # by worker id: when a read was last asked for
        self.reads = 0  # lists read, for the tests and the curious

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            key_of = keys(self.registry.workers.values, self.access)
            timeout = aiohttp.ClientTimeout(total=self.options.timeout)
            self._session = self.access.session(key_of, timeout=timeout)
        return self._session

    async def start(self) -> None:
        if self.options.interval > 0:
            self._loop = asyncio.create_task(self._every(), name="model-lists")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._reading.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reading.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def relist(self, worker: Worker) -> None:
        """``worker``'s engine said it does not serve what a request asked for: read its
        list again soon (now, unless it was asked for less than ``spacing`` s ago)."""
        now = time.monotonic()
        if now - self._asked.get(worker.id, -self.options.spacing) < self.options.spacing:
            return
        self._asked[worker.id] = now
        self.read(worker)

    def read(self, worker: Worker) -> asyncio.Task[bool]:
        """Read ``worker``'s list (joining a read under way); the task says whether it
        changed."""
        task = self._reading.get(worker.id)
        if task is None:
            task = asyncio.create_task(self._read(worker), name=f"models-{worker.id}")
            self._reading[worker.id] = task
            task.add_done_callback(lambda _: self._reading.pop(worker.id, None))
        return task

    async def read_all(self) -> None:
        """Every ready worker's list, all at once."""
        ready = [w for w in self.registry.workers.values() if w.ready]
        await asyncio.gather(*(self.read(w) for w in ready), return_exceptions=True)

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self.options.interval)
            await self.read_all()

    async def _read(self, worker: Worker) -> bool:
        try:
            async with asyncio.timeout(self.options.timeout):
                cards = await probe.models(self.session, worker.url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("models of %s unavailable: %s", worker.id, exc)
            return False
        self.reads += 1
        gone = worker.id not in self.registry.workers or not worker.ready
        if not cards or gone:  # nothing said, or the worker left while it was read
            return False
        before = set(worker.models)
        news = served(self.registry, worker, cards)
        if news:
            now = set(worker.models)
            log.info(
                "worker %s lists models again: +%s -%s",
                worker.id,
                sorted(now - before) or "none",
                sorted(before - now) or "none",
            )
        return news
