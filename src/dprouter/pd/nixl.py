"""vLLM with the NIXL connector: prefill first, then decode with what the prefill said."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from dprouter.pd import wire
from dprouter.pd.call import Call
from dprouter.pd.sequential import run_in_turn
from dprouter.targets import Target


async def run(call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
    prefill_body = wire.nixl_prefill(call.body)
    return await run_in_turn(
        call, prefill, decode, prefill_body, partial(wire.nixl_decode, call.body), {}
    )
