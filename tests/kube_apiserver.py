"""A stand-in Kubernetes API server on loopback: pods only, in the real wire format.

``GET /api/v1/namespaces/{ns}/pods`` lists (a ``PodList`` with its
``resourceVersion``) or, with ``watch=1``, streams newline-delimited events
from a version on, over chunked HTTP, as the real server does: equality-based
label selectors (a pod relabelled out of a watch's selector is ``DELETED`` for
it, relabelled in ``ADDED``), a global version counter, ``BOOKMARK`` events
when asked for, an ``ERROR`` event with a 410 ``Status`` for a version older
than the history kept (``gone_as_http``: a plain HTTP 410 instead), the
stream ending after ``timeoutSeconds``, and a bearer token checked on every
call. A test can cut every open watch mid-stream, stop delivering events
(``deaf``), forget the history (``compact``), answer with garbage
(``garbled``), or stop listening and listen again on the same port.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from dprouter.core.net import bind, url_of
from dprouter.fleet.membership.labels import matches, parse_selector


def pod(
    name: str,
    ip: str | None = "127.0.0.1",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "llm",
) -> dict[str, Any]:
    """A pod as the API writes it (the fields membership reads, and a few it does not)."""
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ],
        "hostIP": "10.0.0.1",
    }
    if ip:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels if labels is not None else {"app": "engine"},
            "annotations": annotations or {},
            "creationTimestamp": "2026-12-01T10:00:00Z",
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]},
        "status": status,
    }


def gone(message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    }


@dataclass
class Change:
    version: int
    type: str  # ADDED, MODIFIED, DELETED
    before: dict[str, Any] | None
    after: dict[str, Any]


@dataclass
class KubeApiServer:
    token: str | None = "t"
    bookmarks: float = 0.0  # seconds between BOOKMARK events (0: none)
    gone_as_http: bool = False
    version: int = 100
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[Change] = field(default_factory=list)
    oldest: int = 100  # versions before this are no longer kept
    deaf: bool = False  # watches get no events (every event lost)
    garbled: int = 0  # the next this many calls are answered 200 with a body that is not JSON
    lists: int = 0  # list calls answered
    watches: int = 0  # watch calls answered
    port: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    ssl: ssl.SSLContext | None = None  # serve HTTPS with it
    _open: dict[int, web.Request] = field(default_factory=dict)  # by id: not hashable
    _runner: web.AppRunner | None = None
    _ending: bool = False

    @property
    def url(self) -> str:
        return url_of("127.0.0.1", self.port).replace("http", "https" if self.ssl else "http", 1)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.pods_call)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        sock = bind("127.0.0.1", self.port)  # the same port when started again
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, ssl_context=self.ssl).start()

    async def stop(self) -> None:
        """Stop listening, and cut every watch."""
        self.cut()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def cut(self) -> None:
        """Every open watch dies mid-stream (no end chunk: a broken connection)."""
        for request in list(self._open.values()):
            if request.transport is not None:
                request.transport.abort()
            request.task.cancel()

    async def end(self) -> None:
        """Every open watch ends cleanly, as after its ``timeoutSeconds``."""
        self._ending = True
        async with self._changed:
            self._changed.notify_all()
        for _ in range(20):
            if not self._open:
                break
            await asyncio.sleep(0.01)
        self._ending = False

    def compact(self) -> None:
        self.oldest = self.version + 1
        self.history.clear()

    async def put(self, obj: dict[str, Any]) -> None:
        """Create or replace a pod (ADDED or MODIFIED)."""
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        before = self.pods.get(key)
        await self._record("MODIFIED" if before else "ADDED", key, before, copy.deepcopy(obj))

    async def delete(self, namespace: str, name: str, force: bool = False) -> None:
        """A graceful delete sets ``deletionTimestamp`` (MODIFIED) and leaves the pod
        terminating; ``force`` (or the kubelet finishing) removes it (DELETED)."""
        key = (namespace, name)
        before = self.pods[key]
        if not force:
            after = copy.deepcopy(before)
            after["metadata"]["deletionTimestamp"] = "2026-12-01T10:05:00Z"
            after["metadata"]["deletionGracePeriodSeconds"] = 30
            await self._record("MODIFIED", key, before, after)
            return
        await self._record("DELETED", key, before, copy.deepcopy(before))

    async def _record(
        self, kind: str, key: tuple[str, str], before: dict[str, Any] | None, after: dict[str, Any]
    ) -> None:
        self.version += 1
        after["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = after
        self.history.append(Change(self.version, kind, before, after))
        async with self._changed:
            self._changed.notify_all()

    def _refused(self, request: web.Request) -> web.Response | None:
        if self.token is None:
            return None
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            status = {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}
            return web.json_response(status, status=401)
        return None

    async def pods_call(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        if self.garbled > 0:
            self.garbled -= 1
            return web.Response(text="<html>a proxy's error page</html>")
        namespace = request.match_info["ns"]
        try:
            text = request.query.get("labelSelector")
            selector = parse_selector(text) if text else ()
        except ValueError as exc:
            status = {"kind": "Status", "status": "Failure", "code": 400, "message": str(exc)}
            return web.json_response(status, status=400)

        def selected(obj: dict[str, Any] | None) -> bool:
            if obj is None or obj["metadata"]["namespace"] != namespace:
                return False
            return matches(selector, obj["metadata"].get("labels") or {})

        if request.query.get("watch") not in ("1", "true"):
            self.lists += 1
            items = [p for p in self.pods.values() if selected(p)]
            return web.json_response(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        return await self._watch(request, selected)

    async def _watch(self, request: web.Request, selected: Any) -> web.StreamResponse:
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        if since + 1 < self.oldest and self.gone_as_http:
            return web.json_response(gone(f"too old resource version: {since}"), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since + 1 < self.oldest:
            message = f"too old resource version: {since} ({self.oldest})"
            await response.write(line("ERROR", gone(message)))
            return response  # the real server ends the stream after it
        seconds = float(request.query.get("timeoutSeconds") or 1800)
        bookmarks = request.query.get("allowWatchBookmarks") == "true" and self.bookmarks > 0
        self._open[id(request)] = request
        try:
            async with asyncio.timeout(seconds):
                while not self._ending:
                    for change in [c for c in self.history if c.version > since]:
                        since = change.version
                        kind = watched(change, selected)
                        if kind is not None and not self.deaf:
                            await response.write(line(kind, change.after))
                    async with self._changed:
                        try:
                            async with asyncio.timeout(self.bookmarks if bookmarks else None):
                                await self._changed.wait()
                        except TimeoutError:
                            mark = {"kind": "Pod", "apiVersion": "v1", "metadata": {}}
                            mark["metadata"] = {"resourceVersion": str(since)}
                            await response.write(line("BOOKMARK", mark))
        except TimeoutError:
            return response  # timeoutSeconds: a clean end
        finally:
            self._open.pop(id(request), None)
        return response


def watched(change: Change, selected: Any) -> str | None:
    """What a watch with this selector sees of a change (None: nothing)."""
    was, now = selected(change.before), selected(change.after)
    if change.type == "DELETED":
        return "DELETED" if was else None
    if was and not now:
        return "DELETED"
    if now and not was:
        return "ADDED"
    return change.type if now else None


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"
