"""The simulated engines publish KV-cache events as vLLM and SGLang do: real ZMQ sockets,
real requests over HTTP, and the events checked against each rank's prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from dprouter.core.tokenizer import ModelTokenizer
from dprouter.sim.command import build, sim
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.model.tokens import tokenize
from tests.conftest import StartCluster

U64 = (1 << 64) - 1
BLOCK = 16
Frames = list[bytes]


def engine(persona: str, encoding: str = "map", dp: int = 2, **kv: Any) -> EngineConfig:
    """A tiny cache (8 blocks a rank) so that a few prompts evict."""
    events = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        topic="kv",
        encoding=encoding,  # type: ignore[arg-type]
        **kv,
    )
    limits = RankLimits(prefix_cache_blocks=8, kv_tokens=40_000, max_model_len=4096)
    return EngineConfig(persona=persona, dp_size=dp, limits=limits, kv_events=events)  # type: ignore[arg-type]


def prompt(i: int, words: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(words))


async def complete(http: aiohttp.ClientSession, url: str, text: str, rank: int) -> None:
    body = {"model": "sim-model", "prompt": text, "max_tokens": 2}
    headers = {"X-data-parallel-rank": str(rank)}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


def event_tag(event: Any) -> str:
    return str(event["type"] if isinstance(event, dict) else event[0])


def event_fields(event: Any, persona: str) -> dict[str, Any]:
    """An event as a map, whichever encoding it came in (array order: the struct's)."""
    if isinstance(event, dict):
        return {k: v for k, v in event.items() if k != "type"}
    order = {
        "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size"],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[event[0]]
    if event[0] == "BlockStored":
        order += ["lora_id", "medium"] + (["lora_name"] if persona == "vllm" else [])
    assert len(event) == len(order) + 1, event
    return dict(zip(order, event[1:], strict=True))


def holdings(payloads: list[bytes], persona: str) -> set[int]:
    """What a rank holds, rebuilt from its batches in order (as a router's index would)."""
    held: set[int] = set()
    for payload in payloads:
        _, events, _ = msgpack.unpackb(payload)
        for event in events:
            tag, f = event_tag(event), event_fields(event, persona)
            if tag == "BlockStored":
                held.update(f["block_hashes"])
            elif tag == "BlockRemoved":
                held.difference_update(f["block_hashes"])
            else:
                held.clear()
    return held


def wire_hash(h: int, persona: str) -> int:
    """vLLM publishes unsigned 64-bit hashes, SGLang signed ones (the sim's own)."""
    return h & U64 if persona == "vllm" else h


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[Frames]:
    """Ask a rank's replay socket for its batches from ``start``, up to the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[Frames] = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert frames[0] == b""  # the ROUTER's envelope delimiter
            out.append(frames[1:])
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return out
    finally:
        sock.close(linger=0)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def endpoints(http: aiohttp.ClientSession, server: SimServer) -> list[tuple[str, str]]:
    """Each rank's (PUB, replay) endpoint, read from the engine as a router would."""
    host = "127.0.0.1"
    if server.config.persona == "vllm":
        async with http.get(server.url + "/kv_event_sources") as r:
            sources = await r.json()
        return [
            (s["endpoint"].replace("*", host), s["replay_endpoint"].replace("*", host))
            for _, s in sorted(sources.items(), key=lambda kv: int(kv[0]))
        ]
    async with http.get(server.url + "/server_info") as r:
        kv = (await r.json())["kv_events"]
    base, replay_base = kv["endpoint_port_base"], kv["replay_endpoint_port_base"]
    return [
        (f"tcp://{host}:{base + r}", f"tcp://{host}:{replay_base + r}")
        for r in range(kv["dp_size"])
    ]


@pytest.mark.parametrize(
    ("persona", "encoding"),
    [("vllm", "map"), ("vllm", "array"), ("sglang", "map"), ("sglang", "array")],
)
async def test_events_rebuild_each_ranks_cache(
    start_cluster: StartCluster,
    http: aiohttp.ClientSession,
    zctx: zmq.asyncio.Context,
    persona: str,
    encoding: str,
) -> None:
    cluster: SimCluster = await start_cluster([engine(persona, encoding)])
    server = cluster[0]
    ends = await endpoints(http, server)
    assert server.kv is not None and len(ends) == 2
    assert [e for e, _ in ends] == server.kv.endpoints
    ports = [int(e.rpartition(":")[2]) for pair in ends for e in pair]
    assert ports[2] == ports[0] + 1 and ports[3] == ports[1] + 1  # base + rank, both sockets
    subs = []
    for pub, _ in ends:
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub)
        subs.append(sub)
    # three prompts of 3 full blocks per rank (8 fit: the first is evicted), a repeat,
    # a short prompt (no full block: nothing stored), a flush, then more
    for i in range(3):
        for rank in (0, 1):
            await complete(http, server.url, prompt(10 * rank + i, 50), rank)
    await complete(http, server.url, prompt(2, 50), 0)
    await complete(http, server.url, prompt(99, 10), 1)
    async with http.post(
        server.url + ("/flush_cache" if persona == "sglang" else "/reset_prefix_cache")
    ) as r:
        assert r.status == 200
    await complete(http, server.url, prompt(7, 40), 0)
    for rank, (_, replay_at) in enumerate(ends):
        cache = server.engine.ranks[rank].cache
        frames = await replay(zctx, replay_at, 0)
        assert frames[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        batches = frames[:-1]
        assert [int.from_bytes(f[1], "big") for f in batches] == list(range(len(batches)))
        assert {f[0] for f in batches} == {b"kv"}
        payloads = [f[2] for f in batches]
        assert holdings(payloads, persona) == {wire_hash(h, persona) for h in cache.blocks()}
        assert len(cache) == (2 if rank == 0 else 0)  # after the flush: one 40-token prompt
        decoded = [msgpack.unpackb(p) for p in payloads]
        assert all(len(b) == 3 and b[2] == rank for b in decoded)  # [ts, events, rank]
        tags = [event_tag(e) for b in decoded for e in b[1]]
        assert "BlockRemoved" in tags and "AllBlocksCleared" in tags
        first = event_fields(decoded[0][1][0], persona)
        ids = tokenize(prompt(10 * rank, 50))
        assert first["parent_block_hash"] is None and first["block_size"] == BLOCK
        assert first["token_ids"] == ids[: 3 * BLOCK] and len(first["block_hashes"]) == 3
        assert first["medium"] == "GPU" and first["lora_id"] is None
        # live: the same bytes as the replay buffer, for whatever the SUB got once joined
        live: dict[int, bytes] = {}
        while len(batches) - 1 not in live:
            try:
                topic, seq, payload = await asyncio.wait_for(subs[rank].recv_multipart(), 2)
            except TimeoutError:
                break
            assert topic == b"kv"
            live[int.from_bytes(seq, "big")] = payload
        assert live, "the subscriber got nothing live"
        assert all(payloads[seq] == payload for seq, payload in live.items())
        subs[rank].close(linger=0)


def test_vllm_map_event_fields_are_vllm_0_32s() -> None:
    """The exact keys vLLM 0.32.0 puts in each event (block_pool.py, kv_events.py)."""
    from dprouter.sim.model.kvevents import Cleared, Removed, Stored, encode_batch

    stored = Stored([-5, 7], None, list(range(32)), 16)
    payload = encode_batch(1.5, [stored, Removed([-5]), Cleared()], 3, "vllm", "map")
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.5, 3)
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [(-5) & U64, 7],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None],
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [(-5) & U64], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    old = msgpack.unpackb(encode_batch(1.5, [stored, Cleared()], 0, "sglang", "array"))
    assert old[1] == [
        ["BlockStored", [-5, 7], None, list(range(32)), 16, None, "GPU"],
        ["AllBlocksCleared"],
    ]


