"""SGLang: the same body to prefill and decode at once, meeting on a bootstrap room."""

from __future__ import annotations

import random

from aiohttp import web

from dprouter.cancel import ensure_rid
from dprouter.pd import wire
from dprouter.pd.call import Call
from dprouter.pd.concurrent import run_both
from dprouter.targets import Target


async def run(
    call: Call, prefill: Target, decode: Target, rng: random.Random
) -> web.StreamResponse:
    body = dict(call.body)
    rid, _ = ensure_rid(body)  # both legs carry it: a client that leaves aborts both
    room = wire.sglang_rooms(body, prefill, rng)
    prefill_body, decode_body = wire.sglang_bodies(body, prefill, decode, room)
    with call.aborter.on_cancel(prefill.worker, rid), call.aborter.on_cancel(decode.worker, rid):
        return await run_both(call, prefill, decode, prefill_body, decode_body, {})
