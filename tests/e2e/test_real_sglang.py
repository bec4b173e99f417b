"""dprouter in front of a real SGLang 0.5.23 (CPU, tiny models): what the engine itself says.

Which rank served a request is the engine's own answer: ``meta_info.dp_rank`` on
``/generate``; on the OpenAI endpoints, which rank's ``total_prefill_uncached_tokens``
(``/v1/loads``) rose while the request ran alone (each prompt is new to the engine).
The routers here check no ``/health``: SGLang answers it by running a generation.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from e2e.sglang import server as sglang_server
from e2e.sglang.server import SglangServer

from dprouter.config import RouterConfig
from dprouter.fleet import engine_load
from dprouter.fleet.worker_spec import WorkerSpec
from tests.conftest import StartRouter, until
from tests.e2e.answers import loads
from tests.e2e.conftest import SUMMARY, installs_beside

# an SGLang server takes about a minute to start on two cores
pytestmark = [pytest.mark.realsglang, pytest.mark.timeout(600)]
LAYOUTS = ["sglang_dp2", "sglang_attn2"]  # --dp-size 2 (Llama); --tp-size 2 --attn-dp-size 2
NONCE = itertools.count()


def config(server: SglangServer, **options: Any) -> RouterConfig:
    return RouterConfig(workers=(WorkerSpec(server.url),), health_interval=0, **options)


def prompt() -> str:
    """Words the engine has not seen in this order: its prefix cache cannot hide them."""
    n = next(NONCE)
    return f"request {n} asks the router {n % 7} times about rank {n % 3} and the engine"


def generate_body(**extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 2, "ignore_eos": True}
    return {"text": prompt(), "sampling_params": params, **extra}


async def served_rank(
    http: aiohttp.ClientSession,
    server: SglangServer,
    send: Callable[[], Awaitable[tuple[str, dict[str, Any]]]],
) -> tuple[str, int]:
    """The router's target for the request ``send`` makes, and the rank the engine says ran
    its prefill (the one whose uncached prefill tokens rose)."""
    field = "total_prefill_uncached_tokens"
    before = {r: x[field] for r, x in (await loads(http, server.url)).items()}
    target, _ = await send()
    rose: list[int] = []
    for _ in range(40):  # the engine publishes its counts about every 0.1 s
        after = {r: x[field] for r, x in (await loads(http, server.url)).items()}
        rose = [r for r in after if after[r] > before[r]]
        if rose:
            break
        await asyncio.sleep(0.05)
    assert len(rose) == 1, (before, after)
    return target, rose[0]


def post(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Callable[[], Awaitable[tuple[str, dict[str, Any]]]]:
    async def send() -> tuple[str, dict[str, Any]]:
        async with http.post(url + path, json=body, headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-dprouter-target"], await r.json()

    return send


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_discovery_finds_two_ranks_and_round_robin_gives_each_its_share(
    request: pytest.FixtureRequest,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    layout: str,
) -> None:
    server: SglangServer = request.getfixturevalue(layout)
    router = await start_router(config(server))  # no dp option: what /server_info says
    (worker,) = router.registry.workers.values()
    attention = layout == "sglang_attn2"
    assert (worker.dialect, worker.ranks, worker.dp_attention) == ("sglang", 2, attention)
    k = 4
    pairs = []
    for _ in range(2 * k):
        target, answer = await post(http, router.url, "/generate", generate_body())()
        pairs.append((target, answer["meta_info"]["dp_rank"]))
    engine = Counter(rank for _, rank in pairs)
    SUMMARY.append(f"{layout}: round_robin, {2 * k} /generate -> engine dp_rank {dict(engine)}")
    assert engine == {0: k, 1: k}
    assert all(target == f"w0/{rank}" for target, rank in pairs)  # the router's choice, run


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_the_routers_rank_reaches_the_engine_on_every_endpoint(
    request: pytest.FixtureRequest,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    layout: str,
) -> None:
    """``routed_dp_rank`` in the body, on ``/v1/completions``, ``/v1/chat/completions`` and
    ``/generate``; the client's own rank (body field and header, both of which the engine
    honours on its OpenAI endpoints) never reaches it."""
    server: SglangServer = request.getfixturevalue(layout)
    router = await start_router(config(server))
    own = {"routed_dp_rank": 1, "data_parallel_rank": 1}
    header = {"X-Data-Parallel-Rank": "1"}
    bodies: dict[str, Callable[[], dict[str, Any]]] = {
        "/v1/completions": lambda: {"model": "tiny", "prompt": prompt(), "max_tokens": 2, **own},
        "/v1/chat/completions": lambda: {
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt()}],
            "max_tokens": 2,
            **own,
        },
        "/generate": lambda: generate_body(**own),
    }
    seen: dict[str, list[tuple[str, int]]] = {}
    for path, body in bodies.items():
        seen[path] = [
            await served_rank(http, server, post(http, router.url, path, body(), header))
            for _ in range(2)
        ]
    SUMMARY.append(f"{layout}: router target -> engine rank, client asked for 1: {seen}")
    for path, pairs in seen.items():
        assert [t for t, _ in pairs] == ["w0/0", "w0/1"], path  # round robin, not the client
        assert [f"w0/{r}" for _, r in pairs] == ["w0/0", "w0/1"], path  # and the engine agrees


async def test_a_session_sticks_to_one_attention_dp_rank(
    sglang_attn2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(config(sglang_attn2, sessions=True))
    ranks = []
    for _ in range(6):
        send = post(http, router.url, "/generate", generate_body(), {"X-SMG-Routing-Key": "a"})
        ranks.append((await send())[1]["meta_info"]["dp_rank"])
    SUMMARY.append(f"sglang_attn2: session 'a', 6 /generate -> engine dp_rank {ranks}")
    assert len(set(ranks)) == 1


async def test_n_samples_run_on_one_rank_and_compute_the_prompt_once(
    sglang_attn2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """One /generate of n = 4 through dprouter: the engine answers a list of 4 samples, all
    run on the rank dprouter chose; SGLang first runs a copy that computes the prompt, so
    every sample finds it cached (as the simulator's SGLang persona does)."""
    router = await start_router(config(sglang_attn2))
    body = generate_body()
    body["text"] = body["text"] * 8
    body["sampling_params"] = {**body["sampling_params"], "n": 4, "max_new_tokens": 24}
    async with http.post(router.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        target, answer = r.headers["x-dprouter-target"], await r.json()
    assert isinstance(answer, list) and len(answer) == 4, answer
    metas = [a["meta_info"] for a in answer]
    ranks = {m["dp_rank"] for m in metas}
    cached = [m["cached_tokens"] for m in metas]
    prompt = metas[0]["prompt_tokens"]
    SUMMARY.append(
        f"sglang_attn2: n = 4 on {target}: dp_rank {sorted(ranks)}, prompt {prompt}, "
        f"cached {cached}"
    )
    assert ranks == {int(target.split("/")[1])}
    assert all(c >= prompt - 1 for c in cached), cached
    assert all(t.outstanding == 0 for t in router.registry.targets())


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_the_token_counts_read_are_the_ones_sglang_reports_per_rank(
    request: pytest.FixtureRequest,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    layout: str,
) -> None:
    """``num_used_tokens`` + ``num_waiting_uncached_tokens`` of ``/v1/loads``, per rank, the
    attention-DP ranks included: they rise on the rank that runs a long prompt."""
    server: SglangServer = request.getfixturevalue(layout)
    router = await start_router(config(server))
    (worker,) = router.registry.workers.values()
    body = {"model": "tiny", "prompt": prompt() * 20, "max_tokens": 1000, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json={**body, "stream": True})
    assert resp.status == 200
    rank = int(resp.headers["x-dprouter-target"].split("/")[1])
    seen: dict[int, tuple[int, int]] = {}
    try:
        for _ in range(100):  # the engine's counts can lag the first events, each its own way
            seen = await engine_load.scrape(http, worker)
            if seen[rank][0] == 1 and seen[rank][1] >= 200:
                break
            await asyncio.sleep(0.05)
    finally:
        resp.close()
    SUMMARY.append(f"{layout}: a long prompt on rank {rank}: (requests, tokens) read {seen}")
    assert seen[rank][0] == 1 and seen[rank][1] >= 200  # the prompt's tokens, at least
    assert seen[1 - rank] == (0, 0)


async def test_a_client_that_leaves_a_long_stream_frees_its_rank(
    sglang_dp2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The connection closes (SGLang aborts a request whose client left) and the router also
    posts ``/abort_request`` with the request's rid; the rank is free either way."""
    router = await start_router(config(sglang_dp2))
    body = {"model": "tiny", "prompt": prompt(), "max_tokens": 1500, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json={**body, "stream": True})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    rank = int(resp.headers["x-dprouter-target"].split("/")[1])

    async def running() -> int:
        return int((await loads(http, sglang_dp2.url))[rank]["num_running_reqs"])

    for _ in range(40):  # the engine's count can lag the first events
        if await running() == 1:
            break
        await asyncio.sleep(0.05)
    assert await running() == 1
    resp.close()  # the client leaves mid-stream
    freed = False
    for _ in range(100):
        if await running() == 0:
            freed = True
            break
        await asyncio.sleep(0.05)
    SUMMARY.append(f"sglang_dp2: client left a 1500-token stream on rank {rank}: freed {freed}")
    assert freed
    assert await until(lambda: all(t.outstanding == 0 for t in router.registry.targets()))


async def test_an_rl_loop_through_dprouter_loses_no_request_across_a_weight_update(
    sglang_attn2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """miles' calls against the real engine (attention DP over 2 ranks): register, sessions,
    abort_all mid-batch, then pause (retract) -> flush -> update from disk (the same
    weights, a new version) -> version -> continue with requests in flight."""
    server = sglang_attn2
    router = await start_router(
        RouterConfig(policy="manual", assignment="min_load", health_interval=0), settle=False
    )
    url = router.url
    add = {"url": server.url, "worker_type": "regular"}
    async with http.post(url + "/workers?wait=60", json=add) as r:
        assert r.status == 201, await r.text()
        assert (await r.json())["dp_size"] == 2
    version = router.registry.workers["w0"].weight_version
    ranks = set()
    for _ in range(3):
        send = post(http, url, "/generate", generate_body(), {"X-SMG-Routing-Key": "s1"})
        ranks.add((await send())[1]["meta_info"]["dp_rank"])
    assert len(ranks) == 1

    async def one(max_tokens: int) -> tuple[int, Any, str | None]:
        body = generate_body()
        body["sampling_params"]["max_new_tokens"] = max_tokens
        timeout = aiohttp.ClientTimeout(total=180)
        async with http.post(url + "/generate", json=body, timeout=timeout) as r:
            said = await r.json(content_type=None)
            return r.status, said, r.headers.get("x-dprouter-weight-version")

    def in_flight() -> int:
        return sum(t.outstanding for t in router.registry.targets())

    # an over-sampled batch, aborted mid-way: every request answered, none hangs
    batch = [asyncio.create_task(one(2000)) for _ in range(4)]
    assert await until(lambda: in_flight() == 4, seconds=30)
    await asyncio.sleep(0.5)
    async with http.post(url + "/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200, await r.text()
    aborted = await asyncio.wait_for(asyncio.gather(*batch), 60)
    reasons = [
        (s, a["meta_info"]["finish_reason"]["type"] if s == 200 else a) for s, a, _ in aborted
    ]
    # the update cycle, with requests in flight and more arriving while paused
    early = [asyncio.create_task(one(40)) for _ in range(4)]
    assert await until(lambda: in_flight() == 4, seconds=30)
    async with http.post(url + "/pause_generation", json={"mode": "retract"}) as r:
        assert r.status == 200, await r.text()
    late = [asyncio.create_task(one(4)) for _ in range(2)]
    flushed = None
    for _ in range(120):  # miles retries it for up to 60 s
        async with http.get(url + "/flush_cache") as r:
            flushed = r.status
        if flushed == 200:
            break
        await asyncio.sleep(0.5)
    weights = {"model_path": str(sglang_server.model_dir(server.model))}
    async with http.post(url + "/update_weights_from_disk", json=weights) as r:
        updated = r.status, await r.json()
    new = {"new_version": "rl-2", "abort_all_requests": False}
    async with http.post(url + "/update_weight_version", json=new) as r:
        assert r.status == 200, await r.text()
    async with http.post(url + "/continue_generation", json={}) as r:
        assert r.status == 200, await r.text()
    done = await asyncio.wait_for(asyncio.gather(*early, *late), 180)
    after = await one(2)
    SUMMARY.append(
        f"sglang_attn2 RL loop: abort_all mid-batch -> {reasons}; flush {flushed}; "
        f"update from disk {updated[0]}; {len(done)} requests across the cycle -> "
        f"{[s for s, _, _ in done]}; version {version} -> {after[2]}"
    )
    assert reasons == [(200, "abort")] * 4  # SGLang ends each with finish_reason abort
    assert flushed == 200 and updated[0] == 200, updated
    assert [s for s, _, _ in done] == [200] * 6
    assert [h for _, _, h in done[4:]] == ["rl-2", "rl-2"]  # sent after the pause
    assert after[0] == 200 and after[2] == "rl-2"
    assert after[1]["meta_info"]["weight_version"] == "rl-2"  # the engine says it too
    assert await until(lambda: in_flight() == 0)


async def test_an_update_sent_straight_to_the_engine_is_what_the_router_says(
    sglang_attn2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """miles updates the engines itself, not through the router: from disk with a version,
    then update_weight_version. A request pinned to the new weights goes without waiting
    (the router reads the engine's version when it asks), and the answers' header is the
    version the engine states in them. No periodic read: neither may depend on it."""
    server = sglang_attn2
    router = await start_router(config(server, hold_wait=120, version_interval=0))
    url = router.url
    weights = {"model_path": str(sglang_server.model_dir(server.model)), "weight_version": "31"}
    async with http.post(server.url + "/update_weights_from_disk", json=weights) as r:
        assert r.status == 200, await r.text()
    assert router.registry.workers["w0"].weight_version != "31"  # the router was not told
    pinned = post(http, url, "/generate", generate_body(), {"X-DPRouter-Weight-Version": ">=31"})
    loop = asyncio.get_running_loop()
    began = loop.time()
    _, answer = await asyncio.wait_for(pinned(), 60)  # far below --hold-wait's 120 s
    waited = loop.time() - began
    assert answer["meta_info"]["weight_version"] == "31"
    async with http.post(server.url + "/update_weight_version", json={"new_version": "32"}) as r:
        assert r.status == 200, await r.text()
    async with http.post(url + "/generate", json=generate_body()) as r:
        assert r.status == 200, await r.text()
        header = r.headers["x-dprouter-weight-version"]
        said = (await r.json())["meta_info"]["weight_version"]
    async with http.get(url + "/workers") as r:
        listed = [w["weight_version"] for w in (await r.json())["workers"]]
    SUMMARY.append(
        f"sglang_attn2 engine-direct update: pinned >=31 served in {waited:.2f} s; "
        f"then update_weight_version 32: header {header}, meta_info {said}, /workers {listed}"
    )
    assert header == said == "32"
    assert listed == ["32"]


async def test_the_engine_killed_mid_run_then_restarted(
    sglang_dp2: SglangServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Last in this file: it kills the shared DP=2 server (and brings it back)."""
    router = await start_router(config(sglang_dp2))
    outcomes: Counter[str] = Counter()

    async def one(max_tokens: int) -> None:
        body = generate_body()
        body["sampling_params"]["max_new_tokens"] = max_tokens
        try:
            async with http.post(
                router.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=60)
            ) as r:
                await r.read()
                outcomes[f"http_{r.status}"] += 1
        except aiohttp.ClientError as exc:
            outcomes[type(exc).__name__] += 1

    load = [asyncio.create_task(one(400)) for _ in range(6)]
    assert await until(
        lambda: sum(t.outstanding for t in router.registry.targets()) == 6, seconds=10
    )
    await asyncio.to_thread(sglang_dp2.kill)
    await asyncio.wait_for(asyncio.gather(*load), 60)  # every client answered: none hangs
    await asyncio.gather(*(one(2) for _ in range(4)))  # while the engine is down
    async with http.get(router.url + "/health") as r:
        assert r.status == 200
    assert not router.registry.snapshot.pool()  # out until it answers again
    await asyncio.to_thread(sglang_dp2.start)
    await asyncio.to_thread(sglang_dp2.wait_ready)
    assert await router.settled(60)
    ranks: Counter[int] = Counter()
    for _ in range(4):
        _, answer = await post(http, router.url, "/generate", generate_body())()
        ranks[answer["meta_info"]["dp_rank"]] += 1
    SUMMARY.append(
        f"sglang_dp2 killed with 6 in flight: client outcomes {dict(outcomes)}; "
        f"after restart, engine dp_rank {dict(ranks)}"
    )
    assert set(outcomes) <= {"http_502", "http_503"}  # a clear error, each of them
    assert sum(outcomes.values()) == 10
    assert ranks == {0: 2, 1: 2}  # traffic on both ranks again


async def test_dprouter_installs_beside_sglang_and_routes_from_there(
    sglang_dp2: SglangServer,
) -> None:
    """dprouter installed into SGLang's own environment changes nothing there and routes."""
    python, home = sglang_server.venv_python(), sglang_server.home()
    await installs_beside("SGLang", python, home, sglang_dp2.url)
