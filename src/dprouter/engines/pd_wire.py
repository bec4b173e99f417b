"""What each P/D flow writes on the wire: request bodies, ids, rooms. Pure functions.

vLLM NIXL: the prefill asks for remote decode and stops after one token; its
answer's ``kv_transfer_params`` go into the decode request unchanged.
vLLM Mooncake: both requests carry a ``transfer_id`` the router makes; the decode
is told the prefill rank's engine id (from the prefill's bootstrap server, ``GET
/query``) and that server's address, and pulls the KV itself: the prefill answers
nothing the decode needs, so both go at once.
vLLM MoRIIO: both requests carry a ``transfer_id`` and each side's shape;
``X-Request-Id`` names both peers' ZMQ addresses; READ copies the prefill's
block ids into the decode request, WRITE sends both at once.
SGLang: the same body to both, with the prefill's bootstrap address and a room
chosen so that ``room % prefill dp_size`` is the prefill rank.

No rank is written here: that is the dialects' (``dialects``), leg by leg.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from yarl import URL

from dprouter.fleet.targets import Target

ONE_TOKEN = ("max_tokens", "max_completion_tokens")
PREFILL_DROPS = ("stream_options", "min_tokens")
# Mooncake's and MoRIIO's prefill keep the KV for the decode only when the one token
# ended by length (vLLM 0.32: ``request_finished``, FINISHED_LENGTH_CAPPED); an EOS or a
# stop string as the first token would free it, and the decode would find nothing
BY_LENGTH_DROPS = ("stop", "stop_token_ids")
ROOM_BITS = 63
MOONCAKE_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default


def _prefill(body: dict[str, Any], **kv: Any) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, its KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        **kv,
    }
    return out


def _by_length(prefill: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg, made to end by length whatever its first token is."""
    out = {k: v for k, v in prefill.items() if k not in BY_LENGTH_DROPS}
    out["ignore_eos"] = True
    return out


def nixl_prefill(body: dict[str, Any]) -> dict[str, Any]:
    return _prefill(body, remote_host=None, remote_port=None)


def nixl_decode(body: dict[str, Any], prefill_kv: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": prefill_kv}  # as the prefill answered: unchanged


def moriio_request_id(prefill: Target, decode: Target) -> str:
    return (
        f"___prefill_addr_{prefill.worker.zmq_address}___decode_addr_"
        f"{decode.worker.zmq_address}_{uuid.uuid4().hex}"
    )


def moriio_prefill(body: dict[str, Any], transfer_id: str, decode: Target) -> dict[str, Any]:
    return _by_length(
        _prefill(
            body,
            transfer_id=transfer_id,
            remote_dp_size=decode.worker.ranks,
            remote_tp_size=decode.worker.tp_size or 1,
        )
    )


def moriio_decode(
    body: dict[str, Any], transfer_id: str, prefill: Target, prefill_kv: dict[str, Any] | None
) -> dict[str, Any]:
    """``prefill_kv``: the prefill's answer (READ), or None (WRITE: sent at the same time)."""
    out = dict(body)
    for name in ONE_TOKEN:  # the prefill produced the first token
        if isinstance(body.get(name), int) and body[name] > 1:
            out[name] = body[name] - 1
    kv: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_dp_size": prefill.worker.ranks,
        "remote_tp_size": prefill.worker.tp_size or 1,
        "remote_dp_rank": prefill.rank or 0,
    }
    if prefill_kv is not None:
        for name in ("remote_engine_id", "remote_block_ids", "transfer_id", "remote_hosts"):
            if name in prefill_kv:
                kv[name] = prefill_kv[name]
    out["kv_transfer_params"] = kv
    return out


def mooncake_prefill(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return _by_length(_prefill(body, transfer_id=transfer_id))


def mooncake_decode(
    body: dict[str, Any], transfer_id: str, engine_id: str, bootstrap: str
) -> dict[str, Any]:
    """The client's body, told whose KV to pull (``engine_id``, the prefill rank's) and
    where that engine's workers are listed (``bootstrap``: ``http://HOST:PORT``)."""
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap,
        "transfer_id": transfer_id,
    }
    return {**body, "kv_transfer_params": kv}


def mooncake_bootstrap(prefill: Target) -> str:
    """The prefill's bootstrap server: its host, its bootstrap port (vLLM's default)."""
    port = prefill.worker.bootstrap_port or MOONCAKE_BOOTSTRAP_PORT
    return str(URL.build(scheme="http", host=URL(prefill.worker.url).host or "", port=port))


def mooncake_engines(query: Any) -> dict[int, str]:
    """``GET /query`` of a Mooncake bootstrap server, ``{"<dp rank>": {"engine_id": E,
    "worker_addr": ...}}``, as ``{rank: E}``; ValueError when it is not that."""
    if not isinstance(query, dict):
        raise ValueError(f"not a map of ranks: {str(query)[:80]}")
    out: dict[int, str] = {}
    for rank, entry in query.items():
        engine = entry.get("engine_id") if isinstance(entry, dict) else None
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(engine, str)):
            raise ValueError(f"rank {rank!r} has no engine_id: {str(entry)[:80]}")
        out[int(rank)] = engine
    return out


def sglang_room(prefill: Target, rng: random.Random) -> int:
    """A random 63-bit room with ``room % prefill dp_size == prefill rank``, so a prefill
    engine left on ``follow_bootstrap_room`` places it where the router did."""
    if prefill.rank is None:  # the router leaves the rank to the engine: any room will do
        return rng.getrandbits(ROOM_BITS)
    dp = max(prefill.worker.ranks, 1)
    return rng.randrange((1 << ROOM_BITS) // dp) * dp + (prefill.rank or 0)


def batch_size(body: dict[str, Any]) -> int:
    """How many prompts one request carries (SGLang wants a room for each)."""
    for name in ("text", "input_ids", "prompt"):
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            return len(value)
    return 1


def sglang_rooms(body: dict[str, Any], prefill: Target, rng: random.Random) -> int | list[int]:
    """One room for a single prompt; one per item for a batch."""
    n = batch_size(body)
    if n == 1:
        return sglang_room(prefill, rng)
    return [sglang_room(prefill, rng) for _ in range(n)]


def sglang_bodies(
    body: dict[str, Any], prefill: Target, room: int | list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill's and the decode's bodies: the client's, with where they meet. Each leg's
    rank, and the prefill rank the decode fetches from, are the dialect's to write."""
    host = URL(prefill.worker.url).host
    common = {
        **body,
        "bootstrap_host": host,
        "bootstrap_port": prefill.worker.bootstrap_port,
        "bootstrap_room": room,
    }
    return dict(common), dict(common)
