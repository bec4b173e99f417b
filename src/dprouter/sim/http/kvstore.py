"""The KV a simulated prefill engine produced, waiting for its decode engine to take it.

Each entry remembers which rank produced it and for which prompt, so a decode
that names the wrong rank, the wrong prompt, KV never produced or KV already
taken fails with a message that says which -- wrong pairing is detectable.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

CAPACITY = 100_000  # entries kept; the oldest go first


@dataclass
class KvEntry:
    rank: int
    digest: int  # of the prompt tokens
    prompt_tokens: int
    meta: dict[str, object] = field(default_factory=dict)  # what the prefill was told of its peer
    taken: bool = False


@dataclass
class KvStore:
    engine_id: str
    dp_size: int
    entries: OrderedDict[str, KvEntry] = field(default_factory=OrderedDict)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def engine_name(self, rank: int) -> str:
        """The per-rank engine id a real connector reports: each DP rank is an engine core,
        named ``<engine_id>_dp<rank>`` (vLLM 0.32, ``v1/engine/core.py``)."""
        return f"{self.engine_id}_dp{rank}"

    def publish(
        self,
        key: str,
        rank: int,
        digest: int,
        prompt_tokens: int,
        meta: dict[str, object] | None = None,
    ) -> None:
        self.entries[key] = KvEntry(rank, digest, prompt_tokens, dict(meta or {}))
        while len(self.entries) > CAPACITY:
            self.entries.popitem(last=False)
        self._arrived.set()  # wake every waiting taker; each checks for its own key
        self._arrived = asyncio.Event()

    async def take(
        self,
        key: str,
        rank: int | None,
        engine: str | None,
        digest: int,
        wait: float,
        claims: dict[str, object] | None = None,
    ) -> tuple[int, str, int]:
        """``(HTTP status, message, prompt tokens)``; 200 hands the KV over, once."""
        entry = await self._await(key, wait)
        if entry is None:
            return 404, f"KV {key} was never produced on {self.engine_id}", 0
        if rank is not None and entry.rank != rank:
            return 409, f"KV {key} was produced on rank {entry.rank}, not rank {rank}", 0
        if engine is not None and engine != self.engine_name(entry.rank):
            return 409, f"KV {key} belongs to {self.engine_name(entry.rank)}, not {engine}", 0
        if entry.digest != digest:
            return 409, f"KV {key} holds a different prompt than this decode request", 0
        for name, claimed in (claims or {}).items():
            known = entry.meta.get(name)
            if known is not None and known != claimed:
                return 409, f"KV {key}: the decode has {name}={claimed}, the prefill {known}", 0
        if entry.taken:
            return 410, f"KV {key} was already consumed", 0
        entry.taken = True
        return 200, "ok", entry.prompt_tokens

    async def _await(self, key: str, wait: float) -> KvEntry | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (entry := self.entries.get(key)) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):  # keeps a cancel (wait_for on 3.11 may not)
                    await self._arrived.wait()
            except TimeoutError:
                return None
        return entry
