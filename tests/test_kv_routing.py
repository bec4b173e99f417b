"""Prefix routing end to end: the router (--policy prefix) over simulated DP4 engines that
publish their KV-cache events (both personas, both encodings) and tokenise with the same
tokenizer files as the router. What the router's index says each rank holds is checked
against each rank's own prefix cache; where requests land, against what the engines
counted as cache hits."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio

from dprouter.config import RouterConfig
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.keys import prompt_keys
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from dprouter.sim.model.kvevents import Encoding, KvEventsConfig
from dprouter.sim.model.prefix import block_hashes
from tests.conftest import StartCluster, StartRouter, metric_sum, until

BLOCK = 16
DP = 4
U64 = (1 << 64) - 1
PERSONAS = ("vllm", "sglang")
FLUSH = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_dir)


def engine(
    persona: str, tokenizer_dir: Path, encoding: Encoding = "map", blocks: int = 4096, **kv: Any
) -> EngineConfig:
    """A DP4 engine publishing every rank's KV events (PUB and replay on free ports)."""
    events = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        topic="kv",
        encoding=encoding,
        **kv,
    )
    limits = RankLimits(prefix_cache_blocks=blocks, kv_tokens=200_000, max_model_len=8192)
    return EngineConfig(
        persona=persona,  # type: ignore[arg-type]
        dp_size=DP,
        limits=limits,
        kv_events=events,
        tokenizer=str(tokenizer_dir),
    )


def spec(server: SimServer, **keys: Any) -> WorkerSpec:
    """The worker with its rank 0's endpoints, as an operator writes them."""
    assert server.kv is not None
    events, replay = server.kv.endpoints[0], server.kv.replay_endpoints[0]
    return WorkerSpec(server.url, kv_events=events, kv_replay=replay, **keys)


def prefix_config(tokenizer_dir: Path, *workers: WorkerSpec, **keys: Any) -> RouterConfig:
    return RouterConfig(
        workers=workers, policy="prefix", tokenizers=(str(tokenizer_dir),), seed=1, **keys
    )


def feed_of(router: Router) -> Feed:
    feed = router.parts.feed
    assert feed is not None
    return feed


def wire_hash(h: int, persona: str) -> int:
    """vLLM publishes unsigned 64-bit hashes, SGLang signed ones (the sim's own)."""
    return h & U64 if persona == "vllm" else h


def indexed(feed: Feed, worker: str, rank: int) -> set[int | bytes]:
    found = feed.index.ranks.get((worker, rank))
    return set(found.blocks) if found is not None else set()


def reported(server: SimServer, rank: int) -> set[int | bytes]:
    persona = server.config.persona
    return {wire_hash(h, persona) for h in server.engine.ranks[rank].cache.blocks()}


def agrees(feed: Feed, server: SimServer, worker: str = "w0") -> bool:
    """Every rank's blocks in the index are exactly those its engine's cache holds."""
    return all(indexed(feed, worker, r) == reported(server, r) for r in range(DP))


def differences(feed: Feed, server: SimServer, worker: str = "w0") -> dict[int, str]:
    out = {}
    for r in range(DP):
        mine, theirs = indexed(feed, worker, r), reported(server, r)
        if mine != theirs:
            out[r] = f"index only {len(mine - theirs)}, engine only {len(theirs - mine)}"
    return out


def leading(server: SimServer, rank: int, ids: list[int]) -> int:
    """Blocks of ``ids`` the rank's cache holds from the start (without touching its LRU)."""
    cache = server.engine.ranks[rank].cache
    n = 0
    for h in block_hashes(ids, BLOCK):
        if h not in cache:
            break
        n += 1
    return n


def matched(feed: Feed, worker: str, ids: list[int]) -> dict[int, int]:
    """What the index says each rank holds of ``ids``, in leading blocks, by dp rank."""
    index = feed.index
    bits = {index.ranks[(worker, r)].bit: r for r in range(DP) if (worker, r) in index.ranks}
    among = sum(1 << b for b in bits)
    keys = prompt_keys(np.asarray(ids, dtype=np.int64), BLOCK)
    found = index.match(keys, among)
    return {bits[b]: n for b, n in found.items()}


def engine_matched(server: SimServer, ids: list[int]) -> dict[int, int]:
    return {r: n for r in range(DP) if (n := leading(server, r, ids))}


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["router", "rank", "engine", "cache", "block", "prefix", "token", "event", "load"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(n))


