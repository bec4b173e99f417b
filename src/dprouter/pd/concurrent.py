"""Both legs at once (SGLang, MoRIIO WRITE), with the prefill leg supervised.

The decode engine waits for the KV the prefill engine writes. If the prefill
leg fails, the decode leg is cancelled (its connection closed, so the engine
drops it) and the pair fails -- no decode is left hanging, no error is lost.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from dprouter.pd.call import Call, PairFailed, cancel
from dprouter.targets import Outstanding, Target

SETTLE = 5.0  # after the decode answered, seconds to let the prefill leg finish


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
            # a streamed prefill reports its failure inside the stream
            if resp.status != 200 or raw.startswith(b'data: {"error"'):
                raise PairFailed("prefill", prefill, f"status_{resp.status}", raw[:200].decode())
        call.metrics.series(prefill).answered(200)

    ptask = asyncio.create_task(prefill_leg())
    with Outstanding(decode, tokens):
        dtask = asyncio.create_task(call.send("decode", decode, decode_body, headers))
        try:
            pending: set[asyncio.Task[Any]] = {ptask, dtask}
            while not dtask.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if ptask in done and ptask.exception() is not None:
                    raise ptask.exception()  # type: ignore[misc]
            upstream: aiohttp.ClientResponse = dtask.result()  # raises if the decode leg failed
        except BaseException:
            await cancel(ptask)
            await cancel(dtask)
            raise
        try:
            return await call.finish(decode, upstream, prefill)
        finally:
            await _settle(call, ptask)


async def _settle(call: Call, task: asyncio.Task[None]) -> None:
    """The answer is out; give the prefill leg a moment to finish, then stop it."""
    done, _ = await asyncio.wait({task}, timeout=SETTLE)
    if not done:
        await cancel(task)
    elif not task.cancelled() and isinstance(failure := task.exception(), PairFailed):
        call.metrics.series(failure.target).failed(failure.cause)  # late, but counted
