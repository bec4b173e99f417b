"""Per-rank load as the engines report it: vLLM ``/metrics``, SGLang ``/v1/loads``.

Per rank, two numbers: requests running + waiting, and tokens. The tokens are
what the engine itself counts, read from the series each engine exports:
- vLLM: ``vllm:kv_cache_usage_perc`` (a fraction, per ``engine`` label) times
  the engine's KV capacity, ``num_gpu_blocks`` x ``block_size`` from the labels
  of ``vllm:cache_config_info`` (vLLM's ``v1/metrics/loggers.py``): the KV-cache
  tokens the rank holds. vLLM exports no count of queued prompt tokens.
- SGLang (``/v1/loads``, ``managers/load_snapshot.py``): ``num_used_tokens``
  (KV-cache tokens held) + ``num_waiting_uncached_tokens`` (prompt tokens queued
  that are not cached yet: work the rank has ahead).
An engine that exports neither reports 0 tokens: the router's own count stands.

And per rank, its running cap: the requests it runs at once, for the dispatcher.
SGLang reports it per rank in ``/v1/loads`` (``max_running_requests``, the
engine's ``--max-running-requests`` over its DP ranks); vLLM exports no
``max_num_seqs``, so its caps are unknown (0) unless ``--dispatch-slots`` says.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from dprouter.fleet.targets import Worker

VLLM_REQUESTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # now, and before v1
VLLM_CACHE = "vllm:cache_config_info"
Load = tuple[int, int]  # requests running + waiting, tokens


def vllm_loads(text: str) -> dict[int, Load]:
    """Per ``engine`` label of a vLLM ``/metrics`` text: requests and KV tokens."""
    return vllm_read(text)[0]


def vllm_read(text: str) -> tuple[dict[int, Load], dict[int, int]]:
    """Per ``engine`` label of a vLLM ``/metrics`` text: requests and KV tokens, and the
    tokens its KV cache holds at most."""
    requests: dict[int, float] = {}
    usage: dict[int, float] = {}
    capacity: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = s.labels.get("engine")
            if label is None or not label.isdigit():
                continue
            engine = int(label)
            if s.name in VLLM_REQUESTS:
                requests[engine] = requests.get(engine, 0.0) + s.value
            elif s.name in VLLM_USAGE:
                usage[engine] = s.value
            elif s.name == VLLM_CACHE:
                blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    capacity[engine] = float(blocks) * float(size)
    engines = requests.keys() | usage.keys()
    loads = {
        e: (int(requests.get(e, 0)), round(usage.get(e, 0.0) * capacity.get(e, 0.0)))
        for e in engines
    }
    return loads, {e: int(c) for e, c in capacity.items()}


def sglang_load(entry: Mapping[str, object]) -> Load:
    def count(name: str) -> int:
        value = entry.get(name, 0)
        return int(value) if isinstance(value, int | float) else 0

    requests = count("num_running_reqs") + count("num_waiting_reqs")
    return requests, count("num_used_tokens") + count("num_waiting_uncached_tokens")


def sglang_kv(entry: Mapping[str, object]) -> int:
    """A rank's KV capacity in tokens (``max_total_num_tokens``); 0: it does not say."""
    value = entry.get("max_total_num_tokens", 0)
    return int(value) if isinstance(value, int | float) and value > 0 else 0


def sglang_cap(entry: Mapping[str, object]) -> int:
    value = entry.get("max_running_requests", 0)
    return int(value) if isinstance(value, int | float) and value > 0 else 0


async def scrape(session: aiohttp.ClientSession, worker: Worker) -> dict[int, Load]:
    """Requests running + waiting, and tokens, per local rank, as the engine reports them."""
    return (await read(session, worker))[0]


# loads, running caps, KV capacities (tokens), per local rank
Reading = tuple[dict[int, Load], dict[int, int], dict[int, int]]


async def read(session: aiohttp.ClientSession, worker: Worker) -> Reading:
    """``scrape``'s loads, and each local rank's running cap and KV capacity in tokens,
    where the engine says."""
    if worker.dialect == "vllm":
        async with session.get(worker.url + "/metrics") as r:
            r.raise_for_status()
            per_engine, kv = vllm_read(await r.text())
        offset = worker.rank_offset or 0
        loads = {label - offset: value for label, value in per_engine.items()}
        return loads, {}, {label - offset: value for label, value in kv.items()}
    async with session.get(worker.url + "/v1/loads") as r:
        if r.status == 200:
            loads = orjson.loads(await r.read()).get("loads", [])
            by_rank = {int(x["dp_rank"]): x for x in loads}
            caps = {rank: sglang_cap(x) for rank, x in by_rank.items()}
            kv = {rank: sglang_kv(x) for rank, x in by_rank.items()}
            return {rank: sglang_load(x) for rank, x in by_rank.items()}, caps, kv
    async with session.get(worker.url + "/get_load") as r:  # older SGLang: no tokens
        r.raise_for_status()
        loads = orjson.loads(await r.read())
        return {int(x["dp_rank"]): (int(x["num_reqs"]), 0) for x in loads}, {}, {}


def assign(
    worker: Worker,
    per_rank: dict[int, Load],
    caps: Mapping[int, int] | None = None,
    kv: Mapping[int, int] | None = None,
) -> None:
    """Write the reports on the board: each rank's, and the whole worker's (the sum); and
    each target's running cap (a target that is the whole worker: the ranks' sum, known
    only when every rank's is) and KV capacity in tokens (the whole worker's: the
    ranks' sum)."""
    whole = (sum(r for r, _ in per_rank.values()), sum(t for _, t in per_rank.values()))
    caps = caps or {}
    every = sum(caps.values()) if caps and all(caps.values()) else 0
    kv = kv or {}
    total = sum(kv.values())
    for t in worker.targets:
        t.report(*(whole if t.rank is None else per_rank.get(t.rank, (0, 0))))
        t.board.set_cap(t.slot, every if t.rank is None else caps.get(t.rank, 0))
        t.board.set_kv(t.slot, total if t.rank is None else kv.get(t.rank, 0))
    if worker.board is not None and worker.slot >= 0:
        worker.board.report(worker.slot, *whole)
