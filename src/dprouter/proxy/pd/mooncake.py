"""vLLM with the Mooncake connector: both legs at once, meeting on a router-made transfer id.

The decode pulls the KV from the engine the router names (``remote_engine_id``), so the
router must know which engine id each prefill rank has: the prefill's bootstrap server
lists them (``GET /query``, served by its DP rank 0). They are asked once per prefill
worker and asked again after ``FRESH`` seconds or after that prefill failed a leg (a
restarted engine has new ids; a decode given a stale one would recompute the prompt).
"""

from __future__ import annotations

import time
import uuid

import aiohttp
import orjson
from aiohttp import web

from dprouter.core.errors import Failed
from dprouter.engines import pd_wire
from dprouter.fleet.targets import Target, Worker
from dprouter.proxy.pd.call import Call
from dprouter.proxy.pd.concurrent import run_both

FRESH = 30.0  # seconds an engine-id list is used before it is asked again
QUERY_TIMEOUT = aiohttp.ClientTimeout(total=10)


class Mooncake:
    """The flow, with what it learnt of each prefill worker's engine ids."""

    def __init__(self) -> None:
        self.engines: dict[Worker, tuple[float, dict[int, str]]] = {}

    async def engine_id(self, call: Call, prefill: Target, bootstrap: str) -> str:
        worker, now = prefill.worker, time.monotonic()
        known = self.engines.get(worker)
        if known is None or now - known[0] > FRESH or (prefill.rank or 0) not in known[1]:
            known = (now, await self.ask(call, prefill, bootstrap))
            self.engines[worker] = known
        engine = known[1].get(prefill.rank or 0)
        if engine is None:
            ranks = sorted(known[1])
            why = f"{bootstrap}/query lists ranks {ranks}, not {prefill.rank or 0}"
            raise Failed(prefill, "no_engine_id", why, "prefill")
        return engine

    async def ask(self, call: Call, prefill: Target, bootstrap: str) -> dict[int, str]:
        session = call.parts.upstream.session
        try:
            async with session.get(bootstrap + "/query", timeout=QUERY_TIMEOUT) as r:
                raw = await r.read()
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}: {raw[:80]!r}")
            return pd_wire.mooncake_engines(orjson.loads(raw))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            why = f"its bootstrap server {bootstrap} did not list its engines: {exc}"
            raise Failed(prefill, "no_engine_id", why, "prefill") from exc

    async def run(self, call: Call, prefill: Target, decode: Target) -> web.StreamResponse:
        bootstrap = pd_wire.mooncake_bootstrap(prefill)
        engine = await self.engine_id(call, prefill, bootstrap)
        transfer_id = f"tx-{uuid.uuid4().hex}"
        prefill_body = pd_wire.mooncake_prefill(call.body, transfer_id)
        decode_body = pd_wire.mooncake_decode(call.body, transfer_id, engine, bootstrap)
        try:
            return await run_both(call, prefill, decode, prefill_body, decode_body, {})
        except Failed as failure:
            if failure.side == "prefill":
                self.engines.pop(prefill.worker, None)  # ask again: it may have restarted
            raise
