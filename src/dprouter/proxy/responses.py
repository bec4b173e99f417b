"""The Responses API: a stored response lives in the memory of the engine that made it,
so whatever names its id (``GET``, ``cancel``, ``previous_response_id``) goes there.

The router learns each id from the answer that carries it (a JSON body's ``id``, or a
stream's first event) and keeps id -> target in a map that is bounded (the oldest
goes first) and expiring (an idle id is forgotten). An id it never saw, or forgot,
is a 404 from the router itself: another worker's 404 would read the same, but a
wrong worker could also answer something else, and the router cannot tell.

Under ``--processes N`` each serving process keeps its map and tells the control
plane, which keeps the whole one: a follow-up that lands on another process asks it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import orjson
from aiohttp import web

from dprouter.core.errors import error
from dprouter.core.headers import TARGET_HEADER
from dprouter.fleet.targets import Target
from dprouter.proxy.plain import Proxy
from dprouter.proxy.pools import wait_pools
from dprouter.proxy.rankless import Rankless
from dprouter.proxy.read import read_request
from dprouter.proxy.relay import STREAMING
from dprouter.proxy.response_ids import ResponseIds

FIRST_ID = re.compile(rb'"id"\s*:\s*"([^"]{1,200})"')  # a stream's first id is the response's
LOOK = 64 << 10  # bytes of a stream searched for it


class IdWatcher:
    """Watches a stream for its response id, and notes it as soon as it passes."""

    def __init__(self, request: web.Request, ids: ResponseIds) -> None:
        self.request = request
        self.ids = ids
        self.seen = b""
        self.done = False
        self.noted: asyncio.Task[None] | None = None

    def __call__(self, chunk: bytes) -> None:
        if self.done:
            return
        self.seen += chunk
        found = FIRST_ID.search(self.seen)
        if found is not None:
            label = self.request[STREAMING].headers[TARGET_HEADER]
            note = self.ids.note(found.group(1).decode(), label)
            self.noted = asyncio.get_running_loop().create_task(note)
        if found is not None or len(self.seen) > LOOK:
            self.done = True
            self.seen = b""


class Responses:
    """``POST /v1/responses`` by the policy (or to the target that made the previous
    response), and the follow-ups that name a response to the target that made it."""

    def __init__(self, proxy: Proxy, rankless: Rankless, ids: ResponseIds) -> None:
        self.parts = proxy.parts
        self.proxy = proxy
        self.rankless = rankless
        self.ids = ids

    async def holder(self, rid: str) -> Target | web.Response:
        """The target that made response ``rid``, or the error to answer with."""
        label = await self.ids.find(rid)
        if label is None:
            message = (
                f"Response with id '{rid}' not found: the router never routed it, "
                "or has forgotten it."
            )
            return error(404, message, "response_id")
        for worker in self.parts.registry.workers.values():
            for target in worker.targets:
                if target.label == label:
                    if not worker.ready:
                        return error(503, f"response {rid!r} is on {label}, which is not ready")
                    return target
        return error(404, f"response {rid!r} was on {label}, which is no longer a worker")

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self.parts.tracing.serve(request, "responses", self._create(request))

    async def _create(self, request: web.Request) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        client = await read_request(request, "responses", self.parts.config, self.parts.metrics)
        if isinstance(client, web.Response):
            return client
        incoming = client.incoming
        previous = incoming.body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            return error(400, "previous_response_id must be a string", "previous_response_id")
        if previous is not None:
            found = await self.holder(previous)
            if isinstance(found, web.Response):
                return found
            pool: Sequence[Target] = (found,)
        else:
            chosen = await wait_pools(
                request,
                self.parts.registry,
                self.parts.metrics,
                ("regular",),
                incoming.model,
                self.parts.config.hold_wait,
                pinned={"regular": client.pinned},
                read_versions=self.parts.monitor.read_versions,
            )
            if isinstance(chosen, web.Response):
                return chosen
            pool = chosen[0]
        learn = IdWatcher(request, self.ids) if incoming.stream else None
        answer = await self.proxy.forward(request, client, "responses", pool, started, learn)
        if learn is None and isinstance(answer, web.Response) and answer.status == 200:
            try:
                rid = orjson.loads(answer.body).get("id")  # type: ignore[arg-type]
            except (orjson.JSONDecodeError, AttributeError):
                rid = None
            if isinstance(rid, str):  # noted before the client has the id
                await self.ids.note(rid, answer.headers[TARGET_HEADER])
        elif learn is not None and learn.noted is not None:
            await learn.noted
        return answer

    async def follow(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
        found = await self.holder(request.match_info["id"])
        if isinstance(found, web.Response):
            return found
        return await self.rankless.pinned(request, found)
