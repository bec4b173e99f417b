"""Prefix routing under --pd: the prefill target is chosen on the prefill engines' KV
events, the decode target on the decode engines' when they publish. Simulated P/D engines
publish their KV events as a real prefill engine does (it stores the prompt's blocks as it
computes them); a multi-turn chat returns to the rank that holds its prefix, and the
prefill engines' own prefix-cache counters show the hits. ``measure`` compares the
prefill engines' hit rate under --pd with the plain router's on the same chat workload."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.core.headers import PREFILL_HEADER, TARGET_HEADER
from dprouter.core.types import PdMode
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, PdConfig, RankLimits
from dprouter.sim.model.kvevents import KvEventsConfig
from tests.conftest import StartCluster, StartRouter, metric_sum, until

BLOCK = 16
FLOWS: tuple[PdMode, ...] = ("vllm-nixl", "vllm-mooncake", "sglang")
Messages = list[dict[str, str]]


def engine(
    tokenizer_dir: Path,
    dp: int,
    mode: PdMode | None = None,
    role: Literal["prefill", "decode"] = "prefill",
    events: bool = True,
    persona: Literal["vllm", "sglang"] = "vllm",
) -> EngineConfig:
    """An engine (a P/D role with ``mode``) whose ranks publish their KV events."""
    kv = KvEventsConfig(
        enable_kv_cache_events=events,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        topic="kv",
    )
    pd = None if mode is None else PdConfig(mode=mode, role=role, kv_wait=5.0)
    limits = RankLimits(prefix_cache_blocks=4096, kv_tokens=200_000, max_model_len=8192)
    return EngineConfig(
        persona=persona if pd is None else pd.persona,
        dp_size=dp,
        limits=limits,
        kv_events=kv,
        tokenizer=str(tokenizer_dir),
        pd=pd,
    )


def spec(server: SimServer, **keys: Any) -> WorkerSpec:
    """The worker as an operator writes it: its rank 0's publisher and replay endpoints,
    its block size (so what the router sends counts as pending from the first request)."""
    if server.kv is not None:
        events, replay = server.kv.endpoints[0], server.kv.replay_endpoints[0]
        keys |= {"kv_events": events, "kv_replay": replay, "kv_block_size": BLOCK}
    return WorkerSpec(server.url, **keys)


def pd_specs(mode: PdMode, prefills: list[SimServer], decodes: list[SimServer]) -> list[WorkerSpec]:
    def bootstrap(s: SimServer) -> int | None:
        # vLLM does not say where its Mooncake bootstrap server listens: it is configured
        return s.pd.bootstrap_port if mode == "vllm-mooncake" and s.pd is not None else None

    return [spec(s, role="prefill", bootstrap_port=bootstrap(s)) for s in prefills] + [
        spec(s, role="decode") for s in decodes
    ]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["router", "rank", "engine", "cache", "block", "prefix", "token", "event", "load"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(n))


def conversation(n: int, turns: int, systems: int) -> list[Messages]:
    """Each turn's messages: the last turn's, its scripted answer and a new question; the
    system prompt is one of ``systems`` shared by every conversation."""
    messages: Messages = [{"role": "system", "content": words(n % systems, 60)}]
    out = []
    for t in range(turns):
        messages = [*messages, {"role": "user", "content": words(1000 * n + t, 24)}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": words(-1000 * n - t, 24)}]
    return out


@dataclass
class Served:
    """Where one turn went: the prefill target (the target itself on a plain router) and
    the decode target."""

    prefill: str
    decode: str


async def chat(
    http: aiohttp.ClientSession, url: str, turns: list[Messages], stream: bool = False
) -> list[Served]:
    """One conversation, turn after turn."""
    served = []
    for i, messages in enumerate(turns):
        body = {"messages": messages, "max_tokens": 3, "stream": stream and i % 2 == 1}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            target = r.headers[TARGET_HEADER]
            served.append(Served(r.headers.get(PREFILL_HEADER, target), target))
    return served


async def chats(
    http: aiohttp.ClientSession,
    url: str,
    conversations: int,
    turns: int,
    systems: int,
    at_once: int | None = None,
) -> list[list[Served]]:
    """``conversations``, ``at_once`` of them in flight (all, unless told), each turn
    after its last."""
    room = asyncio.Semaphore(at_once or conversations)

    async def one(n: int) -> list[Served]:
        async with room:
            return await chat(http, url, conversation(n, turns, systems), stream=True)

    return list(await asyncio.gather(*(one(n) for n in range(conversations))))


def prompt_ids(server: SimServer, messages: Messages) -> list[int]:
    return server.encoder.encode_chat([(m["role"], m["content"]) for m in messages])


def shared(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def hit_rate(servers: list[SimServer]) -> float:
    """Prompt tokens found in the engines' prefix caches, of those they were asked for."""
    ranks = [r for s in servers for r in s.engine.ranks]
    return sum(r.stats.prefix_hits for r in ranks) / max(
        sum(r.stats.prefix_queries for r in ranks), 1
    )


