"""A serving process's link to the control plane of ``--processes N``: it follows.

``Channel`` is the Unix-socket link to the parent. ``Follower`` stands where a
``Monitor`` stands in one process: it applies each state the parent streams to
a registry of its own (same slots, so the board's counts line up) and passes
refused connections up. ``SharedBreakers`` passes attempts' outcomes up; the
parent decides and the next state says which targets are out. ``AdminRelay``
passes admin calls to the parent's admin API, ``Placer`` asks it where a new
routing key goes, ``SharedResponseIds`` where a stored response is. ``ControlLink``
hands them to the router (``server.parts.Control``). The protocol: ``control``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from dprouter.config import RouterConfig
from dprouter.core.errors import error
from dprouter.core.headers import HOP_BY_HOP, without
from dprouter.core.types import Role
from dprouter.fleet.breakers import BreakerOptions, Breakers
from dprouter.fleet.monitor import FRESH, Monitor
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.multiproc.control import (
    BASE,
    DASHBOARD,
    EVENTS,
    FAILED,
    PLACE,
    RELIST,
    RESPONSES,
    REST,
    SEEN,
    STATE,
    SUCCEEDED,
    SUSPECT,
    VERSION,
    VERSIONS,
    apply,
)
from dprouter.policies import RequestInfo, affinity_key
from dprouter.policies.cache_aware import CacheAware
from dprouter.policies.manual import Manual
from dprouter.proxy.response_ids import ResponseIds
from dprouter.proxy.routing_keys import Places
from dprouter.server.admin import ADMIN_ROUTES
from dprouter.server.commands import UPDATE_TIMEOUT
from dprouter.server.identity import Identity

log = logging.getLogger("dprouter.follower")
HOP = HOP_BY_HOP | {"date", "server"}  # the relay's own say these


class Channel:
    def __init__(self, path: str) -> None:
        self.path = path
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=path),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        self._queue: list[dict[str, Any]] = []
        self._flush: asyncio.Task[None] | None = None

    def send(self, event: dict[str, Any]) -> None:
        """Queued, and sent in one batch with the others of this loop turn (or, if a batch
        is being posted, with the others queued meanwhile, as soon as it is)."""
        self._queue.append(event)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        await asyncio.sleep(0)
        while self._queue:  # what was queued during a post goes next
            batch, self._queue = self._queue, []
            try:
                async with self.session.post(BASE + EVENTS, data=orjson.dumps(batch)) as r:
                    await r.read()
            except aiohttp.ClientError as exc:
                log.warning("control plane unreachable (%s): %d event(s) lost", exc, len(batch))

    async def close(self) -> None:
        if self._flush is not None:
            await asyncio.gather(self._flush, return_exceptions=True)
        await self.session.close()


class Follower(Monitor):
    """Discovery, scraping and health checks happen in the parent; this follows."""

    def __init__(self, registry: Registry, channel: Channel, row: int) -> None:
        super().__init__(registry)
        self.channel = channel
        self.row = row
        self.failing: set[int] = set()  # slots the parent counts failures for
        # another process's cache_aware sent these blocks to this target
        self.on_seen: Callable[[Target, list[int]], None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._slots: tuple[int, dict[int, Target]] = (-1, {})  # by snapshot version
        self._asked = -1e9  # when the parent was last asked to read the versions

    async def start(self) -> None:
        first = asyncio.get_running_loop().create_future()
        self._follow = asyncio.create_task(self._read(first), name="follow")
        await first  # the first state is in before the process listens

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)

    def watch(self, worker: Worker) -> None:
        """Discovery is the parent's."""

    def suspect(self, worker: Worker) -> None:
        if worker.ready:
            self.channel.send({"kind": SUSPECT, "worker": worker.id})

    def stated(self, worker: Worker, version: str, asked: float) -> None:
        """Taken here at once, and by the parent for every process (one clock: monotonic
        time is the machine's, whichever process reads it)."""
        if version != worker.weight_version and asked >= worker.version_since:
            self.registry.set_weight_version(worker, version)
            event = {"kind": VERSION, "worker": worker.id, "version": version, "asked": asked}
            self.channel.send(event)

    async def read_versions(self) -> None:
        """The parent reads them; its next state brings them."""
        if time.monotonic() - self._asked >= FRESH:
            self._asked = time.monotonic()
            self.channel.send({"kind": VERSIONS})

    async def _read(self, first: asyncio.Future[None]) -> None:
        try:
            url = f"{BASE}{STATE}?row={self.row}"
            async with self.channel.session.get(url) as r:
                async for line in r.content:
                    state = orjson.loads(line)
                    if SEEN in state:
                        self._seen(state[SEEN])
                        continue
                    apply(self.registry, state)
                    self.failing = {t[1] for w in state["workers"] for t in w["targets"] if t[3]}
                    self.changed.set()
                    if not first.done():
                        first.set_result(None)
        except aiohttp.ClientError as exc:
            if not first.done():
                first.set_exception(exc)
                return
        # the parent is gone: a serving process does not outlive its control plane
        log.error("control plane gone: stopping this serving process")
        os.kill(os.getpid(), signal.SIGTERM)

    def _seen(self, seen: list[list[Any]]) -> None:
        if self.on_seen is None:
            return
        snapshot = self.registry.snapshot
        if self._slots[0] != snapshot.version:
            self._slots = (snapshot.version, {t.slot: t for t in snapshot.pool()})
        by_slot = self._slots[1]
        for slot, blocks in seen:
            target = by_slot.get(slot)
            if target is not None:
                self.on_seen(target, blocks)


