"""The router with --policy prefix over a simulated DP4 engine whose ranks publish KV
events through stand-in publishers (the engines' wire format): a prompt goes to the
rank whose events say it holds it; with nothing held, load decides."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import zmq

from dprouter.config import RouterConfig
from dprouter.core.errors import ConfigError
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter
from tests.kv_publisher import Publisher, stored

BLOCK = 16
SYSTEM = "You are the router's test. " * 60  # ~ 300 tokens: many blocks


@asynccontextmanager
async def publishers(n: int) -> AsyncIterator[list[Publisher]]:
    """``n`` publishers on consecutive ports, as an engine's ranks lay them out."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20_000, 60_000)
        async with AsyncExitStack() as stack:
            try:
                found = [
                    await stack.enter_async_context(Publisher(rank=r, port=base + r))
                    for r in range(n)
                ]
            except zmq.ZMQError:
                continue
            yield found
            return
    raise AssertionError("no free consecutive ports")


def blocks_of(ids: list[int]) -> list[int]:
    return ids[: len(ids) - len(ids) % BLOCK]


async def test_a_prompt_goes_to_the_rank_holding_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    cluster = await start_cluster([EngineConfig(persona="vllm", dp_size=4)])
    async with publishers(4) as pubs:
        spec = WorkerSpec(cluster.urls[0], kv_events=pubs[0].endpoint, kv_replay=None)
        config = RouterConfig(
            workers=(spec,), policy="prefix", tokenizers=(str(tokenizer_dir),), seed=1
        )
        router = await start_router(config)
        tok = ModelTokenizer(tokenizer_dir)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        held = blocks_of(tok.encode_chat(messages))
        n = len(held) // BLOCK
        # rank 2 stores the chat prompt's blocks; rank 1 the completion prompt's
        completion = blocks_of(tok.encode(SYSTEM))
        feed = router.parts.feed
        assert feed is not None
        for rank, ids in ((2, held), (1, completion)):
            for _ in range(500):  # until the subscription is through (ZMQ's slow joiner)
                hashes = list(range(1000 * rank, 1000 * rank + len(ids) // BLOCK))
                await pubs[rank].publish([stored(hashes, None, ids, BLOCK)])
                await asyncio.sleep(0.01)
                found = feed.index.ranks.get(("w0", rank))
                if found is not None and found.blocks:
                    break
        for body, path, expected in (
            ({"messages": [*messages[:1], {"role": "user", "content": "hi"}]}, "chat", "2"),
            ({"prompt": SYSTEM + " and then"}, "", "1"),
        ):
            for _ in range(3):
                url = f"{router.url}/v1/{'chat/' if path else ''}completions"
                async with http.post(url, json={**body, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-sim-dp-rank"] == expected
        # nothing held: spread by load (sequential requests: the rotating tie-break)
        seen = set()
        for i in range(4):
            async with http.post(
                f"{router.url}/v1/completions", json={"prompt": f"other {i}", "max_tokens": 2}
            ) as r:
                seen.add(r.headers["x-sim-dp-rank"])
        assert seen == {"0", "1", "2", "3"}
        async with http.get(f"{router.url}/metrics") as r:
            text = await r.text()
        assert f'dprouter_kv_blocks{{dp_rank="2",worker="w0"}} {n}.0' in text
        assert 'dprouter_kv_events_total{dp_rank="2",worker="w0"}' in text


def test_prefix_needs_a_tokenizer_and_the_file_must_be_there(tmp_path: Path) -> None:
    from dprouter.config import validate

    with pytest.raises(ConfigError, match="--tokenizer"):
        validate(RouterConfig(policy="prefix"))
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        validate(RouterConfig(policy="prefix", tokenizers=(f"m={tmp_path}",)))
    with pytest.raises(ConfigError, match="kv_events must be tcp://HOST:PORT or auto"):
        validate(RouterConfig(workers=(WorkerSpec("http://h:1", kv_events="h:1"),)))


def test_kv_block_size_is_a_worker_key() -> None:
    from dprouter.config import validate
    from dprouter.fleet.worker_spec import parse_worker

    spec = parse_worker("http://h:1,kv_events=tcp://h:5557,kv_block_size=32")
    assert spec.kv_block_size == 32
    with pytest.raises(ConfigError, match="kv_block_size must be at least 1"):
        validate(RouterConfig(workers=(WorkerSpec("http://h:1", kv_block_size=0),)))
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_worker("http://h:1,kv_block_size=big")