async def streams_up(router: Router, ranks: int) -> None:
    """Every rank's KV events are followed: each stream has joined its publisher."""
    feed = router.parts.feed
    assert feed is not None
    assert await until(lambda: len(feed.streams) == ranks, 10), feed.streams
    joins = [stream.joined.wait() for stream, _ in feed.streams.values()]
    await asyncio.wait_for(asyncio.gather(*joins), 10)


async def prefill_prefix(
    start_cluster: StartCluster, start_router: StartRouter, tokenizer_dir: Path, mode: PdMode
) -> tuple[SimServer, Router]:
    """A DP4 prefill engine publishing its KV events, a DP2 decode publishing none, and a
    router over them whose prefill side is ``prefix`` (the decode side's round robin is
    left as it was), its event streams up: the prefill engine and the router."""
    cluster = await start_cluster(
        [engine(tokenizer_dir, 4, mode), engine(tokenizer_dir, 2, mode, "decode", events=False)]
    )
    prefill, decode = cluster.servers
    config = RouterConfig(
        pd=mode,
        workers=tuple(pd_specs(mode, [prefill], [decode])),
        prefill_policy="prefix",
        tokenizers=(str(tokenizer_dir),),
        seed=1,
    )
    router = await start_router(config)
    await streams_up(router, 4)
    return prefill, router


@pytest.mark.parametrize("mode", FLOWS)
async def test_a_conversation_returns_to_the_prefill_rank_holding_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    mode: PdMode,
) -> None:
    """Four conversations at once over a DP4 prefill (decodes publish nothing): every turn
    of one goes to the prefill rank of its first, and that engine counts the prompt of
    each turn after the first as a hit, as far as the last turn's prompt went."""
    prefill, router = await prefill_prefix(start_cluster, start_router, tokenizer_dir, mode)
    served = await chats(http, router.url, 4, 4, 2)
    assert [len({s.prefill for s in turns}) for turns in served] == [1] * 4, served
    assert len({turns[0].prefill for turns in served}) >= 2  # spread by load, not piled on one
    assert len({s.decode for turns in served for s in turns}) == 2  # the decodes by load

    ranks = prefill.engine.ranks
    queried = sum(r.stats.prefix_queries for r in ranks)
    hits = sum(r.stats.prefix_hits for r in ranks)
    # each turn finds what it shares with the last one, in whole blocks (a prompt's last
    # token is always computed)
    held = 0
    for n in range(4):
        ids = [prompt_ids(prefill, messages) for messages in conversation(n, 4, 2)]
        for last, this in itertools.pairwise(ids):
            held += min(shared(last, this), len(this) - 1) // BLOCK * BLOCK
    assert held > queried / 2  # the check is not of a trivial bound
    assert hits >= held, (hits, held, queried)
    if prefill.config.persona == "vllm":  # the engine says so on its /metrics too
        assert await metric_sum(http, prefill.url, "vllm:prefix_cache_hits_total") == hits
    # what the index learnt is what the prefill engine's ranks stored and published
    feed = router.parts.feed
    assert feed is not None
    stored = sum(len(rank.cache) for rank in ranks)
    assert await until(lambda: feed.index.size == stored), (feed.index.size, stored)


