"""The P/D request path: pick a prefill target and a decode target, run the flow.

Each role has its own policy over its own flat slot space (workers of one role
may differ in dp and tp); ``Pairing`` keeps the two from locking together.
Before the first byte reaches the client a failed pair is chosen again
without the target that failed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial

import aiohttp
from aiohttp import web

from dprouter.breaker import Breakers
from dprouter.cancel import Aborter
from dprouter.config import RouterConfig
from dprouter.metrics import RouterMetrics
from dprouter.parse import Kind
from dprouter.pd import moriio, nixl, sglang
from dprouter.pd.call import Call, PairFailed, Side
from dprouter.pd.pairing import Pairing
from dprouter.policies import Policy, RequestInfo
from dprouter.proxy import admit, back_off, untried
from dprouter.registry import Registry
from dprouter.relay import CUT, error
from dprouter.targets import Target, Worker

Flow = Callable[[Call, Target, Target], Awaitable[web.StreamResponse]]


class PairProxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        unreachable: Callable[[Worker], None],
        breakers: Breakers | None = None,
    ) -> None:
        self.config = config
        self.breakers = breakers or Breakers(registry)
        self.aborter = Aborter(session)  # SGLang: a client that leaves aborts both legs
        self.registry = registry
        self.pairing = Pairing(prefill_policy, decode_policy)
        self.metrics = metrics
        self.session = session
        self.unreachable = unreachable
        flows: dict[str, Flow] = {
            "vllm-nixl": nixl.run,
            "vllm-moriio": moriio.run,
            "sglang": partial(sglang.run, rng=random.Random(config.seed)),
        }
        assert config.pd is not None
        self.flow = flows[config.pd]
        self.jitter = random.Random(config.seed)

    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        admitted = await admit(request, kind, self.config, self.metrics)
        if isinstance(admitted, web.Response):
            return admitted
        _, incoming, headers, _, _ = admitted
        if kind == "generate" and self.config.pd != "sglang":
            return error(
                404,
                f"/generate is SGLang's own; this router runs {self.config.pd}",
                "NotFoundError",
            )
        pools = self._pools(incoming.model)
        if isinstance(pools, web.Response):
            return pools
        call = Call(
            request,
            incoming,
            headers,
            started,
            self.session,
            self.metrics,
            self.unreachable,
            self.aborter,
            self.config.first_byte_timeout,
        )
        info = RequestInfo(incoming.key, incoming.text, incoming.tokens, started)
        tried: dict[Side, list[Target]] = {"prefill": [], "decode": []}
        unopened: dict[Side, list[Target]] = {"prefill": [], "decode": []}  # the leg never left
        last = "no attempt was made"
        for attempt in range(self.config.attempts):
            prefills = untried(pools[0], tried["prefill"], unopened["prefill"])
            decodes = untried(pools[1], tried["decode"], unopened["decode"])
            if not prefills or not decodes:
                break
            if attempt:
                await back_off(attempt, self.config.retry_backoff, self.jitter)
            prefill, decode = self.pairing.choose(
                prefills, decodes, replace(info, attempt=attempt), incoming.model
            )
            try:
                answer = await self.flow(call, prefill, decode)
            except PairFailed as failed:
                self.metrics.series(failed.target).failed(failed.cause)
                if failed.cause not in ("status_408", "status_429"):  # busy is not broken
                    self.breakers.failed(failed.target)
                tried[failed.side].append(failed.target)
                if failed.cause == "connect_timeout":
                    unopened[failed.side].append(failed.target)
                last = str(failed)
                continue
            if answer.get(CUT):  # the decode leg's stream broke off after its headers
                self.breakers.succeeded(prefill)
                self.breakers.failed(decode)
            elif answer.status < 500:
                self.breakers.succeeded(prefill)
                self.breakers.succeeded(decode)
            return answer
        self.metrics.rejected.labels("upstream_failed").inc()
        return error(502, f"every prefill/decode pair failed; last: {last}", "upstream_error")

    def _pools(self, model: str | None) -> tuple[Sequence[Target], Sequence[Target]] | web.Response:
        snapshot = self.registry.snapshot
        prefills, decodes = snapshot.pool("prefill", model), snapshot.pool("decode", model)
        if prefills and decodes:
            return prefills, decodes
        if model is not None and snapshot.pool("prefill") and snapshot.pool("decode"):
            self.metrics.rejected.labels("unknown_model").inc()
            return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        self.metrics.rejected.labels("no_target").inc()
        missing = "prefill" if not prefills else "decode"
        return error(503, f"no ready {missing} worker to route to", "ServiceUnavailableError")
