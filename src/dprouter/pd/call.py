"""What every P/D flow shares: the request in hand, sending one leg, failing a pair."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from dprouter import dialects
from dprouter.cancel import Aborter
from dprouter.metrics import RouterMetrics
from dprouter.parse import Incoming
from dprouter.proxy import RETRY_STATUS
from dprouter.relay import UpstreamBroke, relay
from dprouter.targets import Target, Worker

Side = Literal["prefill", "decode"]
PREFILL_HEADER = "x-dprouter-prefill"


class PairFailed(Exception):
    """One leg failed before any byte reached the client: the pair may be chosen again."""

    def __init__(self, side: Side, target: Target, cause: str, message: str) -> None:
        super().__init__(f"{side} {target.label}: {message}")
        self.side = side
        self.target = target
        self.cause = cause


class Refused(Exception):
    """An engine refused the request itself (a client error): the client hears its answer."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or "application/json"

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, headers={"Content-Type": self.content_type}
        )


@dataclass
class Call:
    """One client request on its way through a P/D flow."""

    request: web.Request
    incoming: Incoming
    headers: CIMultiDict[str]  # to forward (hop-by-hop, Authorization and client ranks gone)
    started: float
    session: aiohttp.ClientSession
    metrics: RouterMetrics
    unreachable: Any  # Callable[[Worker], None]: a refused connection takes a worker out
    aborter: Aborter  # SGLang: a client that leaves aborts its request on the engines
    first_byte: float = 0.0  # seconds a leg's answer may take to start; 0: no such limit

    @property
    def body(self) -> dict[str, Any]:
        return self.incoming.body

    def gone(self, worker: Worker) -> None:
        self.unreachable(worker)

    async def send(
        self,
        side: Side,
        target: Target,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """Post one leg with the target's rank in its dialect; a connection that fails or a
        retryable status raises ``PairFailed``; any other answer is returned."""
        sent, payload = self.headers.copy(), dict(body)
        sent.update(headers or {})
        if side == "prefill":  # its answer is read here, as JSON: not compressed
            sent["Accept-Encoding"] = "identity"
        dialects.write_rank(target.worker.dialect or "vllm", target.rank, sent, payload)
        url = target.worker.url + self.request.path_qs
        try:
            async with asyncio.timeout(self.first_byte or None):
                resp = await self.session.post(url, data=orjson.dumps(payload), headers=sent)
        except aiohttp.ClientConnectorError as exc:
            self.gone(target.worker)
            raise PairFailed(side, target, "connect", f"cannot connect ({exc.os_error})") from exc
        except aiohttp.ConnectionTimeoutError as exc:  # the leg never left: it may go again
            raise PairFailed(side, target, "connect_timeout", "no connection in time") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PairFailed(side, target, "no_answer", f"{type(exc).__name__} {exc}") from exc
        if resp.status in RETRY_STATUS:
            text = await _text(resp)
            raise PairFailed(side, target, f"status_{resp.status}", f"HTTP {resp.status} {text}")
        return resp

    async def drain(self, target: Target, resp: aiohttp.ClientResponse) -> bytes:
        """The whole answer of a prefill leg."""
        try:
            async with resp:
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PairFailed("prefill", target, "broken_body", f"answer broke off: {exc}") from exc

    async def prefill_answer(self, target: Target, resp: aiohttp.ClientResponse) -> Any:
        """The whole answer of a prefill leg, as JSON."""
        raw = await self.drain(target, resp)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise PairFailed("prefill", target, "broken_body", f"answer unreadable: {exc}") from exc

    async def finish(
        self, decode: Target, upstream: aiohttp.ClientResponse, prefill: Target
    ) -> web.StreamResponse:
        """Relay the decode leg's answer to the client."""
        try:
            resp = await relay(
                self.request,
                upstream,
                decode,
                self.metrics.series(decode),
                self.started,
                {PREFILL_HEADER: prefill.label},
            )
        except UpstreamBroke as exc:
            raise PairFailed("decode", decode, "broken_body", str(exc)) from exc
        return resp


async def _text(resp: aiohttp.ClientResponse) -> str:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with resp:
            return (await resp.text())[:200]
    return ""


async def cancel(task: asyncio.Task[Any]) -> None:
    """Stop a leg that is no longer wanted, closing its connection."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, aiohttp.ClientResponse):
            result.close()