async def test_the_decode_rank_too_when_the_decodes_publish(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    """Decode engines that publish (a decode stores the blocks it receives): under
    ``--policy prefix`` each side follows its own engines' events."""
    mode: PdMode = "vllm-nixl"
    cluster = await start_cluster(
        [engine(tokenizer_dir, 2, mode), engine(tokenizer_dir, 4, mode, "decode")]
    )
    prefill, decode = cluster.servers
    config = RouterConfig(
        pd=mode,
        workers=tuple(pd_specs(mode, [prefill], [decode])),
        policy="prefix",
        tokenizers=(str(tokenizer_dir),),
        seed=1,
    )
    router = await start_router(config)
    await streams_up(router, 6)
    served = await chats(http, router.url, 4, 4, 2)
    assert [len({s.prefill for s in turns}) for turns in served] == [1] * 4, served
    assert [len({s.decode for s in turns}) for turns in served] == [1] * 4, served
    assert len({turns[0].decode for turns in served}) >= 2


@dataclass(frozen=True)
class Chats:
    """A chat workload: ``conversations`` over ``systems`` shared system prompts,
    ``at_once`` of them in flight."""

    conversations: int = 16
    turns: int = 6
    systems: int = 4
    at_once: int = 4


async def measure(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    mode: PdMode,
    load: Chats,
    **options: Any,
) -> tuple[float, float]:
    """The same chat workload through a plain router (``--policy prefix``, one DP4 engine)
    and through a --pd one (a DP4 prefill engine, a DP2 decode), both with ``options``:
    the engines' hit rates, plain and the prefill engine's under --pd."""
    persona: Literal["vllm", "sglang"] = "sglang" if mode == "sglang" else "vllm"
    (plain,) = (await start_cluster([engine(tokenizer_dir, 4, persona=persona)])).servers
    pd_cluster = await start_cluster(
        [engine(tokenizer_dir, 4, mode), engine(tokenizer_dir, 2, mode, "decode", events=False)]
    )
    prefill, decode = pd_cluster.servers
    for workers, pd in [((spec(plain),), None), (tuple(pd_specs(mode, [prefill], [decode])), mode)]:
        router = await start_router(
            RouterConfig(
                pd=pd,
                workers=workers,
                policy="prefix",
                tokenizers=(str(tokenizer_dir),),
                seed=1,
                **options,
            )
        )
        await streams_up(router, 4)
        await chats(http, router.url, load.conversations, load.turns, load.systems, load.at_once)
    return hit_rate([plain]), hit_rate([prefill])


@pytest.mark.parametrize("at_once", [4, 8])
@pytest.mark.parametrize("mode", ["vllm-nixl", "sglang"])
async def test_pd_prefill_hits_match_the_plain_routers(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    mode: PdMode,
    at_once: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under --pd, a multi-turn chat's prefill hits on the prefill engines match the
    plain router's within 0.02: 16 conversations of 6 turns over 4 system prompts, one or
    two in flight per prefill rank."""
    load = Chats(at_once=at_once)
    plain, pd = await measure(start_cluster, start_router, http, tokenizer_dir, mode, load)
    with capsys.disabled():
        print(f"\n{mode}, {at_once} in flight: hit rate plain {plain:.4f}, --pd prefill {pd:.4f}")
    assert plain > 0.5
    assert abs(pd - plain) <= 0.02, (plain, pd)


@pytest.mark.parametrize("mode", ["vllm-nixl", "sglang"])
async def test_pd_prefill_hits_do_not_trail_the_plain_routers_at_16_in_flight(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    mode: PdMode,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Four conversations in flight per prefill rank: the prefill ranks' load swings with
    each turn's arrival, which moved turns off the rank holding them until the prefix
    policy let the queue stand for load over a prefill pool. The plain router still moves
    some (its load terms, differently in each run: docs/pd.md), so the --pd prefill is
    only held not to trail it."""
    load = Chats(at_once=16)
    plain, pd = await measure(start_cluster, start_router, http, tokenizer_dir, mode, load)
    with capsys.disabled():
        print(f"\n{mode}, 16 in flight: hit rate plain {plain:.4f}, --pd prefill {pd:.4f}")
    assert plain > 0.5
    assert pd >= plain - 0.02, (plain, pd)


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl"])
async def test_a_group_computes_its_prompt_once_per_prefill_rank(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    mode: PdMode,
) -> None:
    """Eight samples of one long prompt at once over a DP4 prefill: each prefill rank they
    reach computes it once. An SGLang prefill caches a prompt once computed, so a sample
    sent where a sibling is computing it waits in the router for the rank's events."""
    prefill, router = await prefill_prefix(start_cluster, start_router, tokenizer_dir, mode)
    messages = [{"role": "user", "content": words(5, 1500)}]  # ~4,900 tokens
    body = {"messages": messages, "max_tokens": 3}

    async def sample() -> str:
        async with http.post(router.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return r.headers.get(PREFILL_HEADER, r.headers[TARGET_HEADER])

    reached = set(await asyncio.gather(*(sample() for _ in range(8))))
    ids = prompt_ids(prefill, messages)
    full = (len(ids) - 1) // BLOCK * BLOCK
    ranks = prefill.engine.ranks
    computed = sum(r.stats.prefix_queries - r.stats.prefix_hits for r in ranks)
    assert len(reached) >= 2, reached  # spread, not piled on one rank
    # once per rank reached: the rest hit all but the prompt's last partial block
    assert computed == len(reached) * len(ids) + (8 - len(reached)) * (len(ids) - full)
