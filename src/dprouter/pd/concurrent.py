"""Both legs at once (SGLang, MoRIIO WRITE), with the prefill leg supervised.

The decode engine waits for the KV the prefill engine writes. Nothing of the
decode's answer reaches the client before the prefill leg has succeeded: a
real decode engine answers its headers at once and only then waits for the
KV, so an answer that started is no proof the prefill worked. If the prefill
leg fails, the decode leg is cancelled (its connection closed, so the engine
drops it) and the pair fails -- no decode left hanging, no error lost. A
prefill that refuses the request itself (a 4xx other than 408/429) answers
the client directly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from dprouter.pd.call import Call, PairFailed, Refused, cancel
from dprouter.targets import Outstanding, Target


async def run_both(
    call: Call,
    prefill: Target,
    decode: Target,
    prefill_body: dict[str, Any],
    decode_body: dict[str, Any],
    headers: dict[str, str],
) -> web.StreamResponse:
    tokens = call.incoming.tokens

    async def prefill_leg() -> None:
        with Outstanding(prefill, tokens):
            resp = await call.send("prefill", prefill, prefill_body, headers)
            raw = await call.drain(prefill, resp)
            if 400 <= resp.status < 500:
                raise Refused(resp.status, raw, resp.headers.get("Content-Type", ""))
            # a streamed prefill reports its failure inside the stream
            if resp.status != 200 or raw.startswith(b'data: {"error"'):
                text = raw[:200].decode(errors="replace")
                raise PairFailed("prefill", prefill, f"status_{resp.status}", text)
        call.metrics.series(prefill).answered(200)

    ptask = asyncio.create_task(prefill_leg())
    with Outstanding(decode, tokens):
        dtask = asyncio.create_task(call.send("decode", decode, decode_body, headers))
        try:
            await asyncio.wait({ptask, dtask}, return_when=asyncio.FIRST_EXCEPTION)
            if ptask.done() and (failure := ptask.exception()) is not None:
                raise failure
            upstream: aiohttp.ClientResponse = dtask.result()  # raises if the decode leg failed
        except Refused as refused:
            await cancel(dtask)
            call.metrics.series(prefill).answered(refused.status)
            return refused.response()
        except BaseException:
            await cancel(ptask)
            await cancel(dtask)
            raise
        return await call.finish(decode, upstream, prefill)
