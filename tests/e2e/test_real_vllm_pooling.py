"""Embeddings through dprouter to a real vLLM pooling server (CPU build, tiny model, DP=2).

The tiny Llama served with ``--runner pooling --convert embed`` answers
``/v1/embeddings``; a generation server answers 404 there. Its own module, so its
engine starts after the generation server of ``test_real_vllm`` has stopped (two
at once would share the machine's two cores).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from e2e import vllm_server
from tests.conftest import StartRouter
from tests.e2e.conftest import SUMMARY
from tests.e2e.test_real_vllm import engine_counts, settle_counts

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(600)]
MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def vllm_embed() -> Iterator[vllm_server.VllmServer]:
    extra = ("--runner", "pooling", "--convert", "embed")
    port = vllm_server.free_port()
    with vllm_server.VllmServer(port, dp_size=2, name=MODEL, extra_args=extra) as server:
        server.wait_ready()
        yield server


async def embed(
    http: aiohttp.ClientSession, url: str, text: str | list[str], rank: int | None = None
) -> tuple[list[list[float]], str]:
    """The embeddings of ``text`` through ``url``, and the target that computed them."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"model": MODEL, "input": text}
    async with http.post(url + "/v1/embeddings", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        target = r.headers["x-dprouter-target"]
    assert answer["object"] == "list"
    rows = sorted(answer["data"], key=lambda row: row["index"])
    return [row["embedding"] for row in rows], target


async def test_embeddings_spread_over_both_ranks_and_each_rank_computes_them(
    vllm_embed: vllm_server.VllmServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(RouterConfig(workers=(WorkerSpec(vllm_embed.url),)))
    (worker,) = router.registry.workers.values()
    assert worker.ranks == 2  # discovered from the pooling server's /metrics
    metric = "vllm:prompt_tokens_total"
    before = await engine_counts(http, vllm_embed.url, metric)
    k = 6
    served = [(await embed(http, router.url, f"sentence number {i}"))[1] for i in range(2 * k)]
    after = await settle_counts(http, vllm_embed.url, metric, sum(before.values()) + 2 * k)
    rose = {label: after[label] - before[label] for label in ("0", "1")}
    SUMMARY.append(f"pooling, {2 * k} embeddings: engine label -> prompt tokens {rose}")
    assert Counter(served) == {"w0/0": k, "w0/1": k}
    assert rose["0"] > 0 and rose["1"] > 0  # each rank computed its half


async def test_a_batch_is_one_request_and_ranks_agree_on_a_vector(
    vllm_embed: vllm_server.VllmServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    config = RouterConfig(workers=(WorkerSpec(vllm_embed.url),), trust_client_rank=True)
    router = await start_router(config)
    texts = ["the cat sat", "on the mat", "and slept"]
    batch, target = await embed(http, router.url, texts)
    assert len(batch) == 3 and len({len(v) for v in batch}) == 1
    assert target in ("w0/0", "w0/1")
    on0, t0 = await embed(http, router.url, texts[0], rank=0)
    on1, t1 = await embed(http, router.url, texts[0], rank=1)
    assert (t0, t1) == ("w0/0", "w0/1")  # --trust-client-rank: the client's rank picks
    # the same weights on both ranks: the same input embeds alike wherever it ran
    assert on0[0] == pytest.approx(on1[0], abs=1e-4)
    assert batch[0] == pytest.approx(on0[0], abs=1e-4)
    async with http.post(
        router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ) as r:  # a pooling server has no completions: the engine's answer reaches the client
        assert r.status >= 400
    SUMMARY.append(f"pooling: a batch of 3 on {target}; rank 0 and rank 1 vectors agree")