async def test_replay_keeps_the_last_buffer_steps_batches(
    start_cluster: StartCluster, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    cluster = await start_cluster([engine("vllm", dp=1, buffer_steps=3)])
    server = cluster[0]
    for i in range(5):  # one batch each: 5 batches, the first 2 dropped from the buffer
        await complete(http, server.url, prompt(i, 20), 0)
    ((_, replay_at),) = await endpoints(http, server)
    seqs = [int.from_bytes(f[1], "big") for f in (await replay(zctx, replay_at, 0))[:-1]]
    assert seqs == [2, 3, 4]
    seqs = [int.from_bytes(f[1], "big") for f in (await replay(zctx, replay_at, 4))[:-1]]
    assert seqs == [4]
    assert await replay(zctx, replay_at, 9) == [[b"", (-1).to_bytes(8, "big", signed=True), b""]]


async def test_restart_starts_the_sequence_again_on_the_same_ports(
    start_cluster: StartCluster, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    cluster = await start_cluster([engine("vllm", dp=2)])
    server = cluster[0]
    before = await endpoints(http, server)
    for i in range(2):
        await complete(http, server.url, prompt(i, 20), 1)
    await server.crash()
    await server.start()
    assert await endpoints(http, server) == before
    assert len(server.engine.ranks[1].cache) == 0
    assert await replay(zctx, before[1][1], 0) == [[b"", (-1).to_bytes(8, "big", signed=True), b""]]
    await complete(http, server.url, prompt(5, 20), 1)
    frames = await replay(zctx, before[1][1], 0)
    assert [int.from_bytes(f[1], "big") for f in frames[:-1]] == [0]


async def test_events_off_by_default(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(), EngineConfig(persona="sglang")])
    async with http.get(cluster[0].url + "/kv_event_sources") as r:
        assert await r.json() == {}
    async with http.get(cluster[1].url + "/server_info") as r:
        assert (await r.json())["kv_events"] is None


def test_config_fails_loudly() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        KvEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="encoding"):
        KvEventsConfig.from_json('{"encoding": "json"}')
    config = KvEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.enabled and config.wire()["publisher"] == "zmq"


