"""Token load: what the engines report they hold, fused with what the router sent, and the
output budget a stream spends as its tokens pass."""

from __future__ import annotations

import asyncio
import zlib
from functools import partial

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError
from dprouter.fleet.board import MODELS, Board
from dprouter.fleet.engine_load import sglang_load, vllm_loads
from dprouter.proxy.output_budget import OutputEstimate, completion_tokens
from dprouter.proxy.parse import DEFAULT_OUTPUT, parse
from dprouter.sim.model.config import EngineConfig, Persona
from tests.conftest import StartCluster, StartRouter, completions_engine, serving, until, workers

LONG = "a rather long prompt that fills the cache " * 60  # ~2,500 characters


def test_reported_tokens_count_with_what_was_sent_since() -> None:
    board = Board(slots=4)
    board.add(1, 1, 100)
    assert board.token_load_of(1) == 100  # nothing reported: the router's own count
    board.report(1, 3, 5_000)  # the engine holds more (another router's requests)
    assert board.token_load_of(1) == 5_000
    board.add(1, 1, 300)  # sent since the report: not in it yet
    assert board.token_load_of(1) == 5_300
    board.add(1, 0, -50)  # a stream spent some of its output budget
    assert board.token_load_of(1) == 5_250
    board.report(1, 2, 10)  # the engine holds little: the router's own count stands
    assert board.token_load_of(1) == 350


def test_vllm_tokens_are_kv_usage_times_the_engines_capacity() -> None:
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {e}.0\n'
        f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} 1.0\n'
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {0.25 * e}\n'
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{e}",'
        f'num_gpu_blocks="1000"}} 1.0\n'
        for e in range(3)
    )
    assert vllm_loads(text) == {0: (1, 0), 1: (2, 4_000), 2: (3, 8_000)}
    assert vllm_loads(text.replace("cache_config_info", "other_info")) == {
        0: (1, 0),
        1: (2, 0),  # no capacity known: no tokens
        2: (3, 0),
    }


def test_sglang_tokens_are_used_plus_queued_uncached() -> None:
    entry: dict[str, object] = {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 1}
    entry |= {"num_used_tokens": 900, "num_waiting_uncached_tokens": 100}
    assert sglang_load(entry) == (3, 1_000)
    assert sglang_load({"num_running_reqs": 1}) == (1, 0)


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_rank_whose_engine_holds_many_tokens_gets_no_new_work_under_min_tokens(
    persona: Persona,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(
        RouterConfig(workers=workers(engine.url), policy="min_tokens", load_interval=0.05)
    )
    rank0, rank1 = router.registry.targets()

    async def elsewhere() -> None:  # another client fills rank 0's cache behind the router
        if persona == "vllm":
            url, body = engine.url + "/v1/completions", {"prompt": LONG, "max_tokens": 400}
            headers = {"X-data-parallel-rank": "0"}
        else:
            url, headers = engine.url + "/generate", {}
            body = {
                "text": LONG,
                "sampling_params": {"max_new_tokens": 400},
                "data_parallel_rank": 0,
            }
        async with http.post(url, json=body, headers=headers) as r:
            await r.read()

    task = asyncio.create_task(elsewhere())
    try:
        assert await until(lambda: rank0.reported_tokens > 300)
        assert rank0.outstanding_tokens == rank1.outstanding_tokens == 0  # equal, for the router
        ranks = []
        for _ in range(4):
            body = {"prompt": "short", "max_tokens": 8}
            async with http.post(router.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                ranks.append(r.headers["x-sim-dp-rank"])
        assert ranks == ["1"] * 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_streamed_requests_count_falls_as_its_tokens_pass(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=1)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), load_interval=0))
    (target,) = router.registry.targets()
    seen: list[int] = []
    body = {"prompt": "count me down", "max_tokens": 120, "stream": True}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for _ in r.content.iter_any():
            seen.append(target.outstanding_tokens)
    assert seen[0] >= 120  # prompt + the whole budget, at first
    assert seen[-1] < seen[0] - 90  # most of the budget spent by the end of the stream
    assert seen == sorted(seen, reverse=True)  # never back up
    assert target.outstanding_tokens == 0 and target.worker.outstanding_tokens == 0
    # a request that is not streamed keeps its whole count until it ends
    async with http.post(router.url + "/v1/completions", json=body | {"stream": False}) as r:
        assert r.status == 200
    assert target.outstanding_tokens == 0


