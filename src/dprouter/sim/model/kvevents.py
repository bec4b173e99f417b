"""KV-cache events of a simulated rank, and their bytes on the wire as each engine sends them.

A rank's prefix cache records what happened to it (``Stored`` / ``Removed`` /
``Cleared``) in the sim's own terms; ``encode_batch`` turns one engine step's record
into the msgpack payload the real engine would publish:

- vLLM (0.32.0, ``vllm/distributed/kv_events.py``): the batch is the array
  ``[ts, events, data_parallel_rank]``; events are msgspec structs with ``tag=True``
  and ``omit_defaults=True``: maps with a ``"type"`` key (``"map"``), or, in older
  vLLM with ``array_like=True``, arrays with the tag first (``"array"``). Block hashes
  are unsigned 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default);
  one ``BlockRemoved`` per evicted block (``block_pool.py``).
- SGLang (0.5.23, ``srt/disaggregation/kv_events.py`` and ``srt/mem_cache/events.py``):
  the batch is ``[ts, events, attn_dp_rank]``; the same tagged maps (older SGLang:
  tagged arrays) with signed 64-bit hashes, fewer fields, and consecutive removals
  coalesced into one ``BlockRemoved``.

An adapter's blocks carry it as each engine says it: vLLM both its ``lora_id`` and its
``lora_name``; SGLang ``lora_name`` alone (its ``lora_id`` is always None), and its
older array encoding nothing at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import msgpack

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")
MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class KvEventsConfig:
    """The engines' ``--kv-events-config`` keys (vLLM's names and defaults), plus the
    simulator's ``encoding``: which generation of the wire format to imitate."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled, as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: Encoding = "map"

    def __post_init__(self) -> None:
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(f"kv events publisher must be null or zmq, not {self.publisher!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be map or array, not {self.encoding!r}")
        if self.buffer_steps < 0 or self.hwm < 0:
            raise ValueError("buffer_steps and hwm must be >= 0")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not endpoint.startswith("tcp://"):
                raise ValueError(f"kv events endpoint {endpoint!r}: only tcp:// is simulated")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse ``--kv-events-config``; an unknown key fails loudly (a typo would
        otherwise leave events silently off)."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {', '.join(unknown)}")
        return cls(**raw)

    def shifted(self, ports: int) -> KvEventsConfig:
        """The same config ``ports`` further on (engine i of a fleet on one host); a port
        of 0 stays 0: each engine then finds free ports of its own."""

        def move(endpoint: str | None) -> str | None:
            if endpoint is None:
                return None
            head, _, port = endpoint.rpartition(":")
            return endpoint if int(port) == 0 else f"{head}:{int(port) + ports}"

        endpoint = move(self.endpoint)
        assert endpoint is not None
        return replace(self, endpoint=endpoint, replay_endpoint=move(self.replay_endpoint))

    def wire(self) -> dict[str, Any]:
        """The keys as vLLM's ``KVEventsConfig`` has them (``encoding`` is ours)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "encoding"}
        out["publisher"] = "zmq" if self.enabled else "null"
        return out


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter the engine serves: its name (the ``model`` a request sends) and the
    integer vLLM gives it at load time (``lora_int_id``: 1, 2, ... in load order)."""

    id: int
    name: str


@dataclass
class Stored:
    """Full blocks that entered the cache, consecutive in one prompt's chain."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block is the prompt's first
    token_ids: list[int]
    block_size: int
    lora: Adapter | None = None  # the adapter whose request stored them


@dataclass
class Removed:
    block_hashes: list[int] = field(default_factory=list)


@dataclass
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


def encode_batch(
    ts: float, events: list[KvEvent], rank: int, persona: str, encoding: Encoding
) -> bytes:
    """The msgpack payload of one published batch."""
    wire = _vllm if persona == "vllm" else _sglang
    out: list[Any] = []
    for event in events:
        out.extend(wire(event, encoding))
    return msgpack.packb([ts, out, rank], use_bin_type=True)  # type: ignore[no-any-return]


def _tagged(tag: str, items: list[tuple[str, Any]], encoding: Encoding) -> Any:
    if encoding == "map":
        return {"type": tag, **dict(items)}
    # array_like with omit_defaults: trailing fields still at their default are left out
    return [tag, *(value for _, value in items)]


def _vllm(event: KvEvent, encoding: Encoding) -> list[Any]:
    if isinstance(event, Stored):
        parent, lora = event.parent_block_hash, event.lora
        items: list[tuple[str, Any]] = [
            ("block_hashes", [h & _U64 for h in event.block_hashes]),
            ("parent_block_hash", None if parent is None else parent & _U64),
            ("token_ids", event.token_ids),
            ("block_size", event.block_size),
            ("lora_id", None if lora is None else lora.id),  # both: v1/core/block_pool.py
            ("medium", MEDIUM_GPU),
            ("lora_name", None if lora is None else lora.name),
        ]
        if encoding == "map":  # vLLM 0.32.0 sets these: one extra-key entry per block
            items += [("extra_keys", [None] * len(event.block_hashes)), ("group_idx", 0)]
        return [_tagged("BlockStored", items, encoding)]
    if isinstance(event, Removed):
        group: list[tuple[str, Any]] = [("group_idx", 0)] if encoding == "map" else []
        return [  # vLLM sends one per evicted block
            _tagged(
                "BlockRemoved",
                [("block_hashes", [h & _U64]), ("medium", MEDIUM_GPU), *group],
                encoding,
            )
            for h in event.block_hashes
        ]
    return [_tagged("AllBlocksCleared", [], encoding)]


def _sglang(event: KvEvent, encoding: Encoding) -> list[Any]:
    if isinstance(event, Stored):
        items: list[tuple[str, Any]] = [
            ("block_hashes", event.block_hashes),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", event.token_ids),
            ("block_size", event.block_size),
            ("lora_id", None),  # always None: the name alone says the adapter
            ("medium", MEDIUM_GPU),
        ]
        if event.lora is not None and encoding == "map":  # older SGLang: no lora_name
            items.append(("lora_name", event.lora.name))  # srt/mem_cache/events.py
        return [_tagged("BlockStored", items, encoding)]
    if isinstance(event, Removed):
        items = [("block_hashes", list(event.block_hashes)), ("medium", MEDIUM_GPU)]
        return [_tagged("BlockRemoved", items, encoding)]
    return [_tagged("AllBlocksCleared", [], encoding)]
