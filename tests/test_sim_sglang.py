"""The SGLang persona over real HTTP on loopback."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest

from dprouter.sim.model.config import Dispatch, EngineConfig
from dprouter.sim.model.tokens import tokenize
from tests.conftest import StartCluster, background, until
from tests.test_sim_vllm import sse_events


async def complete(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, str | None, Any]:
    payload = {"prompt": "hello", "max_tokens": 2, **body}
    async with http.post(url + "/v1/completions", json=payload, headers=headers or {}) as r:
        return r.status, r.headers.get("x-sim-dp-rank"), await r.json()


@pytest.mark.parametrize(
    ("legacy", "dp_attention", "shape"),
    [
        (False, True, (1, 4, True)),  # SGLang 0.5.23: --attn-dp-size 4
        (False, False, (4, 1, False)),  # SGLang 0.5.23: --dp-size 4
        (True, True, (4, None, True)),  # older: --dp-size 4 --enable-dp-attention
        (True, False, (4, None, False)),
    ],
)
async def test_server_info_reports_dp_shape(
    start_cluster: StartCluster,
    http: aiohttp.ClientSession,
    legacy: bool,
    dp_attention: bool,
    shape: tuple[int, int | None, bool],
) -> None:
    config = EngineConfig(
        persona="sglang", dp_size=4, tp_size=2, dp_attention=dp_attention, legacy_sglang=legacy
    )
    (engine,) = (await start_cluster([config])).servers
    for path in ("/server_info", "/get_server_info"):
        async with http.get(engine.url + path) as r:
            info = await r.json()
        assert (info["dp_size"], info.get("attn_dp_size"), info["enable_dp_attention"]) == shape
        assert info["tp_size"] == 2
        assert info["load_balance_method"] == "round_robin"
        assert info["disaggregation_mode"] == "null"
        assert len(info["internal_states"]) == 4 and "dp_rank" not in info["internal_states"][0]
        assert "model_path" not in info and "tokenizer_path" not in info


async def test_routed_dp_rank_older_name_and_header_override(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=4)])).servers
    assert (await complete(http, engine.url, {"routed_dp_rank": 2}))[1] == "2"
    assert (await complete(http, engine.url, {"data_parallel_rank": 3}))[1] == "3"
    both = {"routed_dp_rank": 1, "data_parallel_rank": 3}
    assert (await complete(http, engine.url, both))[1] == "1"
    header = {"X-Data-Parallel-Rank": "0"}
    assert (await complete(http, engine.url, {"routed_dp_rank": 2}, header))[1] == "0"
    # /generate reads only the body (SGLang 0.5.23, measured on the real engine)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "routed_dp_rank": 2}
    async with http.post(engine.url + "/generate", json=body, headers=header) as r:
        assert r.headers["x-sim-dp-rank"] == "2"
    received = [rec.rank for rec in engine.received]
    assert received == [2, 3, 1, 0, 2]


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        ({"routed_dp_rank": 4}, {}, "routed_dp_rank=4 out of range [0, 4)"),
        ({"routed_dp_rank": "two"}, {}, "routed_dp_rank must be an integer, got 'two'"),
        (
            {},
            {"X-Data-Parallel-Rank": "abc"},
            "Invalid X-Data-Parallel-Rank header: must be an integer, got 'abc'",
        ),
    ],
)
async def test_bad_rank_is_rejected(
    start_cluster: StartCluster,
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    headers: dict[str, str],
    message: str,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=4)])).servers
    status, rank, error = await complete(http, engine.url, body, headers)
    assert (status, rank) == (400, None)
    assert error == {
        "object": "error",
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


async def test_rank_zero_on_a_single_rank_engine_is_ignored(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang")])).servers
    assert (await complete(http, engine.url, {"routed_dp_rank": 0}))[:2] == (200, "0")
    assert (await complete(http, engine.url, {"routed_dp_rank": 1}))[0] == 400


@pytest.mark.parametrize("legacy", [False, True])
async def test_loads_and_get_load_per_rank(
    start_cluster: StartCluster, http: aiohttp.ClientSession, legacy: bool
) -> None:
    config = EngineConfig(persona="sglang", dp_size=2, legacy_sglang=legacy)
    (engine,) = (await start_cluster([config])).servers

    async def long(i: int) -> None:
        async with http.post(
            engine.url + "/generate",
            json={
                "text": f"busy {i}",
                "sampling_params": {"max_new_tokens": 200},
                "routed_dp_rank": 1,
            },
        ) as r:
            await r.read()

    async with background(*(long(i) for i in range(3))):
        assert await until(lambda: engine.engine.ranks[1].num_running == 3)
        async with http.get(engine.url + "/v1/loads") as r:
            loads = await r.json()
        assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        per_rank = {x["dp_rank"]: x for x in loads["loads"]}
        assert per_rank[0]["num_running_reqs"] == 0 and per_rank[1]["num_running_reqs"] == 3
        assert per_rank[1]["num_used_tokens"] >= 3 * len(tokenize("busy 0"))
        assert 0 < per_rank[1]["token_usage"] < 1
        assert per_rank[1]["max_total_num_tokens"] == config.limits.kv_tokens
        async with http.get(engine.url + "/v1/loads?dp_rank=1") as r:
            assert [x["dp_rank"] for x in (await r.json())["loads"]] == [1]
        async with http.get(engine.url + "/v1/loads?dp_rank=5") as r:
            assert (await r.json())["loads"] == []
        async with http.get(engine.url + "/get_load") as r:
            if not legacy:  # gone in SGLang 0.5.23
                assert r.status == 404
                return
            old = await r.json()
        assert [(x["dp_rank"], x["num_reqs"]) for x in old] == [(0, 0), (1, 3)]


async def test_generate_streams_cumulative_text(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=2)])).servers
    body = {
        "text": "tell me",
        "sampling_params": {"max_new_tokens": 4},
        "stream": True,
        "routed_dp_rank": 1,
    }
    async with http.post(engine.url + "/generate", json=body) as r:
        assert r.headers["x-sim-dp-rank"] == "1"
        events = sse_events(await r.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert len(texts) == 4 and all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert events[-1] == b"[DONE]"
    async with http.post(engine.url + "/generate", json={**body, "stream": False}) as r:
        whole = await r.json()
    assert whole["text"] == texts[-1]
    assert whole["meta_info"]["completion_tokens"] == 4
    assert whole["meta_info"]["prompt_tokens"] == len(tokenize("tell me"))


async def test_round_robin_dispatch_is_blind_but_even(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=4)])).servers
    ranks = [(await complete(http, engine.url, {}))[1] for _ in range(8)]
    assert ranks == ["0", "1", "2", "3", "0", "1", "2", "3"]


@pytest.mark.parametrize(
    ("dispatch", "legacy"),
    [("total_requests", False), ("total_tokens", False), ("shortest_queue", True)],
)
async def test_load_balancing_dispatch_avoids_the_busy_rank(
    start_cluster: StartCluster, http: aiohttp.ClientSession, dispatch: Dispatch, legacy: bool
) -> None:
    config = EngineConfig(persona="sglang", dp_size=2, dispatch=dispatch, legacy_sglang=legacy)
    (engine,) = (await start_cluster([config])).servers
    busy = {"max_tokens": 300, "routed_dp_rank": 0}
    async with background(*(complete(http, engine.url, busy) for _ in range(4))):
        rank0 = engine.engine.ranks[0]
        assert await until(lambda: rank0.num_running + rank0.num_waiting == 4)
        ranks = Counter([(await complete(http, engine.url, {}))[1] for _ in range(3)])
    assert ranks == {"1": 3}


async def test_follow_bootstrap_room(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(persona="sglang", dp_size=4, dispatch="follow_bootstrap_room")
    (engine,) = (await start_cluster([config])).servers
    for room in (5, 10, 2**62 + 3):
        assert (await complete(http, engine.url, {"bootstrap_room": room}))[1] == str(room % 4)
    status, _, error = await complete(http, engine.url, {})
    assert status == 400 and "bootstrap_room should not be None" in error["message"]
