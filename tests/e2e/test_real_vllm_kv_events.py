"""A real vLLM (CPU build, tiny model, DP=2) publishing KV-cache events: what the router's
prefix routing relies on, checked against the engine itself.

The router tokenises prompts with the model's own files (``dprouter.core.tokenizer``) and keys
the engine's cached blocks by the token ids the events carry; both only work if the ids
are exactly the engine's. Its own module: the engine starts after the other vLLM modules'
servers have stopped (two at once would share the machine's two cores).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from dprouter.config import RouterConfig
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.fleet.worker_spec import WorkerSpec
from e2e import vllm_server
from tests.conftest import StartRouter, until
from tests.e2e.conftest import SUMMARY
from tests.e2e.test_real_vllm import engine_counts, settle_counts

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(600)]
MODEL = "tiny-kv"
BLOCK = 32  # the CPU attention backend takes multiples of 32 (its default is 128)
WORDS = [
    "router",
    "engine",
    "rank",
    "cache",
    "token",
    "stream",
    "queue",
    "worker",
    "data",
    "parallel",
]


class KvVllm(vllm_server.VllmServer):
    """The tiny model with prefix caching and a ZMQ KV-event publisher per rank."""

    def __init__(self, port: int, events_port: int, replay_port: int) -> None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv",
        }
        extra = (
            "--enable-prefix-caching",
            "--block-size",
            str(BLOCK),
            "--kv-events-config",
            json.dumps(config),
        )
        super().__init__(port, dp_size=2, name=MODEL, extra_args=extra)
        self.events_port = events_port


@pytest.fixture(scope="module")
def vllm_kv() -> Iterator[KvVllm]:
    port = vllm_server.free_port()
    events = vllm_server.free_port(2, avoid=range(port, port + 1))
    replay = vllm_server.free_port(2, avoid=range(events, events + 2))
    with KvVllm(port, events, replay) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def model_tokenizer() -> ModelTokenizer:
    return ModelTokenizer(vllm_server.model_dir())


def long_prompt(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


async def engine_tokens(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    async with http.post(url + "/tokenize", json={"model": MODEL, **body}) as r:
        assert r.status == 200, await r.text()
        tokens: list[int] = (await r.json())["tokens"]
    return tokens


async def test_the_routers_token_ids_are_the_engines(
    vllm_kv: KvVllm, model_tokenizer: ModelTokenizer, http: aiohttp.ClientSession
) -> None:
    prompt = long_prompt(120, 1) + ". Why?"
    assert model_tokenizer.encode(prompt) == await engine_tokens(
        http, vllm_kv.url, {"prompt": prompt}
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": long_prompt(60, 2)},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and then?"},
    ]
    body = {"messages": messages, "add_generation_prompt": True}
    assert model_tokenizer.encode_chat(messages) == await engine_tokens(http, vllm_kv.url, body)


async def test_a_ranks_events_carry_the_prompts_blocks(
    vllm_kv: KvVllm, model_tokenizer: ModelTokenizer, http: aiohttp.ClientSession
) -> None:
    context = zmq.asyncio.Context()
    subs = []
    try:
        for rank in (0, 1):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{vllm_kv.events_port + rank}")
            subs.append(sub)
        await asyncio.sleep(0.5)  # a SUB socket misses what is published before it joins
        prompt = long_prompt(200, 3)
        ids = model_tokenizer.encode(prompt)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        headers = {"X-data-parallel-rank": "1"}
        async with http.post(vllm_kv.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        stored: list[int] = []
        ranks: set[int] = set()
        async with asyncio.timeout(20):
            while len(stored) < len(ids) // BLOCK * BLOCK:
                _topic, seq, payload = await subs[1].recv_multipart()
                _ts, events, rank = msgpack.unpackb(payload)
                ranks.add(rank)
                for event in events:
                    if isinstance(event, dict) and event.get("type") == "BlockStored":
                        stored += event["token_ids"]
        full = len(ids) // BLOCK * BLOCK
        SUMMARY.append(
            f"kv events, rank 1: {full // BLOCK} blocks stored, seq {int.from_bytes(seq)}"
        )
        assert ranks == {1}
        assert stored[:full] == ids[:full]
        assert not await subs[0].poll(200)  # rank 0 cached nothing
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()


async def send(
    http: aiohttp.ClientSession, url: str, prompt: str, headers: dict[str, str] | None = None
) -> str | None:
    """One completion; the target the router chose (None: sent to the engine directly)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("x-dprouter-target")


async def test_prefix_routing_on_the_engines_own_events(
    vllm_kv: KvVllm,
    model_tokenizer: ModelTokenizer,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """Rank 1 caches a prompt before the router exists (the router learns it by replay);
    then a prompt the router sends itself. Each follow-up sharing a long prefix goes to
    the rank that holds it, and that rank's engine counts the cached tokens."""
    early = long_prompt(240, 4)
    await send(http, vllm_kv.url, early, {"X-data-parallel-rank": "1"})
    spec = WorkerSpec(vllm_kv.url, kv_events="auto")  # endpoints from /kv_event_sources
    config = RouterConfig(
        workers=(spec,), policy="prefix", tokenizers=(str(vllm_server.model_dir()),)
    )
    router = await start_router(config)
    feed = router.parts.feed
    assert feed is not None
    index = feed.index

    def blocks(rank: int) -> int:
        found = index.ranks.get(("w0", rank))
        return 0 if found is None else len(found.blocks)

    early_blocks = len(model_tokenizer.encode(early)) // BLOCK
    assert await until(lambda: blocks(1) >= early_blocks, 30), blocks(1)  # the join replay
    metric = "vllm:prefix_cache_hits_total"
    before = await engine_counts(http, vllm_kv.url, metric)
    assert await send(http, router.url, early + " and one more question?") == "w0/1"
    after = await settle_counts(http, vllm_kv.url, metric, sum(before.values()) + 1)
    hit0 = after["1"] - before["1"]
    assert hit0 >= early_blocks * BLOCK, (before, after)

    late = long_prompt(240, 5)
    held = {r: blocks(r) for r in (0, 1)}
    first = await send(http, router.url, late)
    assert first is not None
    rank = int(first.split("/")[1])
    late_blocks = len(model_tokenizer.encode(late)) // BLOCK
    assert await until(lambda: blocks(rank) >= held[rank] + late_blocks, 30), blocks(rank)
    before = await engine_counts(http, vllm_kv.url, metric)
    again = [await send(http, router.url, late + f" question {i}?") for i in range(3)]
    after = await settle_counts(http, vllm_kv.url, metric, sum(before.values()) + 1)
    hits = after[str(rank)] - before[str(rank)]
    SUMMARY.append(
        f"prefix policy on KV events: replayed {early_blocks} blocks of rank 1, "
        f"hit {hit0} tokens there; a new prompt on {first}, its follow-ups on {again}, "
        f"{hits} cached tokens hit"
    )
    assert again == [first] * 3
    assert hits >= 3 * late_blocks * BLOCK - BLOCK
