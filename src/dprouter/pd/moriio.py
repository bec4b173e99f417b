"""vLLM with the MoRIIO connector: READ runs prefill then decode, WRITE runs both at once."""

from __future__ import annotations

import uuid

from aiohttp import web

from dprouter.pd import wire
from dprouter.pd.call import Call, PairFailed
from dprouter.pd.concurrent import run_both
from dprouter.targets import Outstanding, Target


async def run(call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
    transfer_id = f"tx-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": wire.moriio_request_id(prefill, decode)}
    prefill_body = wire.moriio_prefill(call.body, transfer_id, decode)
    if prefill.worker.transfer_mode == "WRITE":
        decode_body = wire.moriio_decode(call.body, transfer_id, prefill, None)
        return await run_both(call, prefill, decode, prefill_body, decode_body, headers)
    tokens = call.incoming.tokens
    with Outstanding(prefill, tokens):
        resp = await call.send("prefill", prefill, prefill_body, headers)
        if resp.status != 200:
            return await call.finish(prefill, resp, prefill)
        answer = await call.prefill_answer(prefill, resp)
    call.metrics.series(prefill).answered(200)
    kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        raise PairFailed("prefill", prefill, "no_kv", "answered without kv_transfer_params")
    with Outstanding(decode, tokens):
        decode_body = wire.moriio_decode(call.body, transfer_id, prefill, kv)
        upstream = await call.send("decode", decode, decode_body, headers)
        return await call.finish(decode, upstream, prefill)