@dataclass
class Workload:
    """A mixed workload: chats over a few shared system prompts, completions over a few
    shared documents; each request's prompt ids kept, to check the index by key too."""

    tok: ModelTokenizer
    prompts: list[list[int]] = field(default_factory=list)

    def chat(self, system: int, user: int) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": words(system, 40)},
            {"role": "user", "content": words(1000 + user, 8)},
        ]
        self.prompts.append(self.tok.encode_chat(messages))
        return {"messages": messages}

    def completion(self, doc: int, tail: int) -> dict[str, Any]:
        text = words(500 + doc, 40) + " " + words(2000 + tail, 8)
        self.prompts.append(self.tok.encode(text))
        return {"prompt": text}


async def send(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rank: int | None = None
) -> dict[str, Any]:
    """One request through ``url``; the answer, with the rank that served it."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    async with http.post(url + path, json={**body, "max_tokens": 2}, headers=headers) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        answer["rank"] = int(r.headers["x-sim-dp-rank"])
    return answer


async def mixed(http: aiohttp.ClientSession, url: str, load: Workload, rounds: int) -> None:
    for i in range(rounds):
        bodies = [load.chat(i % 3, i * 8 + j) for j in range(4)]
        bodies += [load.completion(i % 2, i * 8 + j) for j in range(4)]
        await asyncio.gather(*(send(http, url, b) for b in bodies))


def check_keys(feed: Feed, server: SimServer, prompts: list[list[int]]) -> None:
    """Prompt by prompt, the index matches each rank as far as its engine's cache does."""
    held = 0
    for ids in prompts:
        found = engine_matched(server, ids)
        assert matched(feed, "w0", ids) == found
        held += bool(found)
    assert held  # some prompts are held somewhere: the check is not of empty sets


