"""vLLM's and SGLang's KV-event frames, decoded.

A publisher sends multipart ``(topic, sequence as 8-byte big-endian, msgpack batch)``.
The batch is ``[ts, events]`` or ``[ts, events, dp_rank]`` (msgspec ``array_like``:
older vLLM, SGLang), or a map ``{"ts", "events", "data_parallel_rank"}`` (vLLM since
mid-2026). Each event is a tagged array ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
group_idx, ...]`` (fields after ``lora_id`` only in newer engines; trailing defaults
omitted) or a map with a ``"type"`` key and the same field names. The field order is
vLLM's ``vllm/distributed/kv_events.py`` and SGLang's
``python/sglang/srt/disaggregation/kv_events.py``. Block hashes are ints or bytes.

An adapter's blocks are known by ``lora_name`` where the event has it (vLLM 0.32 sends
both, the name beside its load-time ``lora_id``; SGLang 0.5.23 only the name, its
``lora_id`` is always None): the name is what a request sends, the id is not.
SGLang's map has other fields between ``medium`` and ``lora_name`` (``cache_salt``,
``session_id``); it sends maps, so the array order above is vLLM's only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

Hash = int | bytes
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
STORED_LATER = ("medium", "lora_name", "extra_keys", "group_idx")  # after lora_id, in order
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class BadFrame(ValueError):
    """A frame that is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: Sequence[Hash]
    parent: Hash | None
    tokens: Sequence[int]
    block_size: int
    lora: int | str | None = None  # lora_name where sent (what a request names), else lora_id
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: Sequence[Hash]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    rank: int | None  # the data-parallel rank the publisher says it is (None: not said)


def sequence(frame: bytes) -> int:
    """The 8-byte big-endian sequence number; the replay's end marker is -1."""
    if len(frame) != 8:
        raise BadFrame(f"a sequence is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def event(raw: Any) -> Event | None:
    """One event, tagged array or map; None for a kind this router does not use."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise BadFrame(f"an event is a tagged array or a map, got {type(raw).__name__}")
    if tag == "BlockStored":
        f = _fields(raw, (*STORED_FIELDS, *STORED_LATER))
        name = f.get("lora_name")
        return Stored(
            hashes=f["block_hashes"],
            parent=f.get("parent_block_hash"),
            tokens=f["token_ids"],
            block_size=int(f["block_size"]),
            lora=name if isinstance(name, str) and name else f.get("lora_id"),
            medium=f.get("medium"),
            group=f.get("group_idx"),
        )
    if tag == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS)
        return Removed(f["block_hashes"], f.get("medium"), f.get("group_idx"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def batch(payload: bytes) -> Batch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadFrame(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, items, rank = raw.get("ts", 0.0), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, items, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise BadFrame("a batch is [ts, events(, dp_rank)] or a map")
    if not isinstance(items, list):
        raise BadFrame("a batch's events are a list")
    try:
        events = [e for e in map(event, items) if e is not None]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BadFrame(f"bad event: {exc!r}") from None
    return Batch(float(ts), events, rank if isinstance(rank, int) else None)