class SharedBreakers(Breakers):
    """Outcomes go to the parent's breakers; which targets are out comes back in the state."""

    def __init__(self, follower: Follower) -> None:
        super().__init__(follower.registry)
        self.follower = follower

    def failures(self, target: Target) -> int:
        return 1 if target.slot in self.follower.failing else 0

    def succeeded(self, target: Target) -> None:
        failing = self.follower.failing
        if failing and target.slot in failing:  # the common case costs one test
            failing.discard(target.slot)
            self.follower.channel.send({"kind": SUCCEEDED, "slot": target.slot})

    def failed(self, target: Target) -> None:
        if self.options.failures > 0 and not target.tripped:
            self.follower.failing.add(target.slot)
            self.follower.channel.send({"kind": FAILED, "slot": target.slot})

    def rest(self, target: Target, seconds: float) -> None:
        if not target.tripped:
            self.follower.channel.send({"kind": REST, "slot": target.slot, "seconds": seconds})


class AdminRelay:
    """The admin API as the parent runs it: a worker added through any serving process
    is added once, for all of them, and an engine command holds the workers for all.
    Where a call came from is checked here, when no admin credential is configured (the
    parent sees only this process); a credential is checked by the parent, which runs the
    call. Only the ``Authorization`` header goes up, over the parent's Unix socket."""

    def __init__(self, channel: Channel, identity: Identity) -> None:
        self.channel = channel
        self.identity = identity

    def routes(self) -> list[web.RouteDef]:
        return [web.route(method, path, self.relay) for method, path in ADMIN_ROUTES]

    async def relay(self, request: web.Request) -> web.Response:
        if self.identity.open_admin() and (refused := await self.identity.admin(request)):
            return refused
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            async with self.channel.session.request(
                request.method,
                URL(BASE + request.raw_path, encoded=True),  # a quoted URL as an id stays so
                data=await request.read(),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=UPDATE_TIMEOUT + 30),
            ) as r:
                body = await r.read()
                return web.Response(status=r.status, body=body, headers=without(r.headers, HOP))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error(503, f"the router's control plane did not answer ({exc})")


