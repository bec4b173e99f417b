"""The admin API: ``POST /workers``, ``GET /workers``, ``DELETE /workers/{id}``.

Off unless the router has an admin token; then every call must carry
``Authorization: Bearer <token>`` (a token of its own, not a client API key).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.errors import ConfigError, Duplicate, EtcdError, error
from dprouter.fleet.membership import Source, worker_name
from dprouter.fleet.membership.etcd import EtcdMembership
from dprouter.fleet.membership.kubernetes import KubernetesMembership
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import WorkerSpec, worker_from_mapping


def bearer(token: str, given: str) -> bool:
    """``given``, an Authorization header, carries the admin token (in constant time)."""
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def denied(token: str | None, request: web.Request) -> web.Response | None:
    """The answer to an admin call without the admin token; None: it may go on."""
    if token is None:
        return error(403, "the admin API is off: start the router with an admin token")
    if not bearer(token, request.headers.get("Authorization", "")):
        return error(401, "admin calls need Authorization: Bearer <admin token>")
    return None


def worker_fields(worker: Worker) -> dict[str, Any]:
    """What every view of a worker says (``GET /workers``, the dashboard's data)."""
    return {
        "id": worker.id,
        "url": worker.url,
        "role": worker.role,
        "state": worker.state,
        "error": worker.error,
        "dp_size": worker.ranks or worker.dp_size,
        "dp_attention": worker.dp_attention,
    }


def describe(worker: Worker) -> dict[str, Any]:
    return {
        **worker_fields(worker),
        "dialect": worker.dialect,
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


class Admin:
    """The admin handlers. New workers are checked against the running router's own
    configuration (a ``--pd`` router takes prefill and decode workers, not regular ones).
    Under etcd discovery a worker is added and removed in etcd, for every replica: the
    answer names the key, and the worker joins here as on the others, from the watch.
    A worker from a Kubernetes pod cannot be removed here (409): its pod decides."""

    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        monitor: Monitor,
        sources: Sequence[Source] = (),
    ) -> None:
        self.config = config
        self.token = config.admin_token
        self.registry = registry
        self.monitor = monitor
        self.shared = next((s for s in sources if isinstance(s, EtcdMembership)), None)
        self.kubernetes = next((s for s in sources if isinstance(s, KubernetesMembership)), None)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/workers", self.add),
            web.get("/workers", self.listing),
            web.delete("/workers/{worker_id}", self.remove),
        ]

    def denied(self, request: web.Request) -> web.Response | None:
        return denied(self.token, request)

    async def add(self, request: web.Request) -> web.Response:
        if (refused := self.denied(request)) is not None:
            return refused
        try:
            raw = orjson.loads(await request.read())
            if not isinstance(raw, dict):
                raise ConfigError("the body must be a JSON object describing one worker")
            spec = self.config.check_new_worker(worker_from_mapping(raw))
            if self.shared is not None:
                return await self._add_shared(request, spec, raw)
            worker = self.registry.add(worker_from_spec(spec, self.registry))
        except Duplicate as exc:
            return error(409, str(exc))
        except (orjson.JSONDecodeError, ConfigError, TypeError) as exc:
            return error(400, str(exc))
        self.monitor.watch(worker)
        await self._wait(request, worker.id)
        return web.json_response(describe(worker), status=201, dumps=_dumps)

    async def _add_shared(
        self, request: web.Request, spec: WorkerSpec, raw: dict[str, Any]
    ) -> web.Response:
        assert self.shared is not None
        name = spec.id or worker_name(spec.url)
        if name in self.registry.workers:
            return error(409, f"worker id {name!r} already registered")
        try:
            key = await self.shared.write(name, raw)
        except EtcdError as exc:
            return error(503, f"cannot write the worker to etcd: {exc}")
        worker = await self._wait(request, name)
        found = describe(worker) if worker is not None else {"id": name, "state": "pending"}
        return web.json_response({**found, "etcd_key": key}, status=201, dumps=_dumps)

    async def _wait(self, request: web.Request, worker_id: str) -> Worker | None:
        """With ``?wait=S``: up to S seconds for the worker to join and be discovered."""
        wait = request.query.get("wait")
        try:
            async with asyncio.timeout(min(float(wait or 0), 60.0)):
                await self._joined(worker_id)  # etcd: it joins from the watch
                await self.monitor.settled(self.registry.workers[worker_id])
        except (TimeoutError, ValueError):
            pass
        return self.registry.workers.get(worker_id)

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
        if self.kubernetes is not None and (pod := self.kubernetes.pod_of(worker_id)):
            # removed here alone, it would be back at the next list: the pod decides
            return error(
                409,
                f"worker {worker_id!r} is pod {pod}'s, and Kubernetes owns it: delete the pod, "
                "or change its labels so the selector no longer matches",
            )
        if self.shared is not None:
            url = self.registry.workers[worker_id].url  # the watch may remove it meanwhile
            try:
                key = await self.shared.erase(worker_id)
            except EtcdError as exc:
                return error(503, f"cannot remove the worker from etcd: {exc}")
            if key is not None:  # it leaves here as on every replica, from the watch
                return web.json_response(
                    {"removed": worker_id, "url": url, "etcd_key": key}, dumps=_dumps
                )
        self.monitor.forget(worker_id)
        worker = self.registry.remove(worker_id)
        return web.json_response({"removed": worker.id, "url": worker.url}, dumps=_dumps)

    async def _joined(self, worker_id: str) -> None:
        changed = asyncio.Event()
        self.registry.listeners.append(changed.set)
        try:
            while worker_id not in self.registry.workers:
                changed.clear()
                await changed.wait()
        finally:
            self.registry.listeners.remove(changed.set)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