@pytest.mark.parametrize(
    ("persona", "encoding"),
    [("vllm", "map"), ("vllm", "array"), ("sglang", "map"), ("sglang", "array")],
)
async def test_the_index_is_what_each_rank_holds(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,
    persona: str,
    encoding: Encoding,
) -> None:
    """Both encodings decode end to end: after a mixed workload of chats and completions
    with evictions (a 24-block cache a rank), a flush, and more, the index holds exactly
    each rank's blocks, and matches each prompt as far as each rank's cache does."""
    cluster = await start_cluster([engine(persona, tokenizer_dir, encoding, blocks=24)])
    server = cluster[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    feed = feed_of(router)
    load = Workload(tok)
    await mixed(http, router.url, load, 3)
    assert await until(lambda: agrees(feed, server)), differences(feed, server)
    check_keys(feed, server, load.prompts)
    assert feed.index.counts.removed > 0  # evictions happened, and were followed
    assert feed.index.size == sum(len(rank.cache) for rank in server.engine.ranks)
    assert sum(bool(reported(server, r)) for r in range(DP)) >= 2  # spread, not one rank

    async with http.post(server.url + FLUSH[persona]) as r:
        assert r.status == 200
    assert await until(lambda: feed.index.size == 0), differences(feed, server)
    assert feed.index.counts.cleared >= DP
    assert not feed.index.entries

    await mixed(http, router.url, load, 2)
    assert await until(lambda: agrees(feed, server)), differences(feed, server)
    check_keys(feed, server, load.prompts)
    streams = [stream for stream, _ in feed.streams.values()]
    assert len(streams) == DP and not any(s.counts.bad or s.counts.restarts for s in streams)


async def hits(http: aiohttp.ClientSession, server: SimServer, rank: int) -> float:
    """The rank's prefix-cache hits as its engine reports them: vLLM's counter of cached
    tokens, SGLang's hit rate."""
    if server.config.persona == "vllm":
        return await metric_sum(http, server.url, "vllm:prefix_cache_hits_total", engine=str(rank))
    async with http.get(server.url + f"/v1/loads?dp_rank={rank}") as r:
        (load,) = (await r.json())["loads"]
    return float(load["cache_hit_rate"])


@pytest.mark.parametrize("persona", PERSONAS)
async def test_a_repeated_long_prompt_goes_to_the_rank_holding_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,
    persona: str,
) -> None:
    cluster = await start_cluster([engine(persona, tokenizer_dir)])
    server = cluster[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    feed = feed_of(router)
    docs = [words(7, 400), words(8, 400)]  # ~1,300 tokens each
    holders: list[int] = []

    def holds(ids: list[int], rank: int) -> bool:
        return matched(feed, "w0", ids) == {rank: len(ids) // BLOCK}

    for doc in docs:
        holder = (await send(http, router.url, {"prompt": doc}))["rank"]
        holders.append(holder)
        assert await until(partial(holds, tok.encode(doc), holder))
    assert holders[0] != holders[1]  # nothing held: the second went by load elsewhere
    before = [await hits(http, server, r) for r in holders]
    for i in range(3):
        for doc, holder in zip(docs, holders, strict=True):
            text = f"{doc} and then question {i}"
            answer = await send(http, router.url, {"prompt": text})
            assert answer["rank"] == holder
            full = len(tok.encode(doc)) // BLOCK * BLOCK
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    after = [await hits(http, server, r) for r in holders]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    if persona == "vllm":  # in tokens: three hits of the whole document each
        assert [a - b for a, b in zip(after, before, strict=True)] == [
            3 * (len(tok.encode(doc)) // BLOCK * BLOCK) for doc in docs
        ]
    others = [r for r in range(DP) if r not in holders]
    assert [await hits(http, server, r) for r in others] == [0, 0]


@pytest.mark.parametrize("persona", PERSONAS)
async def test_a_restarted_engine_is_emptied_in_the_index(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,
    persona: str,
) -> None:
    """The engine restarts faster than health checks notice (they would drop the worker);
    with no request since, its ranks publish nothing: the index must not keep what they
    held, or the next prompt would go to a rank that no longer holds it."""
    cluster = await start_cluster([engine(persona, tokenizer_dir)])
    server = cluster[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    feed = feed_of(router)
    for rank in range(DP):  # warmed by another client (another router replica, say)
        await send(http, server.url, {"prompt": words(rank, 60)}, rank=rank)
    assert await until(lambda: agrees(feed, server) and feed.index.size > 0)
    await server.crash()
    await server.start()
    assert server.engine.ranks[0].cache.blocks() == []
    assert await until(lambda: feed.index.size == 0), differences(feed, server)
    assert not feed.index.entries
    assert [s.counts.restarts for s, _ in feed.streams.values()] == [1] * DP
    answer = await send(http, router.url, {"prompt": words(2, 60)})
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await until(lambda: agrees(feed, server) and feed.index.size > 0)
    assert {r for r in range(DP) if indexed(feed, "w0", r)} == {answer["rank"]}


class LossyRelay:
    """Between an engine's publishers and the router: one SUB -> PUB hop per rank, on
    consecutive ports as an engine lays its publishers out, that can lose the next
    batches of a rank on the way (a network that drops messages, the connection kept)."""

    def __init__(self, upstream: list[str]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.upstream = upstream
        self.drop = [0] * len(upstream)  # batches still to lose, per rank
        self.dropped = [0] * len(upstream)
        self.subs: list[zmq.asyncio.Socket] = []
        self.pubs: list[zmq.asyncio.Socket] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.endpoint = ""

    async def __aenter__(self) -> LossyRelay:
        rng = random.Random()
        for _ in range(50):
            base = rng.randrange(20_000, 60_000)
            pubs = []
            try:
                for r in range(len(self.upstream)):
                    pub = self.ctx.socket(zmq.PUB)
                    pub.setsockopt(zmq.LINGER, 0)
                    pubs.append(pub)
                    pub.bind(f"tcp://127.0.0.1:{base + r}")
            except zmq.ZMQError:
                for pub in pubs:
                    pub.close(0)
                continue
            self.pubs, self.endpoint = pubs, f"tcp://127.0.0.1:{base}"
            break
        else:
            raise AssertionError("no free consecutive ports")
        for r, endpoint in enumerate(self.upstream):
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self.subs.append(sub)
            self.tasks.append(asyncio.create_task(self._forward(r)))
        return self

    async def _forward(self, rank: int) -> None:
        while True:
            frames = await self.subs[rank].recv_multipart()
            if self.drop[rank]:
                self.drop[rank] -= 1
                self.dropped[rank] += 1
            else:
                await self.pubs[rank].send_multipart(frames)

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


@pytest.mark.parametrize("persona", PERSONAS)
async def test_a_sequence_gap_is_replayed(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    persona: str,
) -> None:
    cluster = await start_cluster([engine(persona, tokenizer_dir)])
    server = cluster[0]
    assert server.kv is not None
    async with LossyRelay(server.kv.endpoints) as relay:
        replay = server.kv.replay_endpoints[0]
        worker = WorkerSpec(server.url, kv_events=relay.endpoint, kv_replay=replay)
        router = await start_router(prefix_config(tokenizer_dir, worker))
        feed = feed_of(router)
        assert await until(lambda: ("w0", 2) in feed.streams)
        stream = feed.streams[("w0", 2)][0]
        prompts = iter(range(100, 200))
        for _ in range(100):  # until batches come live through the relay (ZMQ's slow joiner)
            await send(http, server.url, {"prompt": words(next(prompts), 40)}, rank=2)
            if await until(lambda: stream.live >= 0, 0.2):
                break
        assert await until(lambda: agrees(feed, server))
        replays, gaps = stream.counts.replays, stream.counts.gaps
        relay.drop[2] = 2
        for _ in range(2):
            await send(http, server.url, {"prompt": words(next(prompts), 40)}, rank=2)
        assert await until(lambda: relay.dropped[2] == 2)
        await asyncio.sleep(0.1)  # the index could only have missed them: nothing else says
        assert not agrees(feed, server) and reported(server, 2) > indexed(feed, "w0", 2)
        await send(http, server.url, {"prompt": words(next(prompts), 40)}, rank=2)
        assert await until(lambda: agrees(feed, server)), differences(feed, server)
        assert (stream.counts.gaps, stream.counts.replays) == (gaps + 1, replays + 1)
        assert stream.counts.restarts == 0 and stream.expected == server.kv.ranks[2].seq


async def test_auto_finds_each_ranks_endpoints_from_kv_event_sources(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,
) -> None:
    """``kv_events=auto``: vLLM's GET /kv_event_sources names each rank's PUB and replay
    sockets (``tcp://*:P``: the worker's own host)."""
    cluster = await start_cluster([engine("vllm", tokenizer_dir)])
    server = cluster[0]
    assert server.kv is not None
    for rank in range(DP):  # before the router: only the replay can tell it
        await send(http, server.url, {"prompt": words(rank, 40)}, rank=rank)
    worker = WorkerSpec(server.url, kv_events="auto")
    router = await start_router(prefix_config(tokenizer_dir, worker))
    feed = feed_of(router)
    assert await until(lambda: agrees(feed, server) and feed.index.size > 0)
    streams = [feed.streams[("w0", r)][0] for r in range(DP)]
    assert [s.endpoint for s in streams] == server.kv.endpoints
    assert [s.replay_endpoint for s in streams] == server.kv.replay_endpoints
    load = Workload(tok)
    await mixed(http, router.url, load, 2)
    assert await until(lambda: agrees(feed, server)), differences(feed, server)
    check_keys(feed, server, load.prompts)


@pytest.mark.parametrize("persona", PERSONAS)
async def test_a_worker_added_through_the_admin_api_has_its_events_followed(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    persona: str,
) -> None:
    cluster = await start_cluster([engine(persona, tokenizer_dir)])
    server = cluster[0]
    assert server.kv is not None
    router = await start_router(prefix_config(tokenizer_dir, admin_token="t0ken"))
    feed = feed_of(router)
    assert not feed.streams
    await send(http, server.url, {"prompt": words(1, 40)}, rank=1)  # held before it joins
    auth = {"Authorization": "Bearer t0ken"}
    body = {
        "url": server.url,
        "id": "late",
        "kv_events": server.kv.endpoints[0],
        "kv_replay": server.kv.replay_endpoints[0],
    }
    async with http.post(router.url + "/workers?wait=5", json=body, headers=auth) as r:
        assert r.status == 201, await r.text()
    assert await until(lambda: sorted(feed.streams) == [("late", r) for r in range(DP)])
    assert await until(lambda: agrees(feed, server, "late") and feed.index.size > 0)
    answer = await send(http, router.url, {"prompt": words(1, 40) + " again"})
    assert answer["rank"] == 1 and answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    await send(http, router.url, {"prompt": words(2, 40)})
    assert await until(lambda: agrees(feed, server, "late")), differences(feed, server, "late")
    async with http.delete(router.url + "/workers/late", headers=auth) as r:
        assert r.status == 200
    assert await until(lambda: not feed.streams and feed.index.size == 0)
    assert not feed.index.ranks


async def test_two_replicas_build_the_same_index_and_agree_where_a_prompt_goes(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,
) -> None:
    """Issue 17 item 5: replicas exchange nothing, yet each builds the index from the same
    events -- so a prompt sent through one replica is routed to its holder by the other
    (a failover keeps the affinity)."""
    cluster = await start_cluster([engine("vllm", tokenizer_dir)])
    server = cluster[0]
    first = await start_router(prefix_config(tokenizer_dir, spec(server)))
    second = await start_router(prefix_config(tokenizer_dir, spec(server)))
    load = Workload(tok)
    await mixed(http, first.url, load, 3)
    feeds = (feed_of(first), feed_of(second))
    assert await until(lambda: all(agrees(f, server) for f in feeds)), [
        differences(f, server) for f in feeds
    ]
    doc = words(9, 400)
    holder = (await send(http, first.url, {"prompt": doc}))["rank"]
    assert await until(lambda: matched(feeds[1], "w0", tok.encode(doc)).get(holder, 0) > 0)
    for i in range(3):  # the second replica never saw this prompt: the events told it
        answer = await send(http, second.url, {"prompt": f"{doc} and question {i}"})
        assert answer["rank"] == holder
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
