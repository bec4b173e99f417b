"""The P/D request path: pick a prefill target and a decode target, run the flow.

Each role has its own policy over its own flat slot space (workers of one role
may differ in dp and tp); ``Pairing`` keeps the two from locking together. A
failed leg follows the same rules as a plain attempt (``retry``): the pair is
chosen again without the target that failed, before any byte reached the client.
A trusted client (``--trust-client-rank``) names the decode rank as it would a
plain request's, and the prefill rank in SGLang's ``disagg_prefill_dp_rank``.

A side whose policy needs tokens (``prefix``) has the prompt looked up over that side's
pool, as a plain request is over its own: the prefill pool's KV events (a prefill engine
stores the prompt's blocks as it computes them), the decode pool's when the decode
engines publish too. After each choice the prompt's blocks count as pending on the
chosen target of each such side, so the next turn of a conversation finds them there.

Under the dispatcher (``proxy/dispatch.py``) a pair is chosen once a decode rank has a
free running slot for the request, in the order of the held (class, tenant, length):
the decode runs a request for all its output, the prefill only for its prompt, so the
decode's running slots are what a full fleet runs out of. Both legs are counted in the
step that takes the slot.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial

from aiohttp import web

from dprouter.core.errors import error
from dprouter.core.types import Incoming, Kind, Role, Side
from dprouter.engines.kvevents.computing import being_computed, wait_computed
from dprouter.engines.kvevents.lookup import Found, Lookup
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.targets import Outstanding, Target
from dprouter.policies import Policy, Prefix, RequestInfo, needs_tokens
from dprouter.proxy.dispatch import HeldTooLong
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
        self.lookup: Lookup | None = None  # a side's policy needs tokens: what targets hold
        # the sides whose policy reads what their targets hold of the prompt
        sides = {"prefill": prefill_policy, "decode": decode_policy}
        self.reads = [side for side in SIDES if needs_tokens(sides[side])]
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
        return await self.parts.tracing.serve(request, kind, self._handle(request, kind))

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        p = self.parts
        started = asyncio.get_running_loop().time()
        client = await read_request(request, kind, p.config, p.metrics)
        if isinstance(client, web.Response):
            return client
        if kind == "generate" and p.config.pd != "sglang":
            return error(404, f"/generate is SGLang's own; this router runs {p.config.pd}")
        pinned: dict[Role, int | None] = {"prefill": client.pinned_prefill, "decode": client.pinned}
        named = p.registry.snapshot.named(
            client.incoming.model, client.incoming.body.get("lora_path")
        )
        pools = await wait_pools(
            request,
            p.registry,
            p.metrics,
            ("prefill", "decode"),
            named,
            p.config.hold_wait,
            pinned=pinned,
            read_versions=p.monitor.read_versions,
        )
        if isinstance(pools, web.Response):
            return pools
        incoming = client.incoming
        p.output.apply(incoming)  # counted by its likely output, not its cap
        call = Call(request, client, started, p)
        info = RequestInfo(
            key=incoming.key,
            text=incoming.text,
            adapter=p.registry.snapshot.adapter(named),  # affinity per adapter, either side
            tokens=incoming.tokens,
            now=started,
        )
        found = await self.find(kind, incoming, pools, started)
        prefixes = {side: f.prefix for side, f in found.items()}
        attempts = p.retry.start()

        async def attempt(left: Pools) -> web.StreamResponse:
            prefills, decodes = left
            chosen = attempts.numbered(info)
            if self.placers and placeable(chosen):
                for side, candidates in zip(SIDES, left, strict=True):
                    if placer := self.placers.get(side):
                        await placer.place(candidates, replace(chosen, pool=(side, incoming.model)))
            model = incoming.model
            started_ns = p.tracing.clock()
            if p.dispatch.active:
                try:
                    prefill, decode = await self.held(call, prefills, decodes, chosen, prefixes)
                except HeldTooLong as exc:
                    p.metrics.rejected.labels("held_too_long").inc()
                    return error(503, str(exc))
            elif self.lock is None:
                prefill, decode = self.pairing.choose(prefills, decodes, chosen, model, prefixes)
            else:
                with self.lock:  # the pair and both counts, in one step for all processes
                    prefill, decode = self.pairing.choose(
                        prefills, decodes, chosen, model, prefixes
                    )
                    tokens = incoming.tokens
                    call.claimed = {
                        "prefill": Outstanding(prefill, tokens).claim(),
                        "decode": Outstanding(
                            decode, tokens, incoming.output, incoming.samples
                        ).claim(),
                    }
            call.attempt = len(attempts.tried)
            self.traced(call, started_ns, (prefills, decodes), (prefill, decode))
            computing = self.computing(found, prefill)
            self.sent(found, {"prefill": prefill, "decode": decode}, started)
            call.last_chance = {
                "prefill": attempts.last_chance(prefills),
                "decode": attempts.last_chance(decodes),
            }
            try:
                if computing and self.lookup is not None:  # another computes its prompt there
                    if "prefill" not in call.claimed:  # counted there while it waits
                        call.claimed["prefill"] = Outstanding(prefill, incoming.tokens).claim()
                    await wait_computed(self.lookup.index, prefill, computing)
                answer = await self.flow(call, prefill, decode)
            finally:
                call.release()
                p.dispatch.freed()  # its decode slot may go to a held request
            attempts.answered(answer, prefill, decode)
            p.metrics.paired(prefill, decode)
            if call.decoding is not None:
                learn(p.output, answer, call.decoding, incoming)
            return answer

        return await attempts.run(pools, attempt, "prefill/decode pair")

    async def held(
        self,
        call: Call,
        prefills: Sequence[Target],
        decodes: Sequence[Target],
        info: RequestInfo,
        prefixes: Mapping[Side, Prefix],
    ) -> tuple[Target, Target]:
        """The pair, chosen under the dispatcher once a decode rank has a free slot for
        the request (at once if one has and nobody waits), both legs claimed in that
        step (under the board lock where there is one); ``HeldTooLong`` if none frees in
        time or the request is shed."""
        incoming = call.incoming

        def pick(free: Sequence[Target]) -> Outstanding:
            prefill, decode = self.pairing.choose(prefills, free, info, incoming.model, prefixes)
            call.claimed["prefill"] = Outstanding(prefill, incoming.tokens).claim()
            return Outstanding(decode, incoming.tokens, incoming.output, incoming.samples)

        pool = ("decode", incoming.model, info.attempt)
        try:
            decoding = await self.parts.dispatch.admit(decodes, incoming, pool, pick)
        except BaseException:
            call.release()  # a prefill claimed as the request left counts no more
            raise
        call.claimed["decode"] = decoding
        return call.claimed["prefill"].target, decoding.target

    def traced(
        self,
        call: Call,
        started_ns: int,
        pools: tuple[Sequence[Target], Sequence[Target]],
        pair: tuple[Target, Target],
    ) -> None:
        """A decision span per side: each side's policy chose its target."""
        tracing = self.parts.tracing
        policies = (self.pairing.prefill.name, self.pairing.decode.name)
        for side, policy, pool, target in zip(SIDES, policies, pools, pair, strict=True):
            counted = call.claimed.get(side)  # several serving processes: counted already
            tracing.decision(
                call.request, started_ns, policy, target, len(pool), call.attempt, side, counted
            )

    async def find(
        self, kind: Kind, incoming: Incoming, pools: Pools, now: float
    ) -> dict[Side, Found]:
        """What each side's targets hold of the prompt, for the sides whose policy reads
        it (a pool none of whose ranks publishes is not even tokenised for)."""
        found: dict[Side, Found] = {}
        if self.lookup is None:
            return found
        for side, pool in zip(SIDES, pools, strict=True):
            if side in self.reads:
                held = await self.lookup.find(kind, incoming, pool, now)
                if held is not None:
                    found[side] = held
        return found

    def computing(self, found: dict[Side, Found], prefill: Target) -> list[int]:
        """The prompt's blocks another request is computing on ``prefill`` now, where its
        engine caches them only once computed (``kvevents/computing.py``): wait for them."""
        held = found.get("prefill")
        if held is None or self.lookup is None:
            return []
        return being_computed(self.lookup.index, held, prefill)

    def sent(self, found: dict[Side, Found], chosen: dict[Side, Target], now: float) -> None:
        """The prompt goes to the chosen pair: its blocks not held there are pending on
        each side that looked them up (the prefill computes them, the decode receives them)."""
        if self.lookup is not None:
            for side, held in found.items():
                self.lookup.sent(held, chosen[side], now)
