"""Where a worker's ranks publish KV events: ``kv_events=auto`` asks the engine (SGLang's
/server_info ``kv_events_config``, vLLM's /kv_event_sources); an engine that publishes
nothing is said once, not once a retry; an option that cannot work stops the start."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.engines.kvevents import sources
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.index import KvIndex
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import WorkerSpec, parse_worker
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.kvevents import KvEventsConfig
from tests.conftest import StartCluster, StartRouter, serving, until
from tests.test_kv_routing import (
    DP,
    Workload,
    agrees,
    check_keys,
    differences,
    engine,
    feed_of,
    mixed,
    prefix_config,
    send,
    words,
)


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dprouter.kvevents" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("dp_attention", [False, True])
async def test_auto_on_sglang_follows_the_kv_events_config_of_its_server_info(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
    dp_attention: bool,
) -> None:
    """An SGLang engine has no /kv_event_sources: auto reads ``kv_events_config`` from
    /server_info, each rank at its port + rank on the worker's host, replay included
    (blocks cached before the router joined are indexed: only the replay tells them)."""
    config = replace(engine("sglang", tokenizer_dir), dp_attention=dp_attention)
    server = (await start_cluster([config]))[0]
    assert server.kv is not None
    for rank in range(DP):
        await send(http, server.url, {"prompt": words(rank, 40)}, rank=rank)
    router = await start_router(
        prefix_config(tokenizer_dir, WorkerSpec(server.url, kv_events="auto"))
    )
    feed = feed_of(router)
    assert await until(lambda: agrees(feed, server) and feed.index.size > 0), differences(
        feed, server
    )
    streams = [feed.streams[("w0", r)][0] for r in range(DP)]
    assert [s.endpoint for s in streams] == server.kv.endpoints
    assert [s.replay_endpoint for s in streams] == server.kv.replay_endpoints
    load = Workload(ModelTokenizer(tokenizer_dir))
    await mixed(http, router.url, load, 2)
    assert await until(lambda: agrees(feed, server)), differences(feed, server)
    check_keys(feed, server, load.prompts)
    assert feed.asks == 1  # one question for the worker's four ranks
    assert not warned(caplog)


async def test_a_wildcard_host_in_kv_events_is_the_workers_host(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    """``kv_events=tcp://*:P``, pasted from the engine's own config, means the worker's host."""
    server = (await start_cluster([engine("vllm", tokenizer_dir)]))[0]
    assert server.kv is not None and server.kv.replay_base is not None
    spec = WorkerSpec(
        server.url,
        kv_events=f"tcp://*:{server.kv.base}",
        kv_replay=f"tcp://*:{server.kv.replay_base}",
    )
    await send(http, server.url, {"prompt": words(3, 40)}, rank=3)
    router = await start_router(prefix_config(tokenizer_dir, spec))
    feed = feed_of(router)
    assert await until(lambda: agrees(feed, server) and feed.index.size > 0)
    assert [feed.streams[("w0", r)][0].endpoint for r in range(DP)] == server.kv.endpoints


def no_events_engine(tokenizer_dir: Path) -> EngineConfig:
    return EngineConfig(persona="sglang", dp_size=DP, tokenizer=str(tokenizer_dir))


