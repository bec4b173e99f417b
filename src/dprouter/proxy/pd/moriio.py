"""vLLM with the MoRIIO connector: READ runs prefill then decode, WRITE runs both at once."""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from dprouter.engines import pd_wire
from dprouter.fleet.targets import Target
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.concurrent import run_both
from dprouter.proxy.pd.sequential import run_in_turn


async def run(call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
    transfer_id = f"tx-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": pd_wire.moriio_request_id(prefill, decode)}
    prefill_body = pd_wire.moriio_prefill(call.body, transfer_id, decode)
    if prefill.worker.transfer_mode == "WRITE":
        decode_body = pd_wire.moriio_decode(call.body, transfer_id, prefill, None)
        return await run_both(call, prefill, decode, prefill_body, decode_body, headers)

    def decode_body_from(kv: dict[str, Any]) -> dict[str, Any]:
        return pd_wire.moriio_decode(call.body, transfer_id, prefill, kv)

    return await run_in_turn(call, prefill, decode, prefill_body, decode_body_from, headers)
