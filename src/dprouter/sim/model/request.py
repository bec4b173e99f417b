"""One generation request as the engine model sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dprouter.sim.model.kvevents import Adapter


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float  # virtual seconds
    rank: int | None = None  # pinned rank, then the rank that serves it
    bootstrap_room: int | None = None
    remote_kv: bool = False  # P/D decode: the prompt's KV came from a prefill engine
    lora: Adapter | None = None  # the adapter that runs it (None: the base model)
    block_hashes: list[int] | None = None  # filled on first admission attempt
    phase: Phase = Phase.WAITING
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens whose KV exists
    generated: int = 0  # exact when the request is not decoding (see DecodeBatch)
    base_tick: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    tag: object = field(default=None, repr=False)  # caller's handle (stream, session...)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def footprint(self) -> int:
        """KV tokens reserved for the whole life of the request."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def done(self) -> bool:
        return self.phase in (Phase.FINISHED, Phase.ABORTED)
