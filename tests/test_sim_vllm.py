"""The vLLM persona over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import CostModel, EngineConfig
from dprouter.sim.model.tokens import tokenize
from tests.conftest import StartCluster, until

RANK = "X-data-parallel-rank"


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """Samples keyed by (name, engine label), summed over other labels."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: defaultdict[tuple[str, str], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("engine", ""))] += s.value
    return dict(out)


def sse_events(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]


async def test_pinned_rank_is_honoured_in_header_and_metrics(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=4)])).servers
    for rank in (2, 2, 3):
        async with http.post(
            engine.url + "/v1/completions",
            headers={RANK: str(rank)},
            json={"prompt": "pin me", "max_tokens": 3},
        ) as r:
            assert r.status == 200
            assert r.headers["x-sim-dp-rank"] == str(rank)
            assert r.headers["x-sim-engine"] == engine.engine_id
    m = await metrics(http, engine.url)
    done = [m[("vllm:request_success_total", str(r))] for r in range(4)]
    assert done == [0, 0, 2, 1]
    assert m[("vllm:generation_tokens_total", "2")] == 6
    assert m[("vllm:prompt_tokens_total", "3")] == len(tokenize("pin me"))


@pytest.mark.parametrize("dp_size", [1, 2])
async def test_out_of_range_rank_errors_match_vllm(
    start_cluster: StartCluster, http: aiohttp.ClientSession, dp_size: int
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=dp_size)])).servers
    message = f"data_parallel_rank {dp_size} is out of range [0, {dp_size})."
    body = {"prompt": "x", "max_tokens": 2}
    async with http.post(
        engine.url + "/v1/completions", json=body, headers={RANK: str(dp_size)}
    ) as r:
        assert r.status == 400
        assert await r.json() == {
            "error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        }
    # streamed: real vLLM answers 200 and puts the error inside the SSE body
    async with http.post(
        engine.url + "/v1/completions", json={**body, "stream": True}, headers={RANK: str(dp_size)}
    ) as r:
        assert r.status == 200
        events = sse_events(await r.read())
    assert orjson.loads(events[0])["error"]["message"] == message
    assert events[1:] == [b"[DONE]"]
    m = await metrics(http, engine.url)
    assert sum(v for (name, _), v in m.items() if name == "vllm:request_success_total") == 0


async def test_non_integer_rank_header_is_ignored(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    async with http.post(
        engine.url + "/v1/completions", headers={RANK: "abc"}, json={"prompt": "x", "max_tokens": 2}
    ) as r:
        assert r.status == 200
        assert r.headers["x-sim-dp-rank"] in {"0", "1"}


async def test_stream_chunks_usage_and_done(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    body = {
        "prompt": "count to five",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(engine.url + "/v1/completions", json=body) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert len(pieces) == 5 and all(p.startswith(" ") for p in pieces)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == []
    prompt = len(tokenize("count to five"))
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "total_tokens": prompt + 5,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # the same prompt gives the same text, not streamed
    async with http.post(engine.url + "/v1/completions", json={**body, "stream": False}) as r:
        whole = await r.json()
    assert whole["choices"][0]["text"] == "".join(pieces)
    assert len(tokenize(whole["choices"][0]["text"])) == 5


async def test_chat_stream_opens_with_the_role(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(model="m")])).servers
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    async with http.post(engine.url + "/v1/chat/completions", json=body) as r:
        events = sse_events(await r.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len(chunks) == 4 and events[-1] == b"[DONE]"
    async with http.post(
        engine.url + "/v1/chat/completions", json={**body, "model": "other", "stream": False}
    ) as r:
        assert r.status == 404
        assert (await r.json())["error"][
            "message"
        ] == "The model `other` does not exist. Valid aliases: m."


async def test_burst_lands_unevenly_on_stale_stats(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=4)])).servers

    async def one(i: int) -> str:
        async with http.post(
            engine.url + "/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 8}
        ) as r:
            return r.headers["x-sim-dp-rank"]

    counts = Counter(await asyncio.gather(*(one(i) for i in range(8))))
    assert max(counts.values()) >= 4, counts  # an even split would be 2 per rank