def test_completion_tokens_are_read_from_a_whole_answer() -> None:
    vllm = b'{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens": 37}}'
    assert completion_tokens(vllm) == 37
    sglang = b'{"text":"hi","meta_info":{"prompt_tokens":3,"completion_tokens":12,"e2e":0.1}}'
    assert completion_tokens(sglang) == 12
    assert completion_tokens(b'{"usage":{"completion_tokens":null}}') is None
    assert completion_tokens(b'{"data":[]}') is None


def test_a_budget_is_the_cap_until_lengths_are_known_then_the_typical_length() -> None:
    estimate = OutputEstimate()
    assert estimate.budget(12_000) == 12_000 and estimate.budget(None) == DEFAULT_OUTPUT
    for _ in range(100):
        estimate.observe(300)
    assert estimate.budget(12_000) == 300  # what requests really run to
    assert estimate.budget(100) == 100  # never above the cap
    assert estimate.budget(0) == 0  # SGLang prefill only


def test_on_a_board_every_process_reads_and_updates_one_average() -> None:
    """Two serving processes' estimates on one board: a length one saw moves the other's
    budget at once; a model whose cell another model holds is averaged by each alone."""
    board = Board(slots=4)
    one, two = OutputEstimate(board=board), OutputEstimate(board=board)
    assert one.budget(5_000, "m") == two.budget(5_000, "m") == 5_000
    one.observe(300, "m")
    assert two.budget(5_000, "m") == 300
    two.observe(500, "m")
    assert one.budget(5_000, "m") == two.budget(5_000, "m") == 310  # 300 + 0.05 x 200

    def bucket(name: str) -> int:
        return (zlib.crc32(name.encode()) + 1) % MODELS

    taken = next(f"x{i}" for i in range(10_000) if bucket(f"x{i}") == bucket("m"))
    assert one.cell(taken) == -1  # its cell is m's: kept per process
    one.observe(40, taken)
    assert one.budget(5_000, taken) == 40 and two.budget(5_000, taken) == 5_000


async def test_requests_are_counted_by_the_output_they_typically_run_to(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=1)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), load_interval=0))
    (target,) = router.registry.targets()
    for _ in range(3):  # whole answers: their usage tells the length
        body = {"prompt": "short", "max_tokens": 20}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    body = {"prompt": "a cap far above", "max_tokens": 5_000, "stream": True}
    r = await http.post(router.url + "/v1/completions", json=body)
    await r.content.readuntil(b"\n\n")
    counted = target.outstanding_tokens
    r.close()  # the client leaves: 5,000 tokens would take the simulator 30 s
    assert 20 <= counted < 40  # prompt + ~20, not prompt + 5,000
    assert await until(lambda: target.outstanding_tokens == 0)


async def test_sglang_n_samples_teach_each_samples_length(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """SGLang answers a request of n samples with a list, each sample's usage its own:
    20 tokens each is learnt as 20, not 20 / n (OpenAI's usage, summed over n, is)."""
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=1)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), load_interval=0))
    (target,) = router.registry.targets()
    for _ in range(3):
        body = {"text": "short", "sampling_params": {"max_new_tokens": 20, "n": 4}}
        async with http.post(router.url + "/generate", json=body) as r:
            answer = await r.json()
            assert r.status == 200 and len(answer) == 4, answer
    body = {"text": "a cap far above", "sampling_params": {"max_new_tokens": 5_000}}
    r = await http.post(router.url + "/generate", json={**body, "stream": True})
    await r.content.readuntil(b"\n\n")
    counted = target.outstanding_tokens
    r.close()
    assert 20 <= counted < 40  # prompt + ~20, not prompt + 5
    assert await until(lambda: target.outstanding_tokens == 0)


