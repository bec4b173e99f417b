"""Engine commands: what an RL framework sends its engines around a weight update
(pause, flush, update, version, continue, abort), sent through the router to every
engine once -- per worker, not per rank: a rank has no HTTP server of its own -- all at
once, each call bounded by a timeout. The answer lists every worker's status and body;
200 only when every worker succeeded.

The router keeps what the commands say: a paused, updating or sleeping worker is held
(``Registry.hold``: no new request while another can serve it, ``proxy/pools``), and a
worker's weights' version is what the last update said. Both go through ``Standings``
(``fleet/standing.py``): this router's, or, under etcd discovery, every replica's
(``membership/etcd_holds.py``). One weight update at a time: a second, while the first
is in flight, is refused with 409.

The table names each command by its SGLang path where SGLang has one (the RL frameworks
speak SGLang) and says what each engine kind calls it; vLLM's own paths are commands
too. Behind the admin role (``Identity.admin``, server/identity.py); under
``--processes N`` the parent runs them, so every serving process sees the same holds
(``control_link.AdminRelay``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web

from dprouter.core.errors import error, error_body
from dprouter.core.tls import EngineAccess
from dprouter.core.types import DialectName
from dprouter.fleet import probe
from dprouter.fleet.membership.labels import matches, parse_selector
from dprouter.fleet.model_lists import served
from dprouter.fleet.registry import Registry
from dprouter.fleet.standing import Standings
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import keys, own_key
from dprouter.proxy.rankless import ask
from dprouter.server import adapter_answers

# what a command does to the router's view of a worker, once its engine said yes
Effect = Literal[
    "pause", "resume", "begin", "update", "finish", "version", "sleep", "wake", "adapters"
]
# a body in the shape the command came in (SGLang's), out in the engine's: (query, body)
Translate = Callable[[dict[str, Any]], tuple[dict[str, str], dict[str, Any] | None]]
UPDATE_TIMEOUT = 600.0  # weights from disk, or over NCCL: minutes at most
CALL_TIMEOUT = 60.0  # anything else
# seconds a pause or an update waits for the other replicas to be told of its hold before
# the engines are asked (etcd away: it goes ahead, held here)
TELL_REPLICAS = 1.0


@dataclass(frozen=True)
class EngineCall:
    path: str
    method: str | None = None  # None: the client's
    translate: Translate | None = None  # None: the body as it came
    admin: bool = False  # SGLang's admin endpoint: its --admin-api-key, where it has one


# SGLang's admin endpoints among the commands (0.5.23: "admin optional"): with
# --admin-api-key they take that key alone, and its other endpoints never take it
SGLANG_ADMIN = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)


@dataclass(frozen=True)
class Command:
    path: str
    methods: tuple[str, ...]
    calls: Mapping[DialectName, EngineCall]
    summary: str
    effect: Effect | None = None
    exclusive: bool = False  # part of a weight update: one at a time
    reads_version: bool = False  # the answer's ``weight_version`` is the worker's

    @property
    def timeout(self) -> float:
        return UPDATE_TIMEOUT if self.exclusive else CALL_TIMEOUT


# SGLang's pause modes in vLLM's words: retract and in_place both keep the requests,
# which go on after the resume
VLLM_PAUSE = {"abort": "abort", "retract": "keep", "in_place": "keep"}


def _vllm_pause(body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any] | None]:
    mode = body.get("mode", "abort")
    if not isinstance(mode, str):
        raise ValueError(f"mode must be a string, got {mode!r}")
    return {"mode": VLLM_PAUSE.get(mode, mode)}, None


def _vllm_abort(body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any] | None]:
    rid = body.get("rid")
    if body.get("abort_all") or not rid:
        return {}, {}  # vLLM: no ids aborts everything in flight
    return {}, {"request_ids": rid if isinstance(rid, list) else [rid]}


def _sglang(path: str, **kw: Any) -> dict[DialectName, EngineCall]:
    return {"sglang": EngineCall(path, admin=path in SGLANG_ADMIN, **kw)}


def _vllm(path: str, **kw: Any) -> dict[DialectName, EngineCall]:
    return {"vllm": EngineCall(path, **kw)}


POST: tuple[str, ...] = ("POST",)
GET: tuple[str, ...] = ("GET",)
BOTH: tuple[str, ...] = ("GET", "POST")

COMMANDS: tuple[Command, ...] = (
    Command(
        "/pause_generation",
        POST,
        {**_sglang("/pause_generation"), **_vllm("/pause", translate=_vllm_pause)},
        "Pause every engine (mode abort, retract or in_place)",
        effect="pause",
    ),
    Command(
        "/continue_generation",
        POST,
        {**_sglang("/continue_generation"), **_vllm("/resume", translate=lambda b: ({}, {}))},
        "Continue every engine",
        effect="resume",
    ),
    Command(
        "/abort_request",
        POST,
        {**_sglang("/abort_request"), **_vllm("/abort_requests", translate=_vllm_abort)},
        "Abort requests on every engine: all, by rid, by rid prefix",
    ),
    Command(
        "/flush_cache",
        BOTH,
        {**_sglang("/flush_cache"), **_vllm("/reset_prefix_cache", method="POST")},
        "Flush every engine's prefix cache",
    ),
    Command(
        "/update_weights_from_disk",
        POST,
        _sglang("/update_weights_from_disk"),
        "Load new weights from disk on every engine",
        effect="update",
        exclusive=True,
    ),
    Command(
        "/update_weights_from_distributed",
        POST,
        _sglang("/update_weights_from_distributed"),
        "Receive a bucket of weights over the update group",
        effect="update",
        exclusive=True,
    ),
    Command(
        "/update_weights_from_tensor",
        POST,
        _sglang("/update_weights_from_tensor"),
        "Load weights from tensors",
        effect="update",
        exclusive=True,
    ),
    Command(
        "/init_weights_update_group",
        POST,
        _sglang("/init_weights_update_group"),
        "Join the weights' update group",
        exclusive=True,
    ),
    Command(
        "/destroy_weights_update_group",
        POST,
        _sglang("/destroy_weights_update_group"),
        "Leave the weights' update group",
        exclusive=True,
    ),
    Command(
        "/begin_weight_update",
        POST,
        _sglang("/begin_weight_update"),
        "Open a weight-update session",
        effect="begin",
        exclusive=True,
    ),
    Command(
        "/end_weight_update",
        POST,
        _sglang("/end_weight_update"),
        "Close the weight-update session",
        effect="finish",
        exclusive=True,
    ),
    Command(
        "/update_weight_version",
        POST,
        {**_sglang("/update_weight_version"), **_vllm("/update_weight_version")},
        "Set every engine's weights' version",
        effect="version",
        exclusive=True,
    ),
    Command(
        "/get_weight_version",
        GET,
        {**_sglang("/model_info"), **_vllm("/weight_info")},
        "Every engine's weights' version",
        reads_version=True,
    ),
    Command(
        "/release_memory_occupation",
        BOTH,
        {**_sglang("/release_memory_occupation"), **_vllm("/sleep", method="POST")},
        "Release every engine's GPU memory (sleep)",
        effect="sleep",
    ),
    Command(
        "/resume_memory_occupation",
        BOTH,
        {**_sglang("/resume_memory_occupation"), **_vllm("/wake_up", method="POST")},
        "Take the GPU memory back (wake up)",
        effect="wake",
    ),
    # LoRA adapters loaded while the engines run (vLLM's with VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    # the router reads each engine's /v1/models again after, so an adapter's requests go
    # where it is loaded from the next request on
    Command(
        "/load_lora_adapter",
        POST,
        {**_sglang("/load_lora_adapter"), **_vllm("/v1/load_lora_adapter")},
        "Load a LoRA adapter on every engine",
        effect="adapters",
    ),
    Command(
        "/unload_lora_adapter",
        POST,
        {**_sglang("/unload_lora_adapter"), **_vllm("/v1/unload_lora_adapter")},
        "Unload a LoRA adapter from every engine",
        effect="adapters",
    ),
    Command("/v1/loads", GET, _sglang("/v1/loads"), "Every SGLang engine's load, per rank"),
    # vLLM's own names (its RL routes need VLLM_SERVER_DEV_MODE=1)
    Command("/pause", POST, _vllm("/pause"), "Pause every vLLM engine", effect="pause"),
    Command("/resume", POST, _vllm("/resume"), "Resume every vLLM engine", effect="resume"),
    Command("/is_paused", GET, _vllm("/is_paused"), "Whether each vLLM engine is paused"),
    Command("/abort_requests", POST, _vllm("/abort_requests"), "Abort on every vLLM engine"),
    Command("/reset_prefix_cache", POST, _vllm("/reset_prefix_cache"), "Reset each prefix cache"),
    Command("/sleep", POST, _vllm("/sleep"), "Put every vLLM engine to sleep", effect="sleep"),
    Command("/wake_up", POST, _vllm("/wake_up"), "Wake every vLLM engine", effect="wake"),
    Command("/is_sleeping", GET, _vllm("/is_sleeping"), "Whether each vLLM engine sleeps"),
    Command(
        "/v1/load_lora_adapter",
        POST,
        _vllm("/v1/load_lora_adapter"),
        "Load a LoRA adapter on every vLLM engine",
        effect="adapters",
    ),
    Command(
        "/v1/unload_lora_adapter",
        POST,
        _vllm("/v1/unload_lora_adapter"),
        "Unload a LoRA adapter from every vLLM engine",
        effect="adapters",
    ),
    Command(
        "/init_weight_transfer_engine",
        POST,
        _vllm("/init_weight_transfer_engine"),
        "Start vLLM's weight transfer",
        exclusive=True,
    ),
    Command(
        "/shutdown_weight_transfer_engine",
        POST,
        _vllm("/shutdown_weight_transfer_engine"),
        "Stop vLLM's weight transfer",
        exclusive=True,
    ),
    Command(
        "/start_weight_update",
        POST,
        _vllm("/start_weight_update"),
        "Begin a vLLM weight update",
        effect="begin",
        exclusive=True,
    ),
    Command(
        "/update_weights",
        POST,
        _vllm("/update_weights"),
        "Send vLLM a bucket of weights",
        effect="update",
        exclusive=True,
    ),
    Command(
        "/finish_weight_update",
        POST,
        _vllm("/finish_weight_update"),
        "End a vLLM weight update",
        effect="finish",
        exclusive=True,
    ),
    Command(
        "/weight_info",
        GET,
        _vllm("/weight_info"),
        "Every vLLM engine's weights' version",
        reads_version=True,
    ),
)

# what each engine kind can do, for the RL listing (``GET /v1/rl/workers``)
CAPABILITIES: dict[DialectName, dict[str, Any]] = {
    "sglang": {
        "pause_modes": ["abort", "retract", "in_place"],
        "update_from": ["disk", "tensor", "distributed"],
        "abort": True,
        "flush_cache": True,
        "sleep_wake": True,
        "reports_weight_version": True,
    },
    "vllm": {
        "pause_modes": ["abort", "keep", "wait"],
        "update_from": ["transfer_engine"],
        "abort": True,
        "flush_cache": True,
        "sleep_wake": True,
        "reports_weight_version": True,
    },
}


@dataclass
class Update:
    """A weight update in flight: one at a time on each worker."""

    path: str
    since: float = field(default_factory=time.monotonic)


class Commands:
    """The commands' handlers. Each call goes to the engine with its own session, so a
    weight update is never queued behind generation's connections."""

    def __init__(
        self,
        registry: Registry,
        access: EngineAccess | None = None,
        standings: Standings | None = None,
    ) -> None:
        self.registry = registry
        self.access = access or EngineAccess()  # the engines' TLS context and keys
        # holds and versions: this router's own, or (etcd) shared with every replica
        self.standings = standings or Standings(registry)
        self.updates: dict[str, Update] = {}  # in flight, by worker id
        self._session: aiohttp.ClientSession | None = None

    def handler(self, command: Command) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return await self.run(command, request)

        return handle

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            key_of = keys(self.registry.workers.values, self.access)
            self._session = self.access.session(key_of, auto_decompress=False)
        return self._session

    async def run(self, command: Command, request: web.Request, smg: bool = False) -> web.Response:
        """``smg``: answer in smg's ``/v1/rl/engine`` shape, to the workers its
        ``selector`` (or the path's worker id) names."""
        raw = await request.read()
        body: dict[str, Any] = {}
        if raw:
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return error(400, "the body must be JSON")
            if not isinstance(parsed, dict):
                return error(400, "the body must be a JSON object")
            body = parsed
        workers = self.registry.ready()
        named = request.match_info.get("worker_id") or request.query.get("worker")
        if smg and named is None:
            try:
                selector = parse_selector(request.query.get("selector", ""))
            except ValueError as exc:
                return error(400, f"{exc} (keys: {', '.join(SELECTOR_KEYS)})", "selector")
            workers = [w for w in workers if matches(selector, _labels(w))]
            if not workers:
                return error(404, "no ready worker matches the selector", "selector")
        if named is not None:
            workers = [w for w in workers if w.id == named]
            if not workers:
                return error(404, f"no ready worker {named!r}", "worker")
        if not workers:
            return error(503, "no ready worker to send it to")
        # each engine kind that has it; a mixed fleet's others are not asked
        workers = [w for w in workers if w.dialect in command.calls]
        if not workers:
            kinds = " or ".join(sorted(command.calls))
            return error(404, f"{command.path} is {kinds}'s; no such worker is ready")
        if command.exclusive:
            busy = next((w for w in workers if w.id in self.updates), None)
            if busy is not None:
                update = self.updates[busy.id]
                ago = time.monotonic() - update.since
                return error(
                    409,
                    f"a weight update is in flight on {busy.id} ({update.path}, {ago:.1f} s): "
                    "one at a time; retry when it ends",
                )
            for w in workers:
                self.updates[w.id] = Update(command.path)
        # its own task: a client that leaves does not stop it half-way, and what the
        # engines said is applied (holds released, versions kept) whatever the client does
        fan = asyncio.create_task(self._fan(command, request, workers, raw, body))
        rows = await asyncio.shield(fan)
        if smg:
            return _smg_answer(rows, single=request.match_info.get("worker_id") is not None)
        if command.effect == "adapters":  # a partial fan-out says what it did
            return adapter_answers.answer(command.path, rows, body)
        return _answer(command, rows)

    async def smg(self, request: web.Request) -> web.Response:
        """smg's RL fan-out: ``/v1/rl/engine/{path}?selector=k=v`` and
        ``/v1/rl/workers/{id}/engine/{path}``, for the commands of the table."""
        path = "/" + request.match_info["path"]
        command = next((c for c in COMMANDS if c.path == path), None)
        if command is None:
            return error(404, f"{path} is not an engine command (docs/rl.md)")
        if request.method not in command.methods:
            return error(405, f"{path} takes {' or '.join(command.methods)}")
        return await self.run(command, request, smg=True)

    async def _fan(
        self,
        command: Command,
        request: web.Request,
        workers: list[Worker],
        raw: bytes,
        body: dict[str, Any],
    ) -> list[dict[str, Any]]:
        try:
            if command.effect in ("pause", "begin", "update"):
                for w in workers:  # held from now: no new request while the engine pauses
                    self._set(w, command.effect, True)
                await self.standings.published(TELL_REPLICAS)
            calls = (self._call(command, request, w, raw, body) for w in workers)
            rows = await asyncio.gather(*calls)
            for w, row in zip(workers, rows, strict=True):
                self._after(command, w, _ok(row), row, body)
            if command.effect == "adapters":  # whatever each said: what does it serve now?
                served = (self._served(w, row) for w, row in zip(workers, rows, strict=True))
                await asyncio.gather(*served)
            return list(rows)
        finally:
            if command.exclusive:
                for w in workers:
                    self.updates.pop(w.id, None)

    async def _call(
        self,
        command: Command,
        request: web.Request,
        worker: Worker,
        raw: bytes,
        body: dict[str, Any],
    ) -> dict[str, Any]:
        assert worker.dialect is not None  # ready: discovered
        call = command.calls[worker.dialect]
        row: dict[str, Any] = {"worker": worker.id, "url": worker.url, "path": call.path}
        started = time.monotonic()
        query: dict[str, str] = dict(request.query)
        query.pop("worker", None)
        data: bytes | None = raw or None
        if call.translate is not None:
            try:
                extra, translated = call.translate(body)
            except (TypeError, ValueError) as exc:
                row.update(status=None, error=f"cannot say it in {worker.dialect}'s words: {exc}")
                return row
            query.update(extra)
            data = None if translated is None else orjson.dumps(translated)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if call.admin:
            key = self.access.admin_authorization(worker.admin_key, own_key(worker))
            if key is not None:
                headers["Authorization"] = key
        timeout = aiohttp.ClientTimeout(total=command.timeout)
        method = call.method or request.method
        url = worker.url + call.path
        await ask(self.session, method, url, row, timeout, params=query, data=data, headers=headers)
        row["latency_ms"] = round((time.monotonic() - started) * 1e3, 1)
        return row

    def _after(
        self, command: Command, worker: Worker, ok: bool, row: dict[str, Any], body: dict[str, Any]
    ) -> None:
        """What the engine's answer tells the router about ``worker``."""
        effect = command.effect
        answer = row.get("body")
        if command.reads_version and ok and isinstance(answer, dict):
            version = answer.get("weight_version")
            if version is not None:
                self.registry.set_weight_version(worker, str(version))  # read: this router's
        if effect is None:
            return
        if effect == "pause":
            self._set(worker, "pause", ok)  # a refused pause leaves it serving
        elif effect == "resume" and ok:
            self._set(worker, "pause", False)
        elif effect == "begin":
            self._set(worker, "begin", ok)
        elif effect == "update":  # within a begin..finish session it stays updating
            self._set(worker, "update", False)
            version = body.get("weight_version")
            if ok and version is not None:
                self.standings.version(worker, str(version))
        elif effect == "finish":
            self._set(worker, "begin", False)
            version = body.get("weight_version")
            if ok and version is not None:
                self.standings.version(worker, str(version))
        elif effect == "version" and ok and body.get("new_version") is not None:
            self.standings.version(worker, str(body["new_version"]))
        elif effect in ("sleep", "wake") and ok:
            self._set(worker, "sleep", effect == "sleep")

    async def _served(self, worker: Worker, row: dict[str, Any]) -> None:
        """Read ``worker``'s ``/v1/models`` again: its adapters' pools follow at once. A
        worker that does not answer keeps what it served; its row says so."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                cards = await probe.models(self.session, worker.url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            cards, row["models_error"] = (), f"{type(exc).__name__}: {exc}"
        if not cards:  # an engine always lists its model: this answer says nothing
            row.setdefault("models_error", "/v1/models listed nothing")
            return
        served(self.registry, worker, cards)
        row["models"] = list(worker.models)

    def _set(self, worker: Worker, what: str, on: bool) -> None:
        standing = self.standings.of(worker)
        if what == "pause":
            standing = standing.but(paused=on)
        elif what == "begin":
            standing = standing.but(updating=on, session=on)
        elif what == "update":
            # a single call holds the worker only while it runs, unless a session is open
            standing = standing.but(updating=on or standing.session)
        elif what == "sleep":
            standing = standing.but(asleep=on)
        self.standings.set(worker, standing)

    async def listing(self, request: web.Request) -> web.Response:
        """``GET /v1/rl/workers``: each worker as an RL framework sees it."""
        rows = []
        for w in self.registry.workers.values():
            rows.append(
                {
                    "id": w.id,
                    "url": w.url,
                    "engine": w.dialect,
                    "model_id": w.models[0] if w.models else w.model,
                    "worker_type": w.role,
                    "dp_size": w.ranks or w.dp_size,
                    "health": "healthy" if w.ready else w.state,
                    "held": w.held,
                    "weight_version": w.weight_version,
                    "capabilities": CAPABILITIES.get(w.dialect) if w.dialect else None,
                }
            )
        now = time.monotonic()
        updates = {k: {"path": u.path, "for_s": now - u.since} for k, u in self.updates.items()}
        return web.json_response({"workers": rows, "updates": updates}, dumps=_dumps)


SELECTOR_KEYS = ("id", "url", "worker_type", "engine", "model_id", "weight_version")


def _labels(worker: Worker) -> dict[str, str]:
    """What an smg-style selector matches a worker by."""
    found = {
        "id": worker.id,
        "url": worker.url,
        "worker_type": worker.role,
        "engine": worker.dialect,
        "model_id": worker.models[0] if worker.models else worker.model,
        "weight_version": worker.weight_version,
    }
    return {k: v for k, v in found.items() if v is not None}


def _ok(row: dict[str, Any]) -> bool:
    return row.get("status") is not None and row["status"] < 300


def _answer(command: Command, rows: list[dict[str, Any]]) -> web.Response:
    """Every worker's row; 200 when all succeeded, else an error naming those that did not:
    the engines' status when they all refused alike (the client's to fix), 502 otherwise."""
    failed = [r for r in rows if not _ok(r)]
    answer: dict[str, Any] = {"workers": rows}
    if command.path == "/v1/loads":
        answer.update(_merged_loads(rows))
    if not failed:
        return web.json_response(answer, dumps=_dumps)
    said = ", ".join(f"{r['worker']} ({r.get('status') or r.get('error')})" for r in failed)
    message = f"{command.path} failed on {len(failed)} of {len(rows)} worker(s): {said}"
    statuses = {r.get("status") for r in failed}
    status = 502
    alike = len(failed) == len(rows) and len(statuses) == 1
    if alike and (only := statuses.pop()) is not None and 400 <= only < 500:
        status = only  # every engine refused it alike: the client's to fix
    answer.update(orjson.loads(error_body(status, message)))
    return web.json_response(answer, status=status, dumps=_dumps)


def _smg_answer(rows: list[dict[str, Any]], single: bool) -> web.Response:
    """smg's shape: ``{"results": {id: {worker_id, url, status, latency_ms, body}},
    "failed", "total", "succeeded"}``; one worker's row alone for a per-worker call."""
    results = {
        r["worker"]: {
            "worker_id": r["worker"],
            "url": r["url"],
            "status": r.get("status"),
            "latency_ms": r.get("latency_ms"),
            **({"body": r["body"]} if "body" in r else {"error": r.get("error")}),
        }
        for r in rows
    }
    if single:
        (only,) = results.values()
        return web.json_response(only, status=200 if _ok(rows[0]) else 502, dumps=_dumps)
    failed = [r["worker"] for r in rows if not _ok(r)]
    answer = {
        "results": results,
        "failed": failed,
        "total": len(rows),
        "succeeded": len(rows) - len(failed),
    }
    return web.json_response(answer, status=502 if failed else 200, dumps=_dumps)


def _merged_loads(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``/v1/loads`` over the fleet: every rank's row (with its worker), and the sums."""
    loads: list[dict[str, Any]] = []
    totals: dict[str, float] = {}
    for row in rows:
        answer = row.get("body")
        if not isinstance(answer, dict):
            continue
        for rank in answer.get("loads") or ():
            if isinstance(rank, dict):
                loads.append({"worker": row["worker"], **rank})
        for name, value in (answer.get("aggregate") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                totals[name] = totals.get(name, 0) + value
    return {"loads": loads, "aggregate": totals}


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
