"""The P/D request path: pick a prefill target and a decode target, run the flow.

Each role has its own policy over its own flat slot space (workers of one role
may differ in dp and tp); ``Pairing`` keeps the two from locking together. A
failed leg follows the same rules as a plain attempt (``retry``): the pair is
chosen again without the target that failed, before any byte reached the client.
A trusted client (``--trust-client-rank``) names the decode rank as it would a
plain request's, and the prefill rank in SGLang's ``disagg_prefill_dp_rank``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial

from aiohttp import web

from dprouter.core.errors import error
from dprouter.core.types import Kind, Role, Side
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.targets import Outstanding, Target
from dprouter.policies import Policy, RequestInfo
from dprouter.proxy.output_budget import learn
from dprouter.proxy.parts import ProxyParts
from dprouter.proxy.pd import moriio, nixl, sglang
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.mooncake import Mooncake
from dprouter.proxy.pd.pairing import Pairing
from dprouter.proxy.pools import Pools, wait_pools
from dprouter.proxy.read import read_request
from dprouter.proxy.routing_keys import Places, placeable

Flow = Callable[[Call, Target, Target], Awaitable[web.StreamResponse]]
SIDES: tuple[Side, Side] = ("prefill", "decode")  # the order of a pair's pools


class PairProxy:
    """P/D requests: a (prefill, decode) pair per attempt, run by the deployment's flow."""

    def __init__(
        self,
        parts: ProxyParts,
        prefill_policy: Policy,
        decode_policy: Policy,
        placers: Mapping[Side, Places] | None = None,
        lock: BoardLock | None = None,
    ) -> None:
        self.parts = parts
        self.pairing = Pairing(prefill_policy, decode_policy)
        self.placers = placers or {}  # several serving processes: manual's keys placed once
        self.lock = lock  # several serving processes: one decision at a time
        config = parts.config
        flows: dict[str, Flow] = {
            "vllm-nixl": nixl.run,
            "vllm-mooncake": Mooncake().run,
            "vllm-moriio": moriio.run,
            "sglang": partial(sglang.run, rng=random.Random(config.seed)),
        }
        assert config.pd is not None
        self.flow = flows[config.pd]

    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        p = self.parts
        started = asyncio.get_running_loop().time()
        client = await read_request(request, kind, p.config, p.metrics)
        if isinstance(client, web.Response):
            return client
        if kind == "generate" and p.config.pd != "sglang":
            return error(404, f"/generate is SGLang's own; this router runs {p.config.pd}")
        pinned: dict[Role, int | None] = {"prefill": client.pinned_prefill, "decode": client.pinned}
        pools = await wait_pools(
            request,
            p.registry,
            p.metrics,
            ("prefill", "decode"),
            client.incoming.model,
            p.config.hold_wait,
            pinned=pinned,
        )
        if isinstance(pools, web.Response):
            return pools
        incoming = client.incoming
        p.output.apply(incoming)  # counted by its likely output, not its cap
        call = Call(request, client, started, p)
        info = RequestInfo(
            key=incoming.key,
            text=incoming.text,
            tokens=incoming.tokens,
            now=started,
        )
        attempts = p.retry.start()

        async def attempt(left: Pools) -> web.StreamResponse:
            prefills, decodes = left
            chosen = attempts.numbered(info)
            if self.placers and placeable(chosen):
                for side, candidates in zip(SIDES, left, strict=True):
                    if placer := self.placers.get(side):
                        await placer.place(candidates, replace(chosen, pool=(side, incoming.model)))
            if self.lock is None:
                prefill, decode = self.pairing.choose(prefills, decodes, chosen, incoming.model)
            else:
                with self.lock:  # the pair and both counts, in one step for all processes
                    prefill, decode = self.pairing.choose(prefills, decodes, chosen, incoming.model)
                    tokens = incoming.tokens
                    call.claimed = {
                        "prefill": Outstanding(prefill, tokens).claim(),
                        "decode": Outstanding(decode, tokens, incoming.output).claim(),
                    }
            call.last_chance = {
                "prefill": attempts.last_chance(prefills),
                "decode": attempts.last_chance(decodes),
            }
            try:
                answer = await self.flow(call, prefill, decode)
            finally:
                call.release()
            attempts.answered(answer, prefill, decode)
            p.metrics.paired(prefill, decode)
            if call.decoding is not None:
                learn(p.output, answer, call.decoding, incoming)
            return answer

        return await attempts.run(pools, attempt, "prefill/decode pair")
