"""vLLM with the NIXL connector: prefill first, then decode with what the prefill said."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from dprouter.engines import pd_wire
from dprouter.fleet.targets import Target
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.sequential import run_in_turn


async def run(call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
    prefill_body = pd_wire.nixl_prefill(call.body)
    return await run_in_turn(
        call, prefill, decode, prefill_body, partial(pd_wire.nixl_decode, call.body), {}
    )
