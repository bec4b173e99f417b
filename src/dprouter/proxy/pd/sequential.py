"""Prefill, then decode with what the prefill answered (vLLM NIXL, MoRIIO READ)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from dprouter.core.errors import Failed
from dprouter.fleet.targets import Target
from dprouter.proxy.pd.call import Call

DecodeBody = Callable[[dict[str, Any]], dict[str, Any]]  # the prefill's kv_transfer_params in


async def run_in_turn(
    call: Call,
    prefill: Target,
    decode: Target,
    prefill_body: dict[str, Any],
    decode_body: DecodeBody,
    headers: dict[str, str],
) -> web.StreamResponse:
    with call.count("prefill", prefill), call.leg("prefill", prefill) as span:
        resp = await call.send("prefill", prefill, prefill_body, headers, span)
        if resp.status != 200:  # not retried (see attempts): the client hears the engine
            return await call.finish(prefill, resp, prefill, span)
        answer = await call.prefill_answer(prefill, resp)
        call.metrics.series(prefill).answered(200)
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):  # the leg's failure, in its span
            raise Failed(prefill, "no_kv", "answered without kv_transfer_params", "prefill")
    with call.count("decode", decode), call.leg("decode", decode) as span:
        upstream = await call.send("decode", decode, decode_body(kv), headers, span)
        return await call.finish(decode, upstream, prefill, span)
