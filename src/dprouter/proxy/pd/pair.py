"""The P/D request path: pick a prefill target and a decode target, run the flow.

Each role has its own policy over its own flat slot space (workers of one role
may differ in dp and tp); ``Pairing`` keeps the two from locking together. A
failed leg follows the same rules as a plain attempt (``attempts``): the pair is
chosen again without the target that failed, before any byte reached the client.
A trusted client (``--trust-client-rank``) names the decode rank as it would a
plain request's, and the prefill rank in SGLang's ``disagg_prefill_dp_rank``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial

from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.errors import Failed, error
from dprouter.core.types import Kind, Role, Side
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Outstanding, Target
from dprouter.policies import Policy, RequestInfo
from dprouter.proxy.abort import Aborter
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.output_budget import learn
from dprouter.proxy.pd import moriio, nixl, sglang
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.pairing import Pairing
from dprouter.proxy.pools import choose_pools
from dprouter.proxy.read import read_request
from dprouter.proxy.retry import Rules
from dprouter.proxy.routing_keys import Places

Flow = Callable[[Call, Target, Target], Awaitable[web.StreamResponse]]


class PairProxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics,
        rules: Rules,
        placers: Mapping[Side, Places] | None = None,
        lock: BoardLock | None = None,
    ) -> None:
        self.placers = placers or {}  # several serving processes: manual's keys placed once
        self.lock = lock  # several serving processes: one decision at a time
        self.config = config
        self.registry = registry
        self.pairing = Pairing(prefill_policy, decode_policy)
        self.metrics = metrics
        self.rules = rules
        self.aborter = Aborter(rules.session)  # SGLang: a client that leaves aborts both legs
        flows: dict[str, Flow] = {
            "vllm-nixl": nixl.run,
            "vllm-moriio": moriio.run,
            "sglang": partial(sglang.run, rng=random.Random(config.seed)),
        }
        assert config.pd is not None
        self.flow = flows[config.pd]

    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        client = await read_request(request, kind, self.config, self.metrics)
        if isinstance(client, web.Response):
            return client
        if kind == "generate" and self.config.pd != "sglang":
            return error(404, f"/generate is SGLang's own; this router runs {self.config.pd}")
        pinned: dict[Role, int | None] = {"prefill": client.pinned_prefill, "decode": client.pinned}
        pools = choose_pools(
            self.registry,
            self.metrics,
            ("prefill", "decode"),
            client.incoming.model,
            request.path,
            pinned=pinned,
        )
        if isinstance(pools, web.Response):
            return pools
        incoming = client.incoming
        self.rules.output.apply(incoming)  # counted by its likely output, not its cap
        call = Call(request, client, started, self.rules, self.aborter)
        info = RequestInfo(
            key=incoming.key, text=incoming.text, tokens=incoming.tokens, now=started
        )
        attempts = self.rules.start()
        while True:
            prefills = attempts.candidates(pools[0])
            decodes = attempts.candidates(pools[1])
            if not prefills or not decodes:
                break
            if attempts.tried:
                await attempts.pause()
                info = replace(info, attempt=len(attempts.tried))
            elif info.key is not None:
                legs: tuple[tuple[Side, Sequence[Target]], ...] = (
                    ("prefill", prefills),
                    ("decode", decodes),
                )
                for side, candidates in legs:
                    if placer := self.placers.get(side):
                        await placer.place(candidates, replace(info, pool=(side, incoming.model)))
            if self.lock is None:
                prefill, decode = self.pairing.choose(prefills, decodes, info, incoming.model)
            else:
                with self.lock:  # the pair and both counts, in one step for all processes
                    prefill, decode = self.pairing.choose(prefills, decodes, info, incoming.model)
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
            except Failed as failure:
                attempts.failed(failure)
                continue
            finally:
                call.release()
            attempts.answered(answer, prefill, decode)
            self.metrics.paired(prefill, decode)
            if call.decoding is not None:
                learn(self.rules.output, answer, call.decoding, incoming.model)
            return answer
        return attempts.give_up("prefill/decode pair")
