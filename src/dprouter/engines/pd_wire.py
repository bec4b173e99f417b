"""What each P/D flow writes on the wire: request bodies, ids, rooms. Pure functions.

vLLM NIXL: the prefill asks for remote decode and stops after one token; its
answer's ``kv_transfer_params`` go into the decode request unchanged.
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
ROOM_BITS = 63


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
    return _prefill(
        body,
        transfer_id=transfer_id,
        remote_dp_size=decode.worker.ranks,
        remote_tp_size=decode.worker.tp_size or 1,
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
