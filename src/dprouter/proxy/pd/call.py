"""What every P/D flow shares: the request in hand, sending one leg, the engine's answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from dprouter.core.errors import Failed, UpstreamBroke
from dprouter.core.headers import PREFILL_HEADER, REQUEST_ID_HEADER
from dprouter.core.tracing import NO_SPAN, Span, request_id
from dprouter.core.types import Incoming, Side
from dprouter.engines import dialects
from dprouter.fleet.targets import Outstanding, Target
from dprouter.proxy.abort import Aborter
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.parts import ProxyParts
from dprouter.proxy.read import ClientRequest
from dprouter.proxy.relay import relay


@dataclass
class Call:
    """One client request on its way through a P/D flow."""

    request: web.Request
    client: ClientRequest
    started: float
    parts: ProxyParts
    # per attempt: would a failure of this side be tried again elsewhere?
    last_chance: dict[Side, bool] = field(default_factory=dict)
    # per attempt, several serving processes: each leg counted in the step of the decision
    claimed: dict[Side, Outstanding] = field(default_factory=dict)
    # the decode leg's count, whose output budget its stream spends
    decoding: Outstanding | None = None
    attempt: int = 0  # which attempt of the request runs (0: the first)

    @property
    def incoming(self) -> Incoming:
        return self.client.incoming

    @property
    def body(self) -> dict[str, Any]:
        return self.client.incoming.body

    @property
    def metrics(self) -> RouterMetrics:
        return self.parts.metrics

    @property
    def aborter(self) -> Aborter:
        """SGLang: a client that leaves aborts its request on the engines."""
        return self.parts.aborter

    def count(self, side: Side, target: Target) -> Outstanding:
        """What counts this leg on its target while it runs: the count claimed with the
        decision if there is one, else one that counts on entering."""
        found = self.claimed.get(side)
        if found is not None and found.target is target:
            del self.claimed[side]
        else:
            output = self.incoming.output if side == "decode" else 0
            samples = self.incoming.samples if side == "decode" else 1  # one prefill for all
            found = Outstanding(target, self.incoming.tokens, output, samples)
        if side == "decode":
            self.decoding = found
        return found

    def release(self) -> None:
        """The attempt is over: a leg claimed with the decision that never ran is
        counted no more."""
        for counted in self.claimed.values():
            counted.__exit__()
        self.claimed.clear()

    def leg(self, side: Side, target: Target) -> Span:
        """The span of one leg (tracing off: ``NO_SPAN``), for the leg's block."""
        return self.parts.tracing.attempt(self.request, target.label, self.attempt, side)

    async def send(
        self,
        side: Side,
        target: Target,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
        span: Span = NO_SPAN,
    ) -> aiohttp.ClientResponse:
        """Post one leg with the target's rank in its dialect, under the attempt rules:
        ``Failed`` when it is to be tried elsewhere, else the answer, whatever its status.
        ``span``: the leg's, the parent of what the engine does."""
        sent, payload = self.client.headers.copy(), dict(body)
        sent[REQUEST_ID_HEADER] = request_id(self.request)
        sent.update(headers or {})  # MoRIIO's X-Request-Id is its own: it names both engines
        span.inject(sent)
        if side == "prefill":  # its answer is read here, as JSON: not compressed
            sent["Accept-Encoding"] = "identity"
        dialects.write_rank(target.worker.dialect or "vllm", target.rank, sent, payload)
        path = self.request.path_qs
        resp = await self.parts.upstream.post(target, path, orjson.dumps(payload), sent, side)
        span.set("http.response.status_code", resp.status)
        try:
            self.parts.retry.judge(target, resp, self.last_chance.get(side, True))
        except Failed as failure:
            failure.side = side
            raise
        return resp

    async def drain(self, target: Target, resp: aiohttp.ClientResponse) -> bytes:
        """The whole answer of a prefill leg."""
        try:
            async with resp:
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Failed(target, "broken_body", f"answer broke off: {exc}", "prefill") from exc

    async def prefill_answer(self, target: Target, resp: aiohttp.ClientResponse) -> Any:
        """The whole answer of a prefill leg, as JSON."""
        raw = await self.drain(target, resp)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise Failed(target, "broken_body", f"answer unreadable: {exc}", "prefill") from exc

    async def finish(
        self,
        target: Target,
        upstream: aiohttp.ClientResponse,
        prefill: Target,
        span: Span = NO_SPAN,
    ) -> web.StreamResponse:
        """Relay the answer of the decode leg (or of a prefill leg that answers the client
        itself) to the client; ``span``: that leg's."""
        try:
            return await relay(
                self.request,
                upstream,
                target,
                self.metrics.series(target),
                self.started,
                self.decoding if self.decoding and self.decoding.target is target else None,
                extra={PREFILL_HEADER: prefill.label},
                span=span,
                stated=self.parts.monitor.stated,
            )
        except UpstreamBroke as exc:
            side: Side = "prefill" if target is prefill else "decode"
            raise Failed(target, "broken_body", str(exc), side) from exc


async def cancel(task: asyncio.Task[Any]) -> None:
    """Stop a leg that is no longer wanted, closing its connection."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, aiohttp.ClientResponse):
            result.close()
