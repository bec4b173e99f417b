"""Where each rank of a worker publishes its KV events, as the engine itself says
(``kv_events=auto``), or as the operator wrote it (``kv_events=tcp://HOST:PORT``).

Both engines run one ZMQ publisher per DP rank at the configured port + the rank, and a
replay socket likewise; ``tcp://*:P`` (or another wildcard) is the worker's own host.

- vLLM: ``GET /kv_event_sources`` names each rank's resolved endpoints.
- SGLang (0.5.23): ``GET /server_info`` carries the ``--kv-events-config`` JSON string
  as given (``kv_events_config``, ``None`` without it); rank r publishes on its port +
  r, where r is the attention-DP rank under DP attention, else the DP rank
  (``disaggregation/kv_events.py``: ``select_kv_publisher_dp_rank``,
  ``ZmqEventPublisher.offset_endpoint_port``). Its ``publisher`` defaults to
  ``"null"``: a config without ``"publisher": "zmq"`` publishes nothing.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from dprouter.fleet.targets import Worker

Sources = dict[int, tuple[str, str | None]]  # engine rank -> (PUB, replay or None)
WILDCARDS = ("*", "0.0.0.0", "[::]", "::")
SGLANG_ENDPOINT = "tcp://*:5557"  # SGLang's KVEventsConfig default


class NoEvents(Exception):
    """The engine says it publishes no KV events (or no way a router can follow)."""


def offset(endpoint: str, by: int) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + by}"


def on_host(endpoint: str, worker_url: str) -> str:
    """``tcp://*:P`` (or 0.0.0.0, ::) as the engine binds it -> the worker's host."""
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    for wild in WILDCARDS:
        endpoint = endpoint.replace(f"//{wild}:", f"//{host}:")
    return endpoint


def configured(worker: Worker, rank: int) -> tuple[str, str | None]:
    """``kv_events=tcp://HOST:PORT``: rank ``rank`` (the engine's own) at PORT + rank."""
    assert worker.kv_events is not None
    replay = worker.kv_replay
    return (
        on_host(offset(worker.kv_events, rank), worker.url),
        on_host(offset(replay, rank), worker.url) if replay else None,
    )


def vllm_sources(answer: Any, worker_url: str) -> Sources:
    """vLLM's ``/kv_event_sources``: ``{"0": {"endpoint": ..., "replay_endpoint": ...}}``."""
    found: Sources = {}
    if isinstance(answer, dict):
        for rank, source in answer.items():
            if isinstance(source, dict) and isinstance(source.get("endpoint"), str):
                replay = source.get("replay_endpoint")
                found[int(rank)] = (
                    on_host(source["endpoint"], worker_url),
                    on_host(replay, worker_url) if isinstance(replay, str) else None,
                )
    if not found:
        raise NoEvents("its /kv_event_sources lists no publisher (no --kv-events-config?)")
    return found


def tcp(endpoint: Any) -> bool:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return False
    try:
        return urlsplit(endpoint).port is not None
    except ValueError:
        return False


def sglang_sources(info: Any, worker_url: str, ranks: range) -> Sources:
    """SGLang's ``/server_info``: its ``kv_events_config`` (a JSON string, or the object
    itself) laid out over ``ranks``, the engine's own rank numbers."""
    raw = info.get("kv_events_config") if isinstance(info, dict) else None
    if raw is None:
        raise NoEvents("its /server_info has no kv_events_config (no --kv-events-config)")
    try:
        config = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise NoEvents(f"its kv_events_config is not JSON: {raw!r}") from None
    if not isinstance(config, dict):
        raise NoEvents(f"its kv_events_config is not a JSON object: {raw!r}")
    if config.get("enable_kv_cache_events") is False:
        raise NoEvents("its kv_events_config says enable_kv_cache_events false")
    publisher = config.get("publisher", "null")
    if publisher != "zmq":
        raise NoEvents(f"its kv_events_config's publisher is {publisher!r}, not 'zmq'")
    endpoint = config.get("endpoint", SGLANG_ENDPOINT)
    if not tcp(endpoint):
        raise NoEvents(f"its KV-event endpoint {endpoint!r} is not tcp://HOST:PORT")
    replay = config.get("replay_endpoint")
    replay = replay if tcp(replay) else None
    return {
        r: (
            on_host(offset(endpoint, r), worker_url),
            on_host(offset(replay, r), worker_url) if replay else None,
        )
        for r in ranks
    }


async def ask(session: aiohttp.ClientSession, worker: Worker) -> Sources:
    """The engine's own word on where its ranks publish. ``NoEvents``: it publishes
    nothing a router can follow; aiohttp/timeout errors: ask again."""
    first = worker.rank_offset or 0
    if worker.dialect == "sglang":
        async with session.get(f"{worker.url}/server_info") as answer:
            answer.raise_for_status()
            info = await answer.json(content_type=None)
        return sglang_sources(info, worker.url, range(first, first + max(worker.ranks, 1)))
    async with session.get(f"{worker.url}/kv_event_sources") as answer:
        if answer.status == 404:
            raise NoEvents("GET /kv_event_sources answered 404 (a vLLM older than it?)")
        answer.raise_for_status()
        return vllm_sources(await answer.json(content_type=None), worker.url)
