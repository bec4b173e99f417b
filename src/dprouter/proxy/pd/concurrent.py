"""Both legs at once (SGLang, MoRIIO WRITE), with the prefill leg supervised.

The decode engine waits for the KV the prefill engine writes. Nothing of the
decode's answer reaches the client before the prefill leg has succeeded: a
real decode engine answers its headers at once and only then waits for the
KV, so an answer that started is no proof the prefill worked. If the prefill
leg fails, the decode leg is cancelled (its connection closed, so the engine
drops it) and the pair fails -- no decode left hanging, no error lost. A
prefill answer the attempt rules do not retry (a request the engine refuses, or
any answer on the last chance) reaches the client as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from dprouter.core.errors import Answered, Failed
from dprouter.fleet.targets import Target
from dprouter.proxy.pd.call import Call, cancel


async def run_both(
    call: Call,
    prefill: Target,
    decode: Target,
    prefill_body: dict[str, Any],
    decode_body: dict[str, Any],
    headers: dict[str, str],
) -> web.StreamResponse:
    async def prefill_leg() -> None:
        with call.count("prefill", prefill), call.leg("prefill", prefill) as span:
            resp = await call.send("prefill", prefill, prefill_body, headers, span)
            raw = await call.drain(prefill, resp)
            if resp.status != 200:
                raise Answered(resp.status, raw, resp.headers.get("Content-Type", ""))
            if raw.startswith(b'data: {"error"'):  # a streamed prefill fails inside the stream
                text = raw[:200].decode(errors="replace")
                raise Failed(prefill, "error_event", text, "prefill")
        call.metrics.series(prefill).answered(200)

    ptask = asyncio.create_task(prefill_leg())
    with call.count("decode", decode), call.leg("decode", decode) as span:
        dtask = asyncio.create_task(call.send("decode", decode, decode_body, headers, span))
        try:
            await asyncio.wait({ptask, dtask}, return_when=asyncio.FIRST_EXCEPTION)
            if ptask.done() and (failure := ptask.exception()) is not None:
                raise failure
            upstream: aiohttp.ClientResponse = dtask.result()  # raises if the decode leg failed
        except Answered as answered:
            await cancel(dtask)
            call.metrics.series(prefill).answered(answered.status)
            return answered.response()
        except BaseException:
            await cancel(ptask)
            await cancel(dtask)
            raise
        return await call.finish(decode, upstream, prefill, span)
