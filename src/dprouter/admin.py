"""The admin API: ``POST /workers``, ``GET /workers``, ``DELETE /workers/{id}``.

Off unless the router has an admin token; then every call must carry
``Authorization: Bearer <token>`` (a token of its own, not a client API key).
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from dprouter.config import (
    ConfigError,
    RouterConfig,
    WorkerSpec,
    validate,
    worker_from_mapping,
)
from dprouter.monitor import Monitor
from dprouter.registry import Duplicate, Registry
from dprouter.relay import error
from dprouter.targets import Worker


def describe(worker: Worker) -> dict[str, Any]:
    return {
        "id": worker.id,
        "url": worker.url,
        "role": worker.role,
        "dialect": worker.dialect,
        "state": worker.state,
        "error": worker.error,
        "dp_size": worker.ranks or worker.dp_size,
        "dp_attention": worker.dp_attention,
        "rank_offset": worker.rank_offset,
        "models": list(worker.models),
        "outstanding": worker.outstanding,
        "targets": [
            {
                "target": t.label,
                "dp_rank": t.rank,
                "outstanding": t.outstanding,
                "engine_load": t.reported,
                "breaker": "open" if t.tripped else "closed",
            }
            for t in worker.targets
        ],
    }


def worker_from_spec(spec: WorkerSpec, registry: Registry) -> Worker:
    return Worker(
        id=spec.id or registry.next_id(spec.role),
        url=spec.url,
        role=spec.role,
        dialect=spec.dialect,
        dp_size=spec.dp_size,
        rank_offset=spec.rank_offset,
        model=spec.model,
        bootstrap_port=spec.bootstrap_port,
        tp_size=spec.tp_size,
    )


class Admin:
    """The admin handlers. New workers are checked against the running router's own
    configuration (a ``--pd`` router takes prefill and decode workers, not regular ones)."""

    def __init__(self, config: RouterConfig, registry: Registry, monitor: Monitor) -> None:
        self.config = config
        self.token = config.admin_token
        self.registry = registry
        self.monitor = monitor

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/workers", self.add),
            web.get("/workers", self.listing),
            web.delete("/workers/{worker_id}", self.remove),
        ]

    def denied(self, request: web.Request) -> web.Response | None:
        if self.token is None:
            return error(403, "the admin API is off: start the router with an admin token")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return error(401, "admin calls need Authorization: Bearer <admin token>")
        return None

    async def add(self, request: web.Request) -> web.Response:
        if (refused := self.denied(request)) is not None:
            return refused
        try:
            raw = orjson.loads(await request.read())
            if not isinstance(raw, dict):
                raise ConfigError("the body must be a JSON object describing one worker")
            spec = validate(replace(self.config, workers=(worker_from_mapping(raw),))).workers[0]
            worker = self.registry.add(worker_from_spec(spec, self.registry))
        except Duplicate as exc:
            return error(409, str(exc))
        except (orjson.JSONDecodeError, ConfigError, TypeError) as exc:
            return error(400, str(exc))
        self.monitor.watch(worker)
        wait = request.query.get("wait")
        if wait is not None:
            try:
                async with asyncio.timeout(min(float(wait), 60.0)):
                    await self.monitor.settled(worker)
            except (TimeoutError, ValueError):
                pass
        return web.json_response(describe(worker), status=201, dumps=_dumps)

    async def listing(self, request: web.Request) -> web.Response:
        if (refused := self.denied(request)) is not None:
            return refused
        workers = [describe(w) for w in self.registry.workers.values()]
        return web.json_response(workers, dumps=_dumps)

    async def remove(self, request: web.Request) -> web.Response:
        if (refused := self.denied(request)) is not None:
            return refused
        worker_id = request.match_info["worker_id"]
        if worker_id not in self.registry.workers:
            return error(404, f"no worker {worker_id!r}")
        self.monitor.forget(worker_id)
        worker = self.registry.remove(worker_id)
        return web.json_response({"removed": worker.id, "url": worker.url}, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
