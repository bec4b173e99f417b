"""Requests that take no rank and no load count: the tokenizer and info endpoints go to
any ready worker serving the model, least busy first; fan-out goes to every worker.

A tokenizer call costs an engine next to nothing and never reaches a rank, so it is
left out of the in-flight counts that balance generation. Failures follow the same
rules as every attempt (``retry``): another worker is tried before the client hears.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from dprouter.core.errors import Failed, UpstreamBroke, error
from dprouter.core.headers import REQUEST_ID_HEADER, TARGET_HEADER
from dprouter.core.tracing import request_id
from dprouter.core.types import DialectName, Kind
from dprouter.engines import dialects
from dprouter.fleet.targets import Target, Worker
from dprouter.proxy.parts import ProxyParts
from dprouter.proxy.pools import Pools, wait_pools
from dprouter.proxy.read import forwarded, read_request
from dprouter.proxy.relay import relay
from dprouter.proxy.retry import Attempts

FAN_TIMEOUT = aiohttp.ClientTimeout(total=30.0)  # a fan-out call that hangs is reported
LEAST_BUSY = "least_busy_worker"  # how ``anyone`` chooses, as its decision spans name it


class Rankless:
    """Requests that name no rank: to any worker (``anyone``), to one target (``pinned``),
    or to every worker (``fan``)."""

    def __init__(self, parts: ProxyParts) -> None:
        self.parts = parts

    async def anyone(
        self, request: web.Request, kind: Kind | None, dialect: DialectName | None
    ) -> web.StreamResponse:
        """Forward to the least busy ready worker serving the body's model; no rank."""
        answering = self._anyone(request, kind, dialect)
        return await self.parts.tracing.serve(request, kind or "rankless", answering)

    async def _anyone(
        self, request: web.Request, kind: Kind | None, dialect: DialectName | None
    ) -> web.StreamResponse:
        p = self.parts
        started = asyncio.get_running_loop().time()
        model, data, headers = None, b"", forwarded(request, p.config)
        if kind is not None:
            client = await read_request(request, kind, p.config, p.metrics)
            if isinstance(client, web.Response):
                return client
            model, headers = client.incoming.model, client.headers
            data = orjson.dumps(client.incoming.body) if client.changed else client.raw
        pools = await wait_pools(
            request,
            p.registry,
            p.metrics,
            ("regular",),
            model,
            p.config.hold_wait,
            dialect,
            read_versions=p.monitor.read_versions,
        )
        if isinstance(pools, web.Response):
            return pools
        started_ns = p.tracing.clock()
        firsts: dict[Worker, Target] = {}
        for t in pools[0]:
            firsts.setdefault(t.worker, t)
        order = sorted(firsts.values(), key=lambda t: t.worker.outstanding)
        attempts = p.retry.start()

        async def attempt(left: Pools) -> web.StreamResponse:
            (candidates,) = left
            target = candidates[0]  # no rank written: named by its worker alone
            tried = len(attempts.tried)
            p.tracing.decision(request, started_ns, LEAST_BUSY, target, len(candidates), tried)
            last_chance = attempts.last_chance(candidates)
            return await self.one(
                request,
                target,
                data,
                headers,
                started,
                attempts,
                last_chance,
                target.worker.id,
                candidates,
            )

        return await attempts.run((order,), attempt)

    async def one(
        self,
        request: web.Request,
        target: Target,
        data: bytes,
        headers: CIMultiDict[str],
        started: float,
        attempts: Attempts,
        last_chance: bool,
        label: str | None = None,
        candidates: Sequence[Target] = (),
    ) -> web.StreamResponse:
        """One attempt on ``target``, the request's method and path as they came; on the
        last chance the engine's answer, whatever it is, goes to the client. ``candidates``:
        the targets left, where a model the engine does not serve may go instead."""
        p = self.parts
        method = request.method
        headers[REQUEST_ID_HEADER] = request_id(request)
        with p.tracing.attempt(request, target.label, len(attempts.tried)) as span:
            span.inject(headers)  # each attempt's own, over the last one's
            upstream = await p.upstream.post(target, request.path_qs, data, headers, method=method)
            span.set("http.response.status_code", upstream.status)
            p.retry.judge(target, upstream, last_chance)
            await attempts.served(target, upstream, () if last_chance else candidates)
            try:
                series = p.metrics.series(target)
                extra = None if label is None else {TARGET_HEADER: label}
                answer = await relay(
                    request,
                    upstream,
                    target,
                    series,
                    started,
                    extra=extra,
                    span=span,
                    stated=p.monitor.stated,
                )
            except UpstreamBroke as exc:
                raise Failed(target, "broken_body", f"answer broke off ({exc})") from exc
        attempts.answered(answer, target)
        return answer

    async def pinned(
        self, request: web.Request, target: Target, data: bytes = b""
    ) -> web.StreamResponse:
        """Forward to this one target (its rank written in its dialect): nowhere else
        would do. A failure is the client's to hear."""
        answering = self._pinned(request, target, data)
        return await self.parts.tracing.serve(request, "pinned", answering)

    async def _pinned(
        self, request: web.Request, target: Target, data: bytes
    ) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        headers = forwarded(request, self.parts.config)
        dialects.strip_client_rank(headers, {})
        if target.worker.dialect != "sglang":  # SGLang's rank is a body field; a GET has none
            dialects.write_rank("vllm", target.rank, headers, {})
        attempts = self.parts.retry.start()
        try:
            return await self.one(request, target, data, headers, started, attempts, True)
        except Failed as failure:
            attempts.failed(failure)
            status = 503 if failure.cause == "connect" else 502
            return error(status, f"{failure}")

    async def fan(
        self,
        request: web.Request,
        path: Callable[[Worker], str | None],
        method: str = "GET",
        workers: Sequence[Worker] | None = None,
    ) -> list[dict[str, Any]]:
        """Call every ready worker (``path`` None: skip it); one row per worker."""
        chosen = list(self.parts.registry.snapshot.workers if workers is None else workers)
        calls = [(w, p) for w in chosen if (p := path(w)) is not None]
        headers = forwarded(request, self.parts.config)
        rows = await asyncio.gather(*(self._call(w, p, method, headers) for w, p in calls))
        return list(rows)

    async def _call(
        self, worker: Worker, path: str, method: str, headers: CIMultiDict[str]
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"worker": worker.id, "url": worker.url, "path": path}
        upstream = self.parts.upstream
        sent = upstream.keyed(worker, headers)  # the worker's key, not the client's
        return await ask(
            upstream.session, method, worker.url + path, row, FAN_TIMEOUT, headers=sent
        )


async def ask(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    row: dict[str, Any],
    bound: aiohttp.ClientTimeout,
    **request: Any,
) -> dict[str, Any]:
    """One call of a fan-out, ``bound`` in time: ``row`` gets the engine's status and its
    body (JSON, else text), or, when there is no answer, status None and why."""
    try:
        async with session.request(method, url, timeout=bound, **request) as r:
            raw = await r.read()
            row["status"] = r.status
            try:
                row["body"] = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                row["body"] = raw.decode(errors="replace")
    except TimeoutError:
        row["status"] = None
        row["error"] = f"timed out after {bound.total:g} s"
    except aiohttp.ClientError as exc:
        row["status"] = None
        row["error"] = f"{type(exc).__name__} {exc}".strip()
    return row
