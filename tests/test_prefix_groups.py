"""A GRPO group through the router (--policy prefix) over a simulated DP4 engine that
publishes its KV events: the samples of one prompt, sent together, compute it once per
rank they land on -- on SGLang too, which caches a prefix only once computed, because
the router holds a sample sent where its prompt is being computed until the rank's
events store it."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from dprouter.core.tokenizer import ModelTokenizer
from tests.conftest import StartCluster, StartRouter
from tests.test_kv_routing import BLOCK, engine, prefix_config, send, spec, words

SAMPLES = 8


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_group_computes_its_prompt_once_per_rank_it_reaches(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    persona: str,
) -> None:
    cluster = await start_cluster([engine(persona, tokenizer_dir)])
    server = cluster[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    tok = ModelTokenizer(tokenizer_dir)
    # the ranks size their blocks with their first events: one short prompt each
    for rank in range(4):
        await send(http, server.url, {"prompt": words(90 + rank, 40)}, rank)
    await asyncio.sleep(0.3)
    prompt = words(7, 1500)  # ~4,900 tokens: most of a prefill step's budget
    full = (len(tok.encode(prompt)) - 1) // BLOCK * BLOCK
    answers = await asyncio.gather(
        *(send(http, router.url, {"prompt": prompt}) for _ in range(SAMPLES))
    )
    ranks = Counter(a["rank"] for a in answers)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    computed = sum(c < full for c in cached)
    assert len(ranks) >= 2, ranks  # spread, not piled on one rank
    assert computed == len(ranks), (ranks, cached)  # once per rank: the rest hit it
