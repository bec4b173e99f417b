"""The control plane of ``--processes N``: what runs once, in the parent.

Discovery, health checks, load scraping, breakers, MoRIIO registrations, the
admin API and the placement of new routing keys run here, on the one
registry that hands out board slots. The serving processes follow it over a
Unix socket (``follower``): they read a stream of whole states (the
membership, each target's slot and breaker) and send back what they saw
(failed attempts, refused connections). Load needs no message: it is on the
shared board.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from dprouter.config import RouterConfig, sources
from dprouter.core.errors import error
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.membership.moriio import Registration
from dprouter.fleet.model_lists import ModelLists
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import RequestInfo
from dprouter.policies.manual import Manual
from dprouter.proxy.response_ids import ResponseIds
from dprouter.proxy.routing_keys import Claims, claims
from dprouter.server.admin import Admin
from dprouter.server.identity import Identity

log = logging.getLogger("dprouter.control")

# -- the protocol: HTTP over the parent's Unix socket -----------------------------------
BASE = "http://control"  # the host is ignored: the connector dials the Unix socket
STATE = "/control/state"  # GET ?row=R: a state now, one after each change, and SEEN lines
EVENTS = "/control/events"  # POST a batch of events: [{"kind": ..., ...}]
PLACE = "/control/place"  # POST {"key", "slots", "role"} -> {"slot"}: where a key goes
RESPONSES = "/control/responses"  # POST {"id", "label"}; GET /ID -> {"label"}
DASHBOARD = "/control/dashboard"  # GET -> {"sessions", "started"}
# the admin API's own paths (/workers...) are relayed to the parent as they come
# events a serving process sends, and what each carries besides its kind
LISTENING = "listening"  # "row": it listens on the port
SUSPECT = "suspect"  # "worker": it refused a connection
RELIST = "relist"  # "worker": its engine said it does not serve a model asked of it
FAILED, SUCCEEDED = "failed", "succeeded"  # "slot": an attempt's outcome, for the breakers
REST = "rest"  # "slot", "seconds": the engine asked for a pause (Retry-After)
SEEN = "seen"  # "row", "slot", "blocks": cache_aware sent a prompt's blocks there
VERSION = "version"  # "worker", "version", "asked": an answer stated the weights' version
VERSIONS = "versions"  # read the workers' weights versions now (a request waits for one)
# what a serving process needs to know of a worker, besides its targets
WORKER_FIELDS = (
    "id",
    "url",
    "role",
    "dialect",
    "dp_size",
    "rank_offset",
    "model",
    "bootstrap_port",
    "tp_size",
    "zmq_address",
    "transfer_mode",
    "kv_events",
    "kv_replay",
    "api_key",  # over the parent's Unix socket only
    "admin_key",
    "ranks",
    "dp_attention",
    "models",
    "cards",
    "state",
    "error",
    "held",
    "weight_version",
    "version_since",
    "slot",
)


def encode(registry: Registry, breakers: Breakers) -> bytes:
    """The whole membership as one JSON line: level-triggered, so a follower that
    missed a change loses nothing by reading the next state."""

    def worker(w: Worker) -> dict[str, Any]:
        found = {name: getattr(w, name) for name in WORKER_FIELDS}
        found["targets"] = [
            [t.rank, t.slot, t.tripped, breakers.failures(t) > 0] for t in w.targets
        ]
        return found

    workers = [worker(w) for w in registry.workers.values()]
    return orjson.dumps({"workers": workers, "stale": registry.stale}) + b"\n"


def apply(registry: Registry, state: dict[str, Any]) -> None:
    """Make ``registry`` what the parent's is. Worker and target objects are kept while
    their slots are (policies hold on to targets: a sticky key must not see a new one)."""
    workers: dict[str, Worker] = {}
    registry.stale = state.get("stale", False)
    for found in state["workers"]:
        worker = registry.workers.get(found["id"])
        if worker is None or worker.slot != found["slot"]:
            worker = Worker(id=found["id"], url=found["url"], board=registry.board)
        for name in WORKER_FIELDS:
            value = found[name]
            setattr(worker, name, tuple(value) if name == "models" else value)
        have = {t.slot: t for t in worker.targets}
        targets = []
        for rank, slot, tripped, _ in found["targets"]:
            target = have.get(slot) or Target(worker, rank, registry.board, slot)
            target.tripped = tripped
            targets.append(target)
        worker.targets = targets
        workers[worker.id] = worker
    registry.workers = workers
    registry.rebuild()


class ControlPlane:
    def __init__(
        self, config: RouterConfig, registry: Registry, monitor: Monitor, breakers: Breakers
    ) -> None:
        self.config = config
        self.registry = registry
        self.monitor = monitor
        self.breakers = breakers
        # manual's key tables live here (one per role), so a key sticks whichever process
        # serves it
        self.sessions: dict[str, Manual] = {}
        self.responses = ResponseIds()  # Responses API ids -> target labels, from every process
        self._claims: dict[str, Claims | None] = {}  # under etcd discovery, by role
        self.registration: Registration | None = None
        self.sources = sources(config, registry, monitor)  # of workers: etcd
        # the engines' model lists, read again while they run (adapters loaded at them)
        self.lists = ModelLists(registry, config.list_options(), config.engine_access())
        self.listening: set[int] = set()  # rows of the serving processes that listen
        self.joined = asyncio.Event()  # set when one more starts listening
        self.started = time.time()  # the router's start, for the dashboard's uptime
        self.forwarded = 0  # batches of cache_aware's prefixes passed between processes
        self._reads: set[asyncio.Task[None]] = set()  # versions read for a serving process
        self._followers: dict[int, asyncio.Queue[bytes | None]] = {}  # by row; None: a state
        self._due: set[int] = set()  # rows with a state queued already
        registry.listeners.append(self.changed)
        # the serving processes check where each admin call came from; the credential
        # (token, admin key, JWT), here; the open data plane is said here, once
        self.identity = Identity.of(config)
        self.admin = Admin(config, registry, monitor, self.sources, True, self.identity)
        self.app = web.Application(client_max_size=config.max_body)
        self.app.add_routes(
            [
                web.get(STATE, self.state),
                web.post(EVENTS, self.events),
                web.post(PLACE, self.place),
                web.post(RESPONSES, self.response_noted),
                web.get(RESPONSES + "/{id}", self.response_found),
                web.get(DASHBOARD, self.dashboard),
                *self.admin.routes(),
            ]
        )
        self.app.on_cleanup.append(lambda _: self.admin.close())
        self._runner: web.AppRunner | None = None

    def changed(self) -> None:
        """Every follower gets the new state (once, however many changes came meanwhile)."""
        for row, queue in self._followers.items():
            if row not in self._due:
                self._due.add(row)
                queue.put_nowait(None)

    async def start(self, path: str) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.UnixSite(self._runner, path).start()
        self.identity.start()
        if self.config.pd == "vllm-moriio":
            self.registration = Registration(
                self.registry,
                self.config.registration,
                self.config.heartbeat_timeout,
                self.monitor.forget,
            )
            await self.registration.start()
        for source in self.sources:
            await source.start()
        await self.monitor.start()
        await self.lists.start()

    async def stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        for source in self.sources:
            await source.stop()
        await self.monitor.stop()
        await self.lists.stop()
        self.breakers.stop()
        await self.identity.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def state(self, request: web.Request) -> web.StreamResponse:
        """A state now, then one after every change, for as long as the follower reads;
        between them, what the other processes' ``cache_aware`` sent where."""
        row = int(request.query["row"])
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._followers[row] = queue
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            await response.write(encode(self.registry, self.breakers))
            while True:
                line = await queue.get()
                if line is None:
                    self._due.discard(row)
                    line = encode(self.registry, self.breakers)
                await response.write(line)
        finally:
            if self._followers.get(row) is queue:
                del self._followers[row]
                self._due.discard(row)

    async def events(self, request: web.Request) -> web.Response:
        by_slot = {t.slot: t for t in self.registry.targets()}
        failed = False
        seen: list[list[Any]] = []
        for event in orjson.loads(await request.read()):
            kind = event["kind"]
            if kind == SEEN:
                seen.append([event["row"], event["slot"], event["blocks"]])
                continue
            if kind == LISTENING:
                self.listening.add(int(event["row"]))
                self.joined.set()
                continue
            if kind in (SUSPECT, RELIST):
                worker = self.registry.workers.get(event["worker"])
                if worker is not None and kind == SUSPECT:
                    self.monitor.suspect(worker)
                elif worker is not None:
                    self.lists.relist(worker)
                continue
            if kind == VERSION:
                worker = self.registry.workers.get(event["worker"])
                if worker is not None:
                    self.monitor.stated(worker, event["version"], event["asked"])
                continue
            if kind == VERSIONS:  # not awaited: the events' post answers at once
                read = asyncio.create_task(self.monitor.read_versions())
                self._reads.add(read)
                read.add_done_callback(self._reads.discard)
                continue
            target: Target | None = by_slot.get(event["slot"])
            if target is None:
                continue  # its worker left meanwhile
            if kind == FAILED:
                failed = True
                self.breakers.failed(target)
            elif kind == SUCCEEDED:
                self.breakers.succeeded(target)
            elif kind == REST:
                self.breakers.rest(target, float(event["seconds"]))
        if failed:
            self.changed()  # followers learn which targets are failing: a success resets them
        if seen:
            self._forward(seen)
        return web.json_response({})

    def _forward(self, seen: list[list[Any]]) -> None:
        """To every other serving process: where prompts went, so that each process's
        ``cache_aware`` knows what all of them sent (a batch comes from one process)."""
        row = seen[0][0]
        line = orjson.dumps({SEEN: [[slot, blocks] for _, slot, blocks in seen]}) + b"\n"
        for other, queue in self._followers.items():
            if other != row:
                queue.put_nowait(line)
        self.forwarded += 1

    async def place(self, request: web.Request) -> web.Response:
        """Where a routing key goes: where it went before, or placed now, over the
        candidates the serving process names (by slot)."""
        asked = orjson.loads(await request.read())
        by_slot = {t.slot: t for t in self.registry.targets()}
        candidates = [t for s in asked["slots"] if (t := by_slot.get(s)) is not None]
        if not candidates:
            return error(409, "none of those targets is known")
        now = asyncio.get_running_loop().time()
        role = asked.get("role", "regular")
        if role not in ("regular", "prefill", "decode"):
            return error(400, f"no role {role!r}")
        sessions = self.sessions.get(role)
        if sessions is None:
            sessions = self.sessions[role] = Manual(self.config.policy_options())
            self._claims[role] = claims(self.sources, sessions, role)
            if self._claims[role] is not None:
                sessions.bound = 0  # a claim in etcd holds the key: moving it is left undone
        info = RequestInfo(key=asked["key"], now=now)
        if (claimed := self._claims[role]) is not None:  # several replicas: claimed in etcd
            await claimed.place(candidates, info)
        target = sessions.select(candidates, info)
        return web.json_response({"slot": target.slot})

    async def response_noted(self, request: web.Request) -> web.Response:
        said = orjson.loads(await request.read())
        self.responses.put(str(said["id"]), str(said["label"]))
        return web.Response(status=204)

    async def response_found(self, request: web.Request) -> web.Response:
        label = self.responses.get(request.match_info["id"])
        if label is None:
            return error(404, "unknown response id")
        return web.json_response({"label": label})

    async def dashboard(self, _: web.Request) -> web.Response:
        """For the dashboard of any serving process: what only the parent knows."""
        held = sum(len(m.sticky) for m in self.sessions.values())
        return web.json_response({"sessions": held, "started": self.started})