async def test_prefix_hit_shows_in_usage_metrics_and_ttft(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    prompt = " ".join(f"w{i}" for i in range(3000))  # 3000 tokens: ~0.13 s of prefill

    async def ttft_and_usage() -> tuple[float, dict[str, object]]:
        body = {
            "prompt": prompt,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        async with http.post(engine.url + "/v1/completions", json=body, headers={RANK: "1"}) as r:
            await r.content.readuntil(b"\n\n")
            ttft = time.perf_counter() - t0
            events = sse_events(await r.read())
        return ttft, orjson.loads(events[-2])["usage"]

    cold, cold_usage = await ttft_and_usage()
    warm, warm_usage = await ttft_and_usage()
    assert cold_usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert warm_usage["prompt_tokens_details"] == {"cached_tokens": 2992}
    assert warm < cold / 2
    m = await metrics(http, engine.url)
    assert m[("vllm:prefix_cache_queries_total", "1")] == 6000
    assert m[("vllm:prefix_cache_hits_total", "1")] == 2992
    assert m[("vllm:prefix_cache_hits_total", "0")] == 0


async def test_dp_attention_lock_step_slows_a_lone_request(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    slow_decode = CostModel(decode_per_seq=2e-3)  # 32 sequences make a ~70 ms step
    cluster = await start_cluster(
        [
            EngineConfig(dp_size=2, dp_attention=False, cost=slow_decode),
            EngineConfig(dp_size=2, dp_attention=True, cost=slow_decode),
        ]
    )

    async def lone_request_time(engine: SimServer) -> float:
        url = engine.url

        async def load(i: int) -> None:
            async with http.post(
                url + "/v1/completions",
                headers={RANK: "0"},
                json={"prompt": f"load {i}", "max_tokens": 40},
            ) as r:
                await r.read()

        loads = [asyncio.create_task(load(i)) for i in range(32)]
        rank0 = engine.engine.ranks[0]
        assert await until(lambda: rank0.num_running == 32)  # rank 0 is decoding its batch
        t0 = time.perf_counter()
        async with http.post(
            url + "/v1/completions", headers={RANK: "1"}, json={"prompt": "alone", "max_tokens": 8}
        ) as r:
            await r.read()
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*loads)
        return elapsed

    free = await lone_request_time(cluster[0])
    locked = await lone_request_time(cluster[1])
    assert locked > 3 * free, (free, locked)


async def test_bad_requests_get_clear_errors(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    url = engine.url + "/v1/completions"
    cases: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "Invalid JSON body"),
        (b"[1, 2]", 400, "request body must be a JSON object"),
        (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"max_tokens": 3}', 400, "prompt"),
        (b'{"prompt": ""}', 400, "prompt"),
        (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
        (b'{"prompt": "x", "max_tokens": 40000}', 400, "maximum context length is 32768"),
    ]
    for raw, status, needle in cases:
        async with http.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status, raw
            error = (await r.json())["error"]
            assert needle in error["message"], (raw, error)
            assert error["code"] == status
    async with http.get(engine.url + "/server_info") as r:
        assert r.status == 404  # vLLM has no production endpoint that reports dp_size
    async with http.get(url) as r:
        assert r.status == 405


async def test_models_health_and_ipv6(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, model="tiny")], "::1")).servers
    assert engine.url.startswith("http://[::1]:")
    async with http.get(engine.url + "/health") as r:
        assert r.status == 200
    async with http.get(engine.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
    async with http.post(
        engine.url + "/v1/completions", headers={RANK: "1"}, json={"prompt": "v6", "max_tokens": 2}
    ) as r:
        assert r.headers["x-sim-dp-rank"] == "1"


async def test_a_prompt_ending_in_eos_n_stops_after_n_tokens_under_a_larger_cap(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    for path, body, n in (
        ("/v1/completions", {"prompt": "a turn of a rollout eos=7", "max_tokens": 500}, 7),
        ("/v1/completions", {"prompt": "eos=7 is not at the end", "max_tokens": 3}, 3),
        ("/v1/completions", {"prompt": "the cap wins eos=70", "max_tokens": 4}, 4),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi eos=2"}]}, 2),
    ):
        async with http.post(engine.url + path, json=body) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == n, body
