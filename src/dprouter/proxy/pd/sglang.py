"""SGLang: the same body to prefill and decode at once, meeting on a bootstrap room."""

from __future__ import annotations

import random

from aiohttp import web

from dprouter.engines import dialects, pd_wire
from dprouter.fleet.targets import Target
from dprouter.proxy.abort import ensure_rid
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.concurrent import run_both


async def run(
    call: Call, prefill: Target, decode: Target, rng: random.Random
) -> web.StreamResponse:
    body = dict(call.body)
    rid, _ = ensure_rid(body)  # both legs carry it: a client that leaves aborts both
    room = pd_wire.sglang_rooms(body, prefill, rng)
    prefill_body, decode_body = pd_wire.sglang_bodies(body, prefill, room)
    # the decode fetches from that rank; the prefill must be told it too: without it a
    # plain-DP prefill checks the room against its attention rank (0 on every replica)
    # and refuses every room that implies another (SGLang 0.5.23, real-pd-cpu.md)
    dialects.write_prefill_rank(prefill.rank, prefill_body)
    dialects.write_prefill_rank(prefill.rank, decode_body)  # each leg's own: ``Call.send``
    with call.aborter.on_cancel(prefill.worker, rid), call.aborter.on_cancel(decode.worker, rid):
        return await run_both(call, prefill, decode, prefill_body, decode_body, {})
