"""A request sampling n sequences, routed as its n samples would be (``--samples split``;
by default they stay together): the policy picks each sample's target,
one request goes to each target reached with n its share, and the client gets one answer
with every sample. What each simulated engine received, and on which rank, shows it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from tests.conftest import StartCluster, StartRouter, workers
from tests.test_kv_routing import prefix_config, spec, words
from tests.test_pd_prefix import engine as events_engine

LIMITS = RankLimits(max_model_len=8192, kv_tokens=200_000)


def shares(server: SimServer, field: str = "n") -> Counter[int | None]:
    """The samples each rank was asked for."""
    got: Counter[int | None] = Counter()
    for r in server.received:
        params = r.body.get("sampling_params", {}) if field == "sampling_params" else r.body
        got[r.rank] += int(params.get("n", 1))
    return got


async def completions(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-dprouter-target"], await r.json()


async def test_n_samples_go_to_the_ranks_the_policy_picks_and_come_back_as_one(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """least_load over two ranks: the 4 samples of one request go 2 and 2 (as 4 separate
    requests would), and the answer holds 4 choices numbered 0-3 and all their tokens."""
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, limits=LIMITS)])).servers
    config = RouterConfig(workers=workers(engine.url), policy="least_load", samples="split")
    router = await start_router(config)
    body = {"prompt": "sample a group", "max_tokens": 6, "n": 4}
    targets, answer = await completions(http, router.url, body)
    assert sorted(targets.split(",")) == ["w0/0", "w0/1"]
    assert shares(engine) == {0: 2, 1: 2}
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"]["completion_tokens"] == 24
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + 24
    assert all(t.outstanding == 0 for t in router.registry.targets())


@pytest.mark.parametrize(
    ("extra", "config"),
    [
        ({"stream": True}, {"samples": "split"}),  # its chunks would need renumbering
        ({"seed": 7}, {"samples": "split"}),  # each part would draw the same samples
        ({}, {"samples": "together"}),
        ({}, {}),  # the default
    ],
)
async def test_n_samples_stay_together_where_splitting_would_change_the_answer(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    extra: dict[str, Any],
    config: dict[str, Any],
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, limits=LIMITS)])).servers
    router = await start_router(
        RouterConfig(workers=workers(engine.url), policy="least_load", **config)
    )
    body = {"prompt": "sample a group", "max_tokens": 6, "n": 4, **extra}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()
    assert list(shares(engine).values()) == [4]  # one request, every sample on one rank


async def test_sglang_generate_samples_split_and_join_in_one_list(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(persona="sglang", dp_size=2, dp_attention=True, limits=LIMITS)
    (engine,) = (await start_cluster([config])).servers
    options = RouterConfig(workers=workers(engine.url), policy="least_load", samples="split")
    router = await start_router(options)
    body = {"text": "sample a group", "sampling_params": {"max_new_tokens": 5, "n": 4}}
    async with http.post(router.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert isinstance(answer, list) and len(answer) == 4
    assert [a["meta_info"]["completion_tokens"] for a in answer] == [5] * 4
    assert shares(engine, "sampling_params") == {0: 2, 1: 2}


async def test_a_group_as_one_request_computes_its_prompt_where_prefix_routing_says(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    """GRPO's group as one request of n = 8 on an SGLang DP4 engine publishing its KV
    events, under prefix and ``--samples split``: the samples spread over the
    ranks as separate samples would (never 8 on one rank), one part per rank reached, and
    each rank reached computes the prompt once."""
    config = events_engine(tokenizer_dir, 4, persona="sglang")
    (engine,) = (await start_cluster([config])).servers
    router = await start_router(prefix_config(tokenizer_dir, spec(engine), samples="split"))
    body = {"prompt": words(5, 900), "max_tokens": 8, "n": 8}
    targets, answer = await completions(http, router.url, body)
    assert len(answer["choices"]) == 8
    reached = shares(engine)
    assert sum(reached.values()) == 8 and max(reached.values()) < 8, reached
    assert len(targets.split(",")) == len(reached)  # one part per rank reached
    prompt = answer["usage"]["prompt_tokens"]
    for rank in reached:
        stats = engine.engine.ranks[rank or 0].stats
        computed = stats.prefix_queries - stats.prefix_hits
        assert computed < 2 * prompt, (rank, computed, prompt)  # once, not once per part
