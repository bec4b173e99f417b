"""The admin API: workers joining and leaving, in the SGLang gateway's shapes (current
``/workers`` and older ``/add_worker``, ``/remove_worker``, ``/list_workers``: the RL
frameworks call both), the RL listing, and the engine commands (``commands``).

Every call passes ``Identity.admin`` (``server/identity.py``): an admin's credential
(``--admin-token``, an admin tenant's API key, a JWT with the admin role) as
``Authorization: Bearer``; a user's is refused with 403. With no admin credential
configured, calls are taken from loopback and the ``--admin-from`` networks only: an RL
framework starts its router with no token and registers its engines from the same host
(or, multi-node, from the engines' own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.errors import ConfigError, Duplicate, EtcdError, error
from dprouter.core.types import ROLES
from dprouter.fleet.membership import Source, worker_name
from dprouter.fleet.membership.etcd import EtcdMembership
from dprouter.fleet.membership.etcd_holds import EtcdHolds
from dprouter.fleet.membership.kubernetes import KubernetesMembership
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import WorkerSpec, normalise_url, worker_from_mapping
from dprouter.server.commands import COMMANDS, Commands
from dprouter.server.identity import Identity

Handler = Callable[[web.Request], Awaitable[web.Response]]


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
        "held": worker.held,
        "weight_version": worker.weight_version,
    }


def describe(worker: Worker) -> dict[str, Any]:
    return {
        **worker_fields(worker),
        # the SGLang gateway's names for what RL frameworks read
        "worker_type": worker.role,
        "is_healthy": worker.ready,
        "model_id": worker.models[0] if worker.models else worker.model,
        "load": worker.outstanding,
        "bootstrap_port": worker.bootstrap_port,
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


# every admin route, as (method, path): a serving process of --processes N relays these
ADMIN_ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("DELETE", "/workers/{worker_id:.+}"),
    ("POST", "/add_worker"),
    ("POST", "/remove_worker"),
    ("GET", "/list_workers"),
    ("GET", "/v1/rl/workers"),
    # smg's RL fan-out (--enable-rl), for the same commands
    ("GET", "/v1/rl/engine/{path:.+}"),
    ("POST", "/v1/rl/engine/{path:.+}"),
    ("GET", "/v1/rl/workers/{worker_id}/engine/{path:.+}"),
    ("POST", "/v1/rl/workers/{worker_id}/engine/{path:.+}"),
    *((method, c.path) for c in COMMANDS for method in c.methods),
)


class Admin:
    """The admin handlers. New workers are checked against the running router's own
    configuration (a ``--pd`` router takes prefill and decode workers, not regular ones).
    Under etcd discovery a worker is added and removed in etcd, for every replica: the
    answer names the key, and the worker joins here as on the others, from the watch.
    A worker from a Kubernetes pod cannot be removed here (409): its pod decides.
    ``relayed``: the calls come from the serving processes of ``--processes N``, which
    checked where each came from; the credential is checked here."""

    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        monitor: Monitor,
        sources: Sequence[Source] = (),
        relayed: bool = False,
        identity: Identity | None = None,
    ) -> None:
        self.config = config
        self.identity = identity or Identity.of(config, warn=False)
        self.registry = registry
        self.monitor = monitor
        self.relayed = relayed
        # under etcd discovery, holds and versions are every replica's
        holds = next((s for s in sources if isinstance(s, EtcdHolds)), None)
        self.commands = Commands(registry, monitor.access, holds)
        self.shared = next((s for s in sources if isinstance(s, EtcdMembership)), None)
        self.kubernetes = next((s for s in sources if isinstance(s, KubernetesMembership)), None)

    def routes(self) -> list[web.RouteDef]:
        own: dict[str, Handler] = {
            "/workers": self.add,
            "/add_worker": self.add_worker,
            "/remove_worker": self.remove_worker,
            "/list_workers": self.list_workers,
            "/v1/rl/workers": self.commands.listing,
            "/v1/rl/engine/{path:.+}": self.commands.smg,
            "/v1/rl/workers/{worker_id}/engine/{path:.+}": self.commands.smg,
        }
        handlers = {
            ("GET", "/workers"): self.listing,
            ("DELETE", "/workers/{worker_id:.+}"): self.remove,
        }
        routes = []
        for method, path in ADMIN_ROUTES:
            handler = handlers.get((method, path)) or own.get(path)
            if handler is None:
                command = next(c for c in COMMANDS if c.path == path)
                handler = self.commands.handler(command)
            routes.append(web.route(method, path, self.guard(handler)))
        return routes

    async def close(self) -> None:
        await self.commands.close()

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.Response:
            if (refused := await self.identity.admin(request, self.relayed)) is not None:
                return refused
            return await handler(request)

        return guarded

    async def add(self, request: web.Request) -> web.Response:
        try:
            raw = orjson.loads(await request.read())
            if not isinstance(raw, dict):
                raise ConfigError("the body must be a JSON object describing one worker")
        except (orjson.JSONDecodeError, ConfigError) as exc:
            return error(400, str(exc))
        return await self._add(request, raw)

    async def add_worker(self, request: web.Request) -> web.Response:
        """The older gateways' ``POST /add_worker?url=...``."""
        url = request.query.get("url")
        if not url:
            return error(400, "POST /add_worker needs ?url=http://host:port", "url")
        return await self._add(request, {"url": url})

    async def _add(self, request: web.Request, raw: dict[str, Any]) -> web.Response:
        try:
            spec = self.config.check_new_worker(worker_from_mapping(raw))
            if self.shared is not None:
                return await self._add_shared(request, spec, raw)
            worker = self.registry.add(worker_from_spec(spec, self.registry))
        except Duplicate as exc:
            return error(409, str(exc))
        except (ConfigError, TypeError) as exc:
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
        """``{"workers": [...], "total", "stats"}``, as the SGLang gateway answers."""
        workers = list(self.registry.workers.values())
        by_type = {role: sum(w.role == role for w in workers) for role in ROLES}
        stats = {
            "total_workers": len(workers),
            "healthy_workers": sum(w.ready for w in workers),
            "total_models": len(self.registry.snapshot.known_models),
            "total_load": sum(w.outstanding for w in workers),
            "by_type": by_type,
        }
        listed = [describe(w) for w in workers]
        return web.json_response(
            {"workers": listed, "total": len(listed), "stats": stats}, dumps=_dumps
        )

    async def list_workers(self, request: web.Request) -> web.Response:
        """The older gateways' ``GET /list_workers``."""
        return web.json_response({"urls": [w.url for w in self.registry.workers.values()]})

    async def remove(self, request: web.Request) -> web.Response:
        """``DELETE /workers/{id}``; the id may be the worker's URL (0.2.x gateways)."""
        return await self._remove(request.match_info["worker_id"])

    async def remove_worker(self, request: web.Request) -> web.Response:
        """The older gateways' ``POST /remove_worker?url=...``."""
        url = request.query.get("url")
        if not url:
            return error(400, "POST /remove_worker needs ?url=http://host:port", "url")
        return await self._remove(url)

    async def _remove(self, named: str) -> web.Response:
        worker_id = self._find(named)
        if worker_id is None:
            return error(404, f"no worker {named!r}")
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

    def _find(self, named: str) -> str | None:
        """A worker's id from its id or its URL (as the client wrote it)."""
        if named in self.registry.workers:
            return named
        try:
            url = normalise_url(named)
        except ValueError:
            return None
        return next((w.id for w in self.registry.workers.values() if w.url == url), None)

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
