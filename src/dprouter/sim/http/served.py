"""What every non-generation endpoint of a simulated engine does first: read the body,
check the model, place the request on a rank, apply the fault knobs, count it.

The rank is read where the persona reads it (vLLM's header, SGLang's body fields);
a request that names none is placed round-robin, as an engine's own balancer would.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from dprouter.sim.http.persona import RankError
from dprouter.sim.http.protocol import Kind

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class Refused(Exception):
    """The engine answers with this error instead."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def fail(server: SimServer, status: int, message: str, etype: str = "BadRequestError") -> Refused:
    body = server.persona.error_body(status, message, etype, None, "completion")
    return Refused(web.json_response(body, status=status, dumps=dumps))


async def body_of(server: SimServer, request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise fail(server, 413, f"Request body exceeds {server.max_body} bytes") from None
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise fail(server, 400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise fail(server, 400, "request body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str):
        message = server.persona.model_error(model, server.config.model, server.adapters.loaded)
        if message is not None:
            raise fail(server, 404, message, "NotFoundError")
    return body


async def place(
    server: SimServer, request: web.Request, body: dict[str, Any], kind: Kind = "completion"
) -> int:
    """The rank that serves this request, after the fault knobs had their say."""
    try:
        rank = server.persona.pinned_rank(request.headers, body, server.config.dp_size, kind)
    except RankError as exc:
        server.record(request, body, None)
        raise fail(server, 400, str(exc)) from None
    if rank is None:
        rank = server.next_rank % server.config.dp_size
        server.next_rank += 1
    faults = server.config.faults
    if faults.delay > 0:
        await asyncio.sleep(faults.delay)
    if rank in faults.failing_ranks or server.rng.random() < faults.fail_rate:
        server.record(request, body, None)
        raise fail(server, 500, f"simulated failure of rank {rank}", "InternalServerError")
    server.record(request, body, rank)
    server.served[(request.path, rank)] += 1
    if faults.hang:
        await asyncio.Event().wait()  # received, and never answered
    return rank
