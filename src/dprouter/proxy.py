"""The request path: parse, pick a target, write its rank, forward, pass the answer back.

Read as a sequence of steps in ``Proxy.handle``. Before the first byte reaches
the client a failed attempt (connection error or a retryable status) is tried
again on another target; after it, a broken stream ends with an error event.
The target's outstanding count is held for exactly as long as the attempt
runs, client disconnects included, and a disconnect closes the upstream
connection so the engine stops generating.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from dprouter import dialects
from dprouter.config import RouterConfig
from dprouter.metrics import RouterMetrics
from dprouter.parse import BadRequest, Incoming, Kind, parse
from dprouter.policies import Policy, RequestInfo
from dprouter.registry import Registry
from dprouter.targets import DialectName, Outstanding, Target

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)
HOP_AND_AUTH = HOP_BY_HOP | {"authorization"}  # a client's API key is not the engine's
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
TARGET_HEADER = "x-dprouter-target"


def error_body(status: int, message: str, etype: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": status}}
    )


def error(status: int, message: str, etype: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, etype, param),
        content_type="application/json",
    )


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        policy: Policy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.session = session

    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        try:
            raw = await request.read()
            incoming = parse(raw, kind, request.headers)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected.labels("too_large").inc()
            return error(
                413, f"request body exceeds {self.config.max_body} bytes", "invalid_request_error"
            )
        except BadRequest as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return error(exc.status, exc.message, "invalid_request_error", exc.param)
        pool = self._pool(kind, incoming)
        if isinstance(pool, web.Response):
            return pool
        dropped = HOP_BY_HOP if self.config.forward_authorization else HOP_AND_AUTH
        headers = {k: v for k, v in request.headers.items() if k.lower() not in dropped}
        changed = False
        if not self.config.trust_client_rank:
            changed = dialects.strip_client_rank(headers, incoming.body)
        info = RequestInfo(incoming.key, incoming.text, incoming.tokens, started)
        tried: list[Target] = []
        last = "no attempt was made"
        for attempt in range(self.config.attempts):
            candidates = pool if not tried else tuple(t for t in pool if t not in tried)
            if not candidates:
                break
            target = self.policy.select(candidates, info)
            tried.append(target)
            sent, body = dict(headers), dict(incoming.body)  # each attempt writes its own rank
            dialect = target.worker.dialect or "vllm"
            if dialects.write_rank(dialect, target.rank, sent, body) or changed:
                data = orjson.dumps(body)
            else:
                data = raw  # untouched: forward the client's bytes as they came
            final = attempt + 1 == self.config.attempts
            with Outstanding(target, incoming.tokens):
                try:
                    upstream = await self.session.post(
                        target.worker.url + request.path_qs, data=data, headers=sent
                    )
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self._failed(target, "connect")
                    last = f"{target.label}: {type(exc).__name__} {exc}"
                    continue
                if upstream.status in RETRY_STATUS and not final:
                    self._failed(target, f"status_{upstream.status}")
                    last = f"{target.label}: HTTP {upstream.status}"
                    upstream.close()
                    continue
                return await self._respond(request, upstream, target, started)
        self.metrics.rejected.labels("upstream_failed").inc()
        return error(502, f"every attempt failed; last: {last}", "upstream_error")

    def _pool(self, kind: Kind, incoming: Incoming) -> Sequence[Target] | web.Response:
        snapshot = self.registry.snapshot
        dialect: DialectName | None = "sglang" if kind == "generate" else None  # SGLang's own
        pool = snapshot.pool("regular", incoming.model, dialect)
        if pool:
            return pool
        if incoming.model is not None and snapshot.pool("regular", None, dialect):
            self.metrics.rejected.labels("unknown_model").inc()
            return error(
                404, f"The model `{incoming.model}` does not exist.", "NotFoundError", "model"
            )
        self.metrics.rejected.labels("no_target").inc()
        what = "SGLang worker for /generate" if dialect else "worker"
        return error(503, f"no ready {what} to route to", "ServiceUnavailableError")

    def _failed(self, target: Target, cause: str) -> None:
        self.metrics.errors.labels(target.worker.id, target.rank_label, cause).inc()

    async def _respond(
        self, request: web.Request, upstream: aiohttp.ClientResponse, target: Target, started: float
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        labels = (target.worker.id, target.rank_label)
        headers: dict[str, Any] = {
            k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP
        }
        headers[TARGET_HEADER] = target.label
        finished = False
        try:
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                body = await upstream.read()
                self.metrics.first_byte.labels(*labels).observe(loop.time() - started)
                resp: web.StreamResponse = web.Response(
                    status=upstream.status, body=body, headers=headers
                )
            else:
                resp = web.StreamResponse(status=upstream.status, headers=headers)
                await resp.prepare(request)
                first = True
                try:
                    async for chunk in upstream.content.iter_any():
                        if first:
                            self.metrics.first_byte.labels(*labels).observe(loop.time() - started)
                            first = False
                        await resp.write(chunk)
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError):
                    self._failed(target, "stream_cut")
                    message = f"upstream {target.label} closed the stream before it finished"
                    await resp.write(
                        b"data: "
                        + error_body(502, message, "upstream_error")
                        + b"\n\ndata: [DONE]\n\n"
                    )
                await resp.write_eof()
            finished = True
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # client gone mid-answer: the engine sees the disconnect
        self.metrics.requests.labels(*labels, str(upstream.status)).inc()
        self.metrics.duration.labels(*labels).observe(loop.time() - started)
        return resp
