"""A request sampling n sequences from one prompt (OpenAI's ``n``, SGLang's
``sampling_params.n``), as each engine runs it: vLLM adds the n sequences at once and
caches the prompt's blocks as it schedules the first, so the rest find them; SGLang first
runs a copy that only computes the prompt, then the n samples, which find it cached. One
answer holds every sample (SGLang's ``/generate``: a list), each its own words; streams
carry each chunk's sample index."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from tests.conftest import StartCluster
from tests.test_sim_vllm import sse_events

RANK = "X-data-parallel-rank"
PROMPT = list(range(1000, 2000))  # 1,000 token ids: 62 whole blocks of 16
LIMITS = RankLimits(block_size=16, max_model_len=4096, kv_tokens=100_000)


def computed(server: SimServer, rank: int) -> int:
    """Prompt tokens ``rank`` computed: looked up in its cache and not found."""
    stats = server.engine.ranks[rank].stats
    return stats.prefix_queries - stats.prefix_hits


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_n_samples_compute_the_prompt_once_and_answer_in_one_body(
    start_cluster: StartCluster, http: aiohttp.ClientSession, persona: str
) -> None:
    config = EngineConfig(persona=persona, dp_size=2, limits=LIMITS)  # type: ignore[arg-type]
    (engine,) = (await start_cluster([config])).servers
    body = {"prompt": PROMPT, "max_tokens": 5, "n": 4}
    async with http.post(engine.url + "/v1/completions", json=body, headers={RANK: "1"}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in answer["choices"]]
    assert len(set(texts)) == 4 and all(len(t.split()) == 5 for t in texts)
    assert answer["usage"]["prompt_tokens"] == 1000
    assert answer["usage"]["completion_tokens"] == 20
    # computed once: the whole prompt by the first sequence (SGLang: the copy), the last
    # partial block again by each other (the engine never hits a prompt's last token)
    assert computed(engine, 1) == 1000 + 3 * (1000 - 992) + (8 if persona == "sglang" else 0)
    assert computed(engine, 0) == 0
    alone = {"prompt": PROMPT, "max_tokens": 5}
    async with http.post(engine.url + "/v1/completions", json=alone, headers={RANK: "0"}) as r:
        first = (await r.json())["choices"][0]["text"]
    assert first == texts[0]  # the first sample is what the prompt alone gives


async def test_sglang_generate_answers_n_samples_with_a_list(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(persona="sglang", dp_size=2, limits=LIMITS)
    (engine,) = (await start_cluster([config])).servers
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "n": 3}}
    async with http.post(engine.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert isinstance(answer, list) and len(answer) == 3
    assert [a["meta_info"]["completion_tokens"] for a in answer] == [3, 3, 3]
    assert len({a["text"] for a in answer}) == 3
    # the samples ran where the router would have to look: all on one rank when pinned
    body["routed_dp_rank"] = 1
    async with http.post(engine.url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200
        chunks = [orjson.loads(e) for e in sse_events(await r.read()) if e != b"[DONE]"]
    last: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2]
    assert all(c["meta_info"]["finish_reason"] is not None for c in last.values())
    assert [c["text"] for c in last.values()] == [a["text"] for a in answer]


async def test_a_chat_stream_of_n_samples_carries_each_ones_index(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=1, limits=LIMITS)])).servers
    body = {
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 4,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(engine.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = sse_events(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    said: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        said[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert sorted(finished) == [0, 1, 2]
    assert len(set(said.values())) == 3 and all(len(t.split()) == 4 for t in said.values())
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_n_below_one_is_refused(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=1, limits=LIMITS)])).servers
    body = {"prompt": "x", "max_tokens": 2, "n": 0}
    async with http.post(engine.url + "/v1/completions", json=body) as r:
        assert r.status == 400 and "n" in (await r.json())["error"]["message"]
