"""SGLang: the same body to prefill and decode at once, meeting on a bootstrap room."""

from __future__ import annotations

import random

from aiohttp import web

from dprouter.pd import wire
from dprouter.pd.call import Call
from dprouter.pd.concurrent import run_both
from dprouter.targets import Target


async def run(
    call: Call, prefill: Target, decode: Target, rng: random.Random
) -> web.StreamResponse:
    room = wire.sglang_rooms(call.body, prefill, rng)
    prefill_body, decode_body = wire.sglang_bodies(call.body, prefill, decode, room)
    return await run_both(call, prefill, decode, prefill_body, decode_body, {})
