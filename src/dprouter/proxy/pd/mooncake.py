"""vLLM with the Mooncake connector: both legs at once, meeting on a router-made transfer id.

The decode pulls the KV from the engine the router names (``remote_engine_id``), so the
router must know which engine id each prefill rank has: the prefill's bootstrap server
lists them (``GET /query``, served by its DP rank 0). A restarted engine has new ids, and
a decode given a stale one fails the request (vLLM 0.32's ``kv_load_failure_policy`` is
``fail`` by default), so the ids are asked once per prefill worker and asked again after
``FRESH`` seconds or after either leg of a pair with that prefill failed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref

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
Engines = dict[int, str]  # a prefill worker's engine id per DP rank


class Mooncake:
    """The flow, with what it learnt of each prefill worker's engine ids."""

    def __init__(self) -> None:
        # weak: a worker the fleet dropped takes its entry with it
        self.engines: weakref.WeakKeyDictionary[Worker, tuple[float, Engines]] = (
            weakref.WeakKeyDictionary()
        )
        # one ask per worker at a time, whoever waits for it
        self.asking: weakref.WeakKeyDictionary[Worker, asyncio.Task[Engines]] = (
            weakref.WeakKeyDictionary()
        )

    async def engine_id(self, call: Call, prefill: Target, bootstrap: str) -> str:
        worker, rank = prefill.worker, prefill.rank or 0  # a one-rank worker lists rank 0
        known = self.engines.get(worker)
        if known is None or time.monotonic() - known[0] > FRESH or rank not in known[1]:
            task = self.asking.get(worker)
            if task is None:
                task = asyncio.create_task(self.ask(call, prefill, bootstrap))
                self.asking[worker] = task
                task.add_done_callback(lambda _: self.asking.pop(worker, None))
            known = (time.monotonic(), await asyncio.shield(task))
            self.engines[worker] = known
        engine = known[1].get(rank)
        if engine is None:
            why = f"{bootstrap}/query lists ranks {sorted(known[1])}, not {rank}"
            raise Failed(prefill, "no_engine_id", why, "prefill")
        return engine

    async def ask(self, call: Call, prefill: Target, bootstrap: str) -> Engines:
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
        except Failed:
            # the prefill may have restarted (a decode pulling from a stale engine id fails
            # too): ask again before the next pair with it
            self.engines.pop(prefill.worker, None)
            raise