async def test_with_output_budget_cap_a_request_is_counted_by_its_max_tokens(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """``--output-budget cap``: the client's max_tokens is the length it expects, whatever
    the answers before ran to."""
    (engine,) = (await start_cluster([EngineConfig(dp_size=1)])).servers
    config = RouterConfig(workers=workers(engine.url), load_interval=0, output_budget="cap")
    router = await start_router(config)
    (target,) = router.registry.targets()
    for _ in range(3):
        async with http.post(
            router.url + "/v1/completions", json={"prompt": "short", "max_tokens": 20}
        ) as r:
            assert r.status == 200
    body = {"prompt": "a cap far above", "max_tokens": 5_000, "stream": True}
    r = await http.post(router.url + "/v1/completions", json=body)
    await r.content.readuntil(b"\n\n")
    counted = target.outstanding_tokens
    r.close()
    assert 4_900 <= counted < 5_100  # prompt + 5,000, less what streamed by the first event
    assert await until(lambda: target.outstanding_tokens == 0)


def test_an_unknown_output_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="output_budget must be typical or cap"):
        validate(RouterConfig(output_budget="median"))


def test_a_request_sampling_n_is_counted_n_times() -> None:
    """``n`` sequences from one prompt take n running slots and n outputs: OpenAI's ``n``,
    SGLang's ``sampling_params.n``; anything else counts 1 (the engine answers it)."""
    body = b'{"prompt": "x", "max_tokens": 50, "n": 4}'
    found = parse(body, "completion", {})
    assert (found.samples, found.output, found.tokens - found.prompt_tokens) == (4, 200, 200)
    native = b'{"text": "x", "sampling_params": {"max_new_tokens": 10, "n": 3}}'
    assert parse(native, "generate", {}).output == 30
    assert parse(b'{"prompt": "x"}', "completion", {}).samples == 1
    for odd in (b'{"prompt": "x", "n": 0}', b'{"prompt": "x", "n": "two"}'):
        assert parse(odd, "completion", {}).samples == 1  # the engine says what it makes of it
    estimate = OutputEstimate()
    found.output = 0
    estimate.apply(found)
    assert found.output == 4 * estimate.predict(found)


async def test_a_request_sampling_n_takes_n_of_its_ranks_load(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """While a request of n = 4 runs on one rank (``--samples together``), three single
    requests all go to the other under least_load: that rank holds 4 sequences, not 1. (A
    stand-in engine answers, keeping every request waiting until all have arrived.)"""
    release = asyncio.Event()
    ranks: list[tuple[int, str]] = []  # (n, rank), in arrival order

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        ranks.append((body["n"], request.headers["X-data-parallel-rank"]))
        await release.wait()  # all in flight together
        return web.json_response({"choices": [], "usage": {"completion_tokens": 4}})

    async with serving(completions_engine(completions)) as url:
        stand_in = workers(url, dialect="vllm", dp_size=2)
        config = RouterConfig(workers=stand_in, policy="least_load", samples="together")
        router = await start_router(config)

        async def send(n: int, i: int = 0) -> None:
            body = {"prompt": f"sample me {i}", "max_tokens": 4, "n": n}
            async with http.post(router.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        def arrived(n: int) -> bool:
            return len(ranks) == n

        def in_flight() -> int:
            return sum(t.outstanding for t in router.registry.targets())

        sent = [asyncio.create_task(send(4))]
        assert await until(lambda: in_flight() == 4)
        for i in range(3):  # one after another, each still running when the next goes
            sent.append(asyncio.create_task(send(1, i)))
            assert await until(partial(arrived, i + 2))
        release.set()
        await asyncio.gather(*sent)
    (_, group), *singles = ranks
    assert [rank for _, rank in singles] == [str(1 - int(group))] * 3, ranks
    assert all(t.outstanding == 0 for t in router.registry.targets())
