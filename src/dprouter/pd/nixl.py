"""vLLM with the NIXL connector: prefill first, then decode with what the prefill said."""

from __future__ import annotations

from aiohttp import web

from dprouter.pd import wire
from dprouter.pd.call import Call, PairFailed
from dprouter.targets import Outstanding, Target


async def run(call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
    tokens = call.incoming.tokens
    with Outstanding(prefill, tokens):
        resp = await call.send("prefill", prefill, wire.nixl_prefill(call.body))
        if resp.status != 200:  # the request itself is wrong: the client hears the engine
            return await call.finish(prefill, resp, prefill)
        answer = await call.prefill_answer(prefill, resp)
    call.metrics.series(prefill).answered(200)
    kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        raise PairFailed("prefill", prefill, "no_kv", "answered without kv_transfer_params")
    with Outstanding(decode, tokens):
        upstream = await call.send("decode", decode, wire.nixl_decode(call.body, kv))
        return await call.finish(decode, upstream, prefill)