async def test_auto_on_an_engine_without_events_is_said_once_not_once_a_retry(
    start_cluster: StartCluster,
    start_router: StartRouter,
    tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang started without --kv-events-config: one warning with the reason (not one a
    rank, nor one a retry); the engine is asked again, slowly, and routing goes on."""
    caplog.set_level(logging.INFO, logger="dprouter.kvevents")
    server = (await start_cluster([no_events_engine(tokenizer_dir)]))[0]
    worker = WorkerSpec(server.url, kv_events="auto")
    router = await start_router(prefix_config(tokenizer_dir, worker))
    assert await until(lambda: len(warned(caplog)) >= 1)
    (said,) = warned(caplog)
    assert "no kv_events_config" in said and "every 60 s" in said
    # the same question, asked every 20 ms by a second feed over the same workers
    fast = Feed(router.registry, KvIndex(), retry=0.02, quiet=0.02)
    await fast.start()
    try:
        assert await until(lambda: fast.asks >= 10)
    finally:
        await fast.stop()
    assert len(warned(caplog)) == 2  # one each, for all their questions and ranks
    assert not feed_of(router).index.ranks


async def test_a_vllm_404_is_no_events_and_an_sglang_config_is_read_as_sglang_reads_it() -> None:
    async with serving(web.Application()) as url:  # no /kv_event_sources: 404
        worker = Worker("w0", url, dialect="vllm", kv_events="auto", ranks=2)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(sources.NoEvents, match="404"):
                await sources.ask(session, worker)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (None, "no kv_events_config"),
        ('{"endpoint": "tcp://*:5557"}', "publisher is 'null'"),  # SGLang's default
        ({"publisher": "zmq", "enable_kv_cache_events": False}, "enable_kv_cache_events"),
        ('{"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}', "not tcp://"),
        ("{not json", "not JSON"),
    ],
)
def test_sglang_configs_that_publish_nothing(config: Any, reason: str) -> None:
    with pytest.raises(sources.NoEvents, match=reason):
        sources.sglang_sources({"kv_events_config": config}, "http://h:1", range(2))


def test_sglang_ranks_offset_their_ports_from_the_config() -> None:
    info = {"kv_events_config": json.dumps({"publisher": "zmq", "replay_endpoint": "tcp://*:6000"})}
    assert sources.sglang_sources(info, "http://[::1]:30000", range(2, 4)) == {
        2: ("tcp://[::1]:5559", "tcp://[::1]:6002"),  # endpoint: SGLang's default, 5557
        3: ("tcp://[::1]:5560", "tcp://[::1]:6003"),
    }
    given = {"kv_events_config": {"publisher": "zmq", "endpoint": "tcp://10.0.0.9:7000"}}
    assert sources.sglang_sources(given, "http://h:1", range(1)) == {
        0: ("tcp://10.0.0.9:7000", None)
    }


async def test_the_sglang_persona_reports_its_kv_events_config_as_sglang_does(
    start_cluster: StartCluster, http: aiohttp.ClientSession, tokenizer_dir: Path
) -> None:
    """The JSON string as given (ports bound for 0), beside the ``kv_events`` descriptor;
    ``None`` without one; publisher null for a config given but off."""
    off = KvEventsConfig(endpoint="tcp://*:5557", topic="kv")
    cluster = await start_cluster(
        [
            engine("sglang", tokenizer_dir),
            EngineConfig(persona="sglang"),
            replace(EngineConfig(persona="sglang"), kv_events=off),
        ]
    )
    infos = []
    for server in cluster.servers:
        async with http.get(server.url + "/server_info") as r:
            infos.append(await r.json())
    on = cluster[0].kv
    assert on is not None
    given = json.loads(infos[0]["kv_events_config"])
    assert given["publisher"] == "zmq" and given["topic"] == "kv"
    assert given["endpoint"] == f"tcp://*:{on.base}"
    assert given["replay_endpoint"] == f"tcp://*:{on.replay_base}"
    assert infos[0]["kv_events"]["endpoint_port_base"] == on.base
    assert infos[1]["kv_events_config"] is None and infos[1]["kv_events"] is None
    assert json.loads(infos[2]["kv_events_config"])["publisher"] == "null"
    assert infos[2]["kv_events"] is None


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("kv_events=h:5557", "kv_events must be tcp://HOST:PORT or auto"),
        ("kv_events=tcp://h", "kv_events must be tcp://HOST:PORT"),
        ("kv_events=tcp://h:0", "kv_events must be tcp://HOST:PORT"),
        ("kv_events=tcp://h:5557/kv", "kv_events must be tcp://HOST:PORT"),
        ("kv_events=ipc:///tmp/kv", "kv_events must be tcp://HOST:PORT"),
        ("kv_events=auto,kv_replay=tcp://h:5600", "the engine names its replay socket"),
        ("kv_replay=tcp://h:5600", "kv_replay needs kv_events"),
        ("kv_block_size=16", "kv_block_size sizes KV-event ranks: it needs kv_events"),
        ("dp_size=4,kv_events=tcp://h:5557,kv_replay=tcp://h:5558", "ports overlap over 4"),
        ("kv_events=tcp://h:5557,kv_replay=tcp://h:5557", "ports overlap"),
        ("dp_size=8,kv_events=tcp://h:65530", "past 65535"),
    ],
)
def test_a_worker_option_that_cannot_work_stops_the_start(option: str, message: str) -> None:
    spec = parse_worker(f"http://h:1,{option}")
    with pytest.raises(ConfigError, match=message):
        validate(RouterConfig(workers=(spec,)))


def test_workable_kv_options_pass() -> None:
    for option in (
        "dp_size=4,kv_events=tcp://h:5557,kv_replay=tcp://h:5600",
        "dp_size=4,kv_events=tcp://h:5557,kv_replay=tcp://other:5558",  # another host
        "kv_events=auto,kv_block_size=16",
        "kv_events=tcp://*:5557",
    ):
        validate(RouterConfig(workers=(parse_worker(f"http://h:1,{option}"),)))
