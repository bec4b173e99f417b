"""A GRPO group -- 8 samples of one ~1,000-token prompt, sent together -- on the real
engines, counted by the engines themselves: the prompt is computed once per rank the
group reaches, the other samples hit it (tests/test_prefix_groups.py is the simulated
version).

- vLLM caches a block when it schedules it, so a sample scheduled after another, even in
  the same step, hits it: pinned to ranks straight at the engine, no router needed.
- SGLang caches a prompt once it is computed, so samples batched together compute it
  again; dprouter (``--policy prefix`` on the engine's KV events) holds a sample sent
  where its prompt is pending until the rank's events store it
  (``dprouter.engines.kvevents.computing``).

Each engine runs under ``/tmp/dprouter-real-engine.lock`` (one real engine on the
machine at a time), waiting for another run's engine to stop first.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from e2e.sglang import server as sglang_server

from dprouter.bench.scenarios.makespan import engine_lock
from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from e2e import vllm_server
from tests.conftest import StartRouter
from tests.e2e.conftest import SUMMARY
from tests.e2e.test_real_vllm import engine_counts, settle_counts

# the lock may be held by another run's engine for ~20 minutes; then ~1.5 min to start
pytestmark = pytest.mark.timeout(1800)
LOCK_WAIT = 1500.0  # seconds
SAMPLES = 8
PROMPT = 1000  # tokens: half the tiny models' 2,048 positions
FIRST_ID = 4  # past the tiny tokenizers' special tokens (<s> </s> <pad> <unk>)
ROUNDS = 3  # of a group alone and two at once, through the router and straight
PAGE = 16  # SGLang --page-size: its KV events come one page a block (1 by default)


def group_prompt(seed: int, vocabulary: int) -> list[int]:
    """Token ids no other prompt here starts with (ids, as RL frameworks send them)."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, vocabulary) for _ in range(PROMPT)]


@pytest.fixture
def vllm_engine() -> Iterator[vllm_server.VllmServer]:
    """vLLM DP=2 with its prefix cache (on by default; said anyway) at its CPU block size."""
    server = vllm_server.VllmServer(
        vllm_server.free_port(), dp_size=2, extra_args=("--enable-prefix-caching",)
    )
    with engine_lock(LOCK_WAIT), server:
        server.wait_ready()
        yield server


