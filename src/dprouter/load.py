"""Per-rank load as the engines report it: vLLM ``/metrics``, SGLang ``/v1/loads``."""

from __future__ import annotations

import aiohttp
import orjson

from dprouter.discovery import engine_series
from dprouter.targets import Worker

VLLM_LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting")


async def scrape(session: aiohttp.ClientSession, worker: Worker) -> dict[int, int]:
    """Running + waiting requests per local rank, as the engine reports them."""
    if worker.dialect == "vllm":
        async with session.get(worker.url + "/metrics") as r:
            r.raise_for_status()
            series = engine_series(await r.text())
        offset = worker.rank_offset or 0
        out: dict[int, int] = {}
        for name in VLLM_LOAD:
            for label, value in series.get(name, {}).items():
                out[label - offset] = out.get(label - offset, 0) + int(value)
        return out
    async with session.get(worker.url + "/v1/loads") as r:
        if r.status == 200:
            loads = orjson.loads(await r.read()).get("loads", [])
            return {
                int(x["dp_rank"]): int(x["num_running_reqs"]) + int(x["num_waiting_reqs"])
                for x in loads
            }
    async with session.get(worker.url + "/get_load") as r:  # older SGLang
        r.raise_for_status()
        return {int(x["dp_rank"]): int(x["num_reqs"]) for x in orjson.loads(await r.read())}


def assign(worker: Worker, per_rank: dict[int, int]) -> None:
    for t in worker.targets:
        t.reported = sum(per_rank.values()) if t.rank is None else per_rank.get(t.rank, 0)
