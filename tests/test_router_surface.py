"""The engine surface besides generation, through the router, against both personas:
which target got each request, what the engine received, what the client got."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from dprouter.config import RouterConfig
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, Faults, Persona
from tests.conftest import StartCluster, StartRouter, until, workers

TOKEN = "admin-secret"


def rank_seen(engine: SimServer, path: str) -> list[int | None]:
    """The rank each request to ``path`` was pinned to, as the engine read it."""
    out: list[int | None] = []
    for r in engine.received:
        if r.path != path:
            continue
        if engine.persona.name == "vllm":
            raw = r.headers.get("X-data-parallel-rank")
            out.append(None if raw is None else int(raw))
        else:
            out.append(r.body.get("routed_dp_rank") if isinstance(r.body, dict) else None)
    return out


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_embeddings_go_by_the_policy_with_the_rank_written_in_the_dialect(
    persona: Persona,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), policy="round_robin"))
    body = {"model": "sim-model", "input": ["one batch", "of two"]}
    labels = []
    for _ in range(4):
        async with http.post(router.url + "/v1/embeddings", json=body) as r:
            assert r.status == 200
            answer = await r.json()
            labels.append(r.headers["x-dprouter-target"])
            rank = int(r.headers["x-sim-dp-rank"])
        assert [d["index"] for d in answer["data"]] == [0, 1]  # a batch is one request
        assert labels[-1].endswith(f"/{rank}")  # the rank the router chose served it
    assert sorted(labels) == sorted(labels[:2] * 2) and len(set(labels)) == 2
    assert rank_seen(engine, "/v1/embeddings") == [int(x[-1]) for x in labels]
    assert engine.served[("/v1/embeddings", 0)] == engine.served[("/v1/embeddings", 1)] == 2


@pytest.mark.parametrize(
    ("persona", "path", "body"),
    [
        ("vllm", "/v1/rerank", {"query": "q", "documents": ["a", "b", "c"]}),
        ("vllm", "/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("vllm", "/v2/rerank", {"query": "q", "documents": ["a"]}),
        ("vllm", "/score", {"text_1": "q", "text_2": ["a", "b"]}),
        ("vllm", "/v1/score", {"text_1": "q", "text_2": "a"}),
        ("vllm", "/pooling", {"input": "pool me"}),
        ("vllm", "/classify", {"input": ["good", "bad"]}),
        ("sglang", "/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("sglang", "/v1/score", {"query": "q", "items": ["a", "b"]}),
        ("sglang", "/classify", {"input": "good"}),
        ("sglang", "/encode", {"text": ["x", "y"]}),
    ],
)
async def test_each_pooling_endpoint_passes_through_unchanged_and_ranked(
    persona: Persona,
    path: str,
    body: dict[str, object],
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    async with http.post(router.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        via_router = await r.read()
        rank = int(r.headers["x-sim-dp-rank"])
    assert rank_seen(engine, path) == [rank]
    assert engine.served[(path, rank)] == 1
    # what the engine answers the same body directly, less the per-answer id and time
    async with http.post(engine.url + path, json=body) as r:
        direct = await r.read()

    def stable(raw: bytes) -> object:
        obj = orjson.loads(raw)
        if isinstance(obj, dict):
            obj.pop("id", None), obj.pop("created", None)
        elif isinstance(obj, list):
            for o in obj:
                o.get("meta_info", {}).pop("id", None)
        return obj

    assert stable(via_router) == stable(direct)


async def test_a_pooling_call_fails_over_like_completions(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:

    broken = EngineConfig(faults=Faults(failing_ranks=frozenset({0, 1})), dp_size=2)
    cluster = await start_cluster([broken, EngineConfig(dp_size=2)])
    bad, good = cluster.servers
    config = RouterConfig(workers=workers(*cluster.urls), attempts=5, policy="round_robin")
    router = await start_router(config)
    for _ in range(4):
        async with http.post(router.url + "/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 200
            assert r.headers["x-sim-engine"] == good.engine_id
    assert sum(good.served.values()) == 4
    assert len(bad.received) >= 2 and not bad.served  # tried, failed, retried elsewhere


async def test_bad_input_to_a_pooling_endpoint_never_reaches_an_engine(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), max_body=1024))
    cases = [
        (b"{nope", 400, None),
        (b"[1]", 400, None),
        (b'{"input": "x", "model": 7}', 400, "model"),
        (b'{"input": "x", "model": "other"}', 404, "model"),
        (b'{"input": "' + b"x" * 2000 + b'"}', 413, None),
    ]
    for raw, status, param in cases:
        async with http.post(router.url + "/v1/embeddings", data=raw) as r:
            assert r.status == status, raw
            error = (await r.json())["error"]
            assert error["param"] == param and error["message"]
    assert not engine.received


async def test_an_engine_only_path_is_404_without_a_worker_of_that_engine(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang")])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    async with http.post(router.url + "/pooling", json={"input": "x"}) as r:
        assert r.status == 404
        assert "no vLLM worker is configured" in (await r.json())["error"]["message"]
    assert not engine.received


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_tokenizer_calls_take_no_rank_and_round_trip(
    persona: Persona,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([EngineConfig(persona=persona, dp_size=2)] * 2)
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    prefix = "/v1" if persona == "sglang" else ""
    body = {"model": "sim-model", "prompt": "hello router world"}
    async with http.post(router.url + prefix + "/tokenize", json=body) as r:
        assert r.status == 200
        tokens = await r.json()
        assert "/" not in r.headers["x-dprouter-target"]  # a worker, not a rank
    assert tokens["count"] == 3 and len(tokens["tokens"]) == 3 and tokens["max_model_len"]
    async with http.post(router.url + prefix + "/detokenize", json=tokens) as r:
        answer = await r.json()
    key = "prompt" if persona == "vllm" else "text"
    assert r.status == 200 and answer[key] == "hello router world"
    for engine in cluster.servers:
        for got in engine.received:
            assert "X-data-parallel-rank" not in got.headers
            assert "routed_dp_rank" not in got.body
    assert all(t.outstanding == 0 for t in router.parts.registry.targets())


async def test_the_router_never_passes_on_an_engine_control_path(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(), EngineConfig(persona="sglang")])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), admin_token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # not engine commands (docs/rl.md): profiling, RPC into the workers, LoRA from tensors
    paths = ("/start_profile", "/collective_rpc", "/load_lora_adapter_from_tensors")
    for path in (*paths, "/set_internal_state"):
        async with http.post(router.url + path, json={}, headers=auth) as r:
            assert r.status == 404
            assert (await r.json())["error"]["message"] == f"no route {path}"
    for engine in cluster.servers:
        assert not [h for h in engine.hits if h.startswith("POST")]


async def test_cache_resets_go_to_every_worker_of_their_engine_behind_the_token(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(), EngineConfig(), EngineConfig(persona="sglang")])
    v1, v2, sg = cluster.servers
    config = RouterConfig(workers=workers(*cluster.urls), admin_token=TOKEN)
    router = await start_router(config)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(router.url + "/reset_prefix_cache") as r:
        assert r.status == 401
    async with http.post(router.url + "/reset_prefix_cache", headers=auth) as r:
        assert r.status == 200
        rows = (await r.json())["workers"]
    assert sorted(row["url"] for row in rows) == sorted([v1.url, v2.url])
    assert all(row["status"] == 200 for row in rows)
    assert v1.hits["POST /reset_prefix_cache"] == v2.hits["POST /reset_prefix_cache"] == 1
    assert sg.hits["POST /reset_prefix_cache"] == 0
    async with http.post(router.url + "/flush_cache", headers=auth) as r:
        rows = (await r.json())["workers"]
    # SGLang's name for it reaches every engine: vLLM's under its own
    paths = sorted((row["url"], row["path"]) for row in rows)
    assert paths == sorted(
        [(v1.url, "/reset_prefix_cache"), (v2.url, "/reset_prefix_cache"), (sg.url, "/flush_cache")]
    )
    assert sg.hits["POST /flush_cache"] == 1 and v1.hits["POST /reset_prefix_cache"] == 2
    rows = [row for row in rows if row["url"] == sg.url]
    one = rows[0]["worker"]
    async with http.post(router.url + f"/flush_cache?worker={one}", headers=auth) as r:
        assert r.status == 200 and len((await r.json())["workers"]) == 1
    async with http.post(router.url + "/flush_cache?worker=nope", headers=auth) as r:
        assert r.status == 404
    assert sg.hits["POST /flush_cache"] == 2


async def test_version_ping_and_sglang_info(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(
        [EngineConfig(), EngineConfig(persona="sglang", legacy_sglang=True)]
    )
    vllm, sglang = cluster.servers
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    async with http.get(router.url + "/version") as r:
        answer = await r.json()
    assert answer["version"]
    assert sorted(w["url"] for w in answer["workers"]) == sorted(cluster.urls)
    assert all(w["version"] for w in answer["workers"])
    for method in ("GET", "POST"):
        async with http.request(method, router.url + "/ping") as r:
            assert r.status == 200
    discovered = sglang.hits["GET /model_info"]  # discovery reads the weights' version there
    async with http.get(router.url + "/model_info") as r:
        assert r.status == 200 and (await r.json())["model_path"] == "sim-model"
    assert sglang.hits["GET /model_info"] == discovered + 1
    async with http.get(router.url + "/health_generate") as r:
        assert r.status == 200
    async with http.get(router.url + "/get_load") as r:
        rows = (await r.json())["workers"]
    assert [row["url"] for row in rows] == [sglang.url] and rows[0]["status"] == 200
    assert vllm.hits["GET /model_info"] == 0


async def test_cache_aware_keeps_a_shared_prefix_on_one_target_for_embeddings_too(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2)] * 2)
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), policy="cache_aware"))
    documents = [f"{'a shared preamble of some length ' * 8} then part {i}" for i in range(6)]
    labels = set()
    for i, doc in enumerate(documents):
        body = {"input": [doc, "a second input"]} if i % 2 else {"input": doc}
        async with http.post(router.url + "/v1/embeddings", json=body) as r:
            assert r.status == 200
            labels.add(r.headers["x-dprouter-target"])
    assert len(labels) == 1  # the input text (a batch's first) carried the prefix
    other = {"input": "nothing in common with the rest, and long enough to tell " * 4}
    async with http.post(router.url + "/v1/embeddings", json=other) as r:
        assert r.headers["x-dprouter-target"] not in labels  # no match: the least loaded


async def test_a_client_leaving_an_embedding_call_frees_its_count_and_aborts_it(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:

    config = EngineConfig(persona="sglang", dp_size=2, faults=Faults(hang=True))
    (engine,) = (await start_cluster([config])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    leaving = asyncio.create_task(http.post(router.url + "/v1/embeddings", json={"input": "x"}))
    assert await until(lambda: len(engine.received) == 1)
    targets = router.parts.registry.targets()
    assert sum(t.outstanding for t in targets) == 1  # counted like completions
    leaving.cancel()
    assert await until(lambda: len(engine.abort_requests) == 1)
    assert engine.abort_requests[0] == engine.received[0].body["rid"]  # the rid the router wrote
    assert await until(lambda: sum(t.outstanding for t in targets) == 0)
