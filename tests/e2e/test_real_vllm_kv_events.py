"""A real vLLM (CPU build, tiny model, DP=2) publishing KV-cache events: what the router's
prefix routing relies on, checked against the engine itself.

The router tokenises prompts with the model's own files (``dprouter.tokenizer``) and keys
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

from dprouter.tokenizer import ModelTokenizer
from e2e import vllm_server
from tests.e2e.conftest import SUMMARY

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

    def __init__(self, port: int, events_port: int) -> None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
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
    with KvVllm(port, events) as server:
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