async def block_sizes(http: aiohttp.ClientSession, url: str) -> set[int]:
    """The engines' KV block size, as ``vllm:cache_config_info`` labels it per engine."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {
        int(line.split('block_size="')[1].split('"')[0])
        for line in text.splitlines()
        if line.startswith("vllm:cache_config_info{")
    }


@pytest.mark.realvllm
async def test_vllm_computes_a_groups_prompt_once_per_rank_it_reaches(
    vllm_engine: vllm_server.VllmServer, http: aiohttp.ClientSession
) -> None:
    """Measured (the same in 3 runs): block size 128 on CPU; 8 samples on rank 0 hit
    6,272 = 7 x 896 of their 8,000 prompt tokens, 4 + 4 over both ranks 2,688 = 3 x 896
    of 4,000 on each: the prompt's 7 whole blocks (the last token is always computed)
    computed once per rank, hit by every later sample."""
    url = vllm_engine.url
    (block,) = await block_sizes(http, url)
    whole = (PROMPT - 1) // block * block  # what a sample after the first hits
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"

    async def group(seed: int, ranks: list[int]) -> tuple[Counter[str], Counter[str]]:
        """The group's samples pinned to ``ranks``; the hits and queries each rank counted."""
        body = {"model": "tiny", "prompt": group_prompt(seed, 2048), "max_tokens": 2}

        async def sample(rank: int) -> None:
            headers = {"X-data-parallel-rank": str(rank)}
            async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()

        hit0, asked0 = await engine_counts(http, url, hits), await engine_counts(http, url, queries)
        await asyncio.gather(*(sample(r) for r in ranks))
        asked = await settle_counts(http, url, queries, sum(asked0.values()) + SAMPLES * PROMPT)
        hit = await engine_counts(http, url, hits)
        return hit - hit0, asked - asked0

    one = await group(1, [0] * SAMPLES)
    spread = await group(2, [0, 1] * (SAMPLES // 2))
    SUMMARY.append(
        f"vLLM group of {SAMPLES} x {PROMPT} tokens, block {block}: on rank 0 hits "
        f"{dict(one[0])} of {dict(one[1])}; 4+4 hits {dict(spread[0])} of {dict(spread[1])}"
    )
    assert one == (Counter({"0": (SAMPLES - 1) * whole}), Counter({"0": SAMPLES * PROMPT}))
    each = SAMPLES // 2
    assert spread == (
        Counter({"0": (each - 1) * whole, "1": (each - 1) * whole}),
        Counter({"0": each * PROMPT, "1": each * PROMPT}),
    )


class EventsSglang(sglang_server.SglangServer):
    """``--dp-size 2`` (the tiny Llama) with PAGE-token pages and a KV-event publisher per
    rank on loopback: rank r on events + r, its replay on replay + r."""

    def __init__(self, port: int, events: int, replay: int) -> None:
        config = {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "bind": True,  # SGLang connects to a concrete host unless told to bind it
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv",
        }
        extra = ("--page-size", str(PAGE), "--kv-events-config", json.dumps(config))
        super().__init__(port, dp_size=2, extra_args=extra)
        self.events, self.replay = events, replay


@pytest.fixture
def sglang_engine() -> Iterator[EventsSglang]:
    port = sglang_server.free_port()
    events = sglang_server.free_port(2, avoid=range(port, port + 1))
    replay = sglang_server.free_port(2, avoid=range(events, events + 2))
    with engine_lock(LOCK_WAIT), EventsSglang(port, events, replay) as server:
        server.wait_ready()
        yield server


@pytest.mark.realsglang
async def test_sglang_computes_a_groups_prompt_once_per_rank_through_the_router(
    sglang_engine: EventsSglang,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """Groups of 8 samples, one at a time and two at once, each through the router with
    its hold, then the same sent straight to the engine on the ranks the router chose:
    through the router each group computes its prompt once per rank it reaches, every
    time; straight to the engine, more often.

    Measured: through the router, once per rank in every group (29 of 4 earlier runs,
    9 of this one); straight to the engine, each rank's samples in one batch, 2 to 6 a
    group, 39 in a run's 9 groups against the 17 ranks they reached. A rank given one
    sample computes it once either way, so only the total is asserted for the engine
    alone."""
    spec = WorkerSpec(
        sglang_engine.url,
        kv_events=f"tcp://127.0.0.1:{sglang_engine.events}",
        kv_replay=f"tcp://127.0.0.1:{sglang_engine.replay}",
        kv_block_size=PAGE,
    )
    tokenizer = str(sglang_server.model_dir())
    config = RouterConfig(
        workers=(spec,), policy="prefix", tokenizers=(tokenizer,), health_interval=0, seed=1
    )
    for rank in (0, 1):  # a rank's first long prefill takes seconds (3.5 s measured)
        warm: dict[str, Any] = {"input_ids": group_prompt(rank, 1024), "routed_dp_rank": rank}
        warm["sampling_params"] = {"max_new_tokens": 1}
        async with http.post(sglang_engine.url + "/generate", json=warm) as r:
            assert r.status == 200, await r.text()
    router = await start_router(config)
    whole = (PROMPT - 1) // PAGE * PAGE  # SGLang leaves the last token to compute too

    async def groups(seeds: list[int]) -> list[tuple[Counter[str], list[int], list[str]]]:
        """The groups, all at once, through the router: per group, the targets it chose,
        each sample's cached tokens as the engine counted them, and each one's target."""

        async def sample(ids: list[int]) -> tuple[str, int]:
            body: dict[str, Any] = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            }
            async with http.post(router.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                meta = (await r.json())["meta_info"]
                target = r.headers["x-dprouter-target"]
            assert target == f"w0/{meta['dp_rank']}", (target, meta)
            assert meta["prompt_tokens"] == PROMPT
            return target, int(meta["cached_tokens"])

        prompts = [group_prompt(seed, 1024) for seed in seeds]
        answers = await asyncio.gather(*(sample(p) for p in prompts for _ in range(SAMPLES)))
        out = []
        for g in range(len(seeds)):
            mine = answers[g * SAMPLES : (g + 1) * SAMPLES]
            out.append((Counter(t for t, _ in mine), [c for _, c in mine], [t for t, _ in mine]))
        return out

    async def direct(seed: int, ranks: list[str]) -> tuple[Counter[str], list[int]]:
        """A group straight to the engine on the ranks the router's group before it took
        (``w0/R``), each rank's samples in one batch request: they reach its scheduler
        together, as samples a router sends at once can, and no router holds any."""
        reached = Counter(ranks)

        async def batch(target: str, n: int) -> list[int]:
            body: dict[str, Any] = {
                "input_ids": [group_prompt(seed, 1024)] * n,
                "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                "routed_dp_rank": int(target.rsplit("/", 1)[1]),
            }
            async with http.post(sglang_engine.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return [int(a["meta_info"]["cached_tokens"]) for a in await r.json()]

        cached = await asyncio.gather(*(batch(t, n) for t, n in reached.items()))
        return reached, [c for each in cached for c in each]

    found: dict[str, list[tuple[int, int]]] = {}  # (ranks reached, samples that computed)
    seed = 10
    for _round in range(ROUNDS):
        for at_once in (1, 2):
            result = await groups(list(range(seed, seed + at_once)))
            seed += at_once
            alone = [await direct(seed + g, targets) for g, (_, _, targets) in enumerate(result)]
            seed += at_once
            for name, runs in (("held", result), ("straight to the engine", alone)):
                for ranks, cached, *_ in runs:
                    key = f"{at_once} at once, {name}"
                    found.setdefault(key, []).append((len(ranks), sum(c < whole for c in cached)))
    SUMMARY.append(
        f"SGLang groups of {SAMPLES} x {PROMPT} tokens through the router, "
        f"(ranks reached, samples that computed the prompt): {found}"
    )
    extra = {held: 0 for held in (True, False)}  # computations beyond one per rank reached
    for key, seen in found.items():
        extra[key.endswith(", held")] += sum(computed - ranks for ranks, computed in seen)
    assert extra[True] == 0, found
    assert extra[False] > 0, found