class Placer:
    def __init__(self, channel: Channel, policy: Manual, role: Role = "regular") -> None:
        self.channel = channel
        self.policy = policy
        self.role = role  # P/D: each role has its own table (a key has a prefill and a decode)
        self.fresh = min(1.0, policy.ttl / 2)
        self._asked: dict[str, float] = {}

    async def place(self, targets: Sequence[Target], info: RequestInfo) -> None:
        key = affinity_key(info)  # as the policy keeps it: per adapter
        if key is None:
            return
        held = self.policy.sticky.get(key)
        if held is not None and held[0] in targets and info.now - self._asked[key] < self.fresh:
            return
        asked = {"key": key, "slots": [t.slot for t in targets], "role": self.role}
        async with self.channel.session.post(BASE + PLACE, data=orjson.dumps(asked)) as r:
            if r.status != 200:
                return  # the local table decides this once
            slot = orjson.loads(await r.read())["slot"]
        chosen = next((t for t in targets if t.slot == slot), None)
        if chosen is not None:
            if held is not None:
                self.policy.count(held[0], -1)
            self.policy.count(chosen, 1)
            self.policy.sticky[key] = (chosen, info.now)
            self._asked[key] = info.now
            if len(self._asked) > 2 * max(len(self.policy.sticky), 1024):
                self._asked = {k: v for k, v in self._asked.items() if k in self.policy.sticky}


class SharedResponseIds(ResponseIds):
    """Under ``--processes N``: the ids live in the control plane too, so a follow-up
    that lands on another serving process finds its target there."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel

    async def note(self, rid: str, label: str) -> None:
        self.put(rid, label)
        said = orjson.dumps({"id": rid, "label": label})
        try:
            async with self.channel.session.post(BASE + RESPONSES, data=said) as r:
                await r.read()
        except aiohttp.ClientError:
            pass  # this process still knows it

    async def find(self, rid: str) -> str | None:
        label = self.get(rid)
        if label is not None:
            return label
        try:
            async with self.channel.session.get(BASE + RESPONSES + "/" + rid) as r:
                if r.status != 200:
                    return None
                label = str(orjson.loads(await r.read())["label"])
        except aiohttp.ClientError:
            return None
        self.put(rid, label)
        return label


class ControlLink:
    """A serving process's side of the control plane, as the router it serves takes it
    (``server.parts.Control``)."""

    def __init__(
        self, channel: Channel, follower: Follower, config: RouterConfig, processes: int
    ) -> None:
        self.channel = channel
        self.config = config
        self.follower = follower
        self.processes = processes

    def breakers(self, options: BreakerOptions) -> Breakers:
        breakers = SharedBreakers(self.follower)
        breakers.options = options
        return breakers

    def admin_routes(self) -> list[web.RouteDef]:
        # its own view of the credentials, only to know whether callers are placed by address
        return AdminRelay(self.channel, Identity.of(self.config, warn=False)).routes()

    def response_ids(self) -> ResponseIds:
        return SharedResponseIds(self.channel)

    def placer(self, policy: Manual, role: Role) -> Places:
        return Placer(self.channel, policy, role)

    def relist(self, worker: Worker) -> None:
        """The parent reads the worker's model list again; its state brings the news."""
        self.channel.send({"kind": RELIST, "worker": worker.id})

    def share_prefixes(self, policy: CacheAware) -> None:
        """Each ``cache_aware`` knows where all the serving processes sent what."""
        row, channel = self.follower.row, self.channel

        def tell(target: Target, blocks: list[int]) -> None:
            channel.send({"kind": SEEN, "row": row, "slot": target.slot, "blocks": blocks})

        policy.tell = tell
        self.follower.on_seen = policy.learn

    async def held(self) -> tuple[int, float] | None:
        """Routing keys held, and when the router started: the parent holds the keys'
        table and outlives any serving process (None: it did not say)."""
        try:
            async with self.channel.session.get(BASE + DASHBOARD) as r:
                said = orjson.loads(await r.read())
            return int(said["sessions"]), float(said["started"])
        except (aiohttp.ClientError, KeyError, orjson.JSONDecodeError):
            return None