async def test_a_tokenizer_gives_the_events_the_ids_a_router_computes(
    start_cluster: StartCluster,
    http: aiohttp.ClientSession,
    zctx: zmq.asyncio.Context,
    tokenizer_dir: Path,
) -> None:
    config = replace(engine("vllm", dp=1), tokenizer=str(tokenizer_dir))
    cluster = await start_cluster([config])
    server = cluster[0]
    tok = ModelTokenizer(tokenizer_dir)
    text = "The router sends each request to the rank that holds its prefix. " * 6
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "hello"}]
    async with http.post(server.url + "/v1/completions", json={"prompt": text}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == len(tok.encode(text))
    body = {"messages": messages, "max_tokens": 2}
    async with http.post(server.url + "/v1/chat/completions", json=body) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == len(tok.encode_chat(messages))
    async with http.post(server.url + "/tokenize", json={"prompt": text}) as r:
        assert (await r.json())["tokens"] == tok.encode(text)
    async with http.post(server.url + "/tokenize", json={"messages": messages}) as r:
        assert (await r.json())["tokens"] == tok.encode_chat(messages)
    async with http.post(server.url + "/detokenize", json={"tokens": tok.encode(text)}) as r:
        assert (await r.json())["prompt"] == tok.decode(tok.encode(text))
    ((_, replay_at),) = await endpoints(http, server)
    stored = [
        event_fields(e, "vllm")
        for f in (await replay(zctx, replay_at, 0))[:-1]
        for e in msgpack.unpackb(f[2])[1]
        if event_tag(e) == "BlockStored"
    ]
    for ids, event in zip((tok.encode(text), tok.encode_chat(messages)), stored, strict=True):
        full = len(ids) // BLOCK * BLOCK
        if event["parent_block_hash"] is None:
            assert event["token_ids"] == ids[:full]
        else:  # the chat shares its first blocks with nothing, so this is not reached
            raise AssertionError(event)


def test_sim_command_takes_the_engines_kv_events_config(tokenizer_dir: Path) -> None:
    args = [
        "--engines", "2", "--dp-size", "4", "--tokenizer", str(tokenizer_dir),
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:7000", "encoding": "array"}',
    ]  # fmt: skip
    with sim.make_context("sim", args) as ctx:
        options = {k: v for k, v in ctx.params.items() if k not in ("host", "port")}
    first, second = build(options)
    assert first.tokenizer == second.tokenizer == str(tokenizer_dir)
    assert (first.kv_events.endpoint, second.kv_events.endpoint) == ("tcp://*:6000", "tcp://*:6004")
    assert second.kv_events.replay_endpoint == "tcp://*:7004"
    assert second.kv_events.encoding == "array" and second.kv_events.enabled
