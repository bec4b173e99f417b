"""The registry: workers by id, and an immutable snapshot of routable targets.

The snapshot is rebuilt copy-on-write whenever membership, discovery or health
changes; the request path only reads ``registry.snapshot`` (no lock, no
filtering). Targets are ordered over the flat slot space, interleaved across
workers -- w0r0, w1r0, w2r0, w0r1, w1r1, ... -- so a counter over the tuple
covers every rank of every worker evenly, whatever each worker's dp size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dprouter.core.errors import Duplicate
from dprouter.core.types import DialectName, Role
from dprouter.fleet import adapters
from dprouter.fleet.board import Board
from dprouter.fleet.targets import Target, Worker
from dprouter.fleet.worker_spec import WorkerSpec


def interleave(workers: Iterable[Worker]) -> tuple[Target, ...]:
    columns = [[t for t in w.targets if not t.tripped] for w in workers]
    depth = max((len(c) for c in columns), default=0)
    return tuple(c[r] for r in range(depth) for c in columns if r < len(c))


@dataclass(frozen=True)
class Snapshot:
    version: int
    workers: tuple[Worker, ...]  # ready, healthy and not held, in registration order
    _pools: dict[tuple[Role, str | None, DialectName | None], tuple[Target, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )
    known_models: frozenset[str] = field(init=False, repr=False, compare=False)
    # the names the workers list as LoRA adapters: both engines give an adapter's card
    # its base as ``parent`` (vLLM 0.32's ``show_available_models``, SGLang 0.5.23's)
    listed_adapters: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "known_models", frozenset(self.models()))
        listed = {m for w in self.workers for m, card in w.cards.items() if card.get("parent")}
        object.__setattr__(self, "listed_adapters", frozenset(listed))

    def pool(
        self, role: Role = "regular", model: str | None = None, dialect: DialectName | None = None
    ) -> tuple[Target, ...]:
        """Targets of one role serving ``model`` (any if None) in ``dialect`` (any if None).
        ``model`` is a name as ``named`` writes it: SGLang's ``base:adapter`` goes to the
        SGLang workers listing the adapter (and its base, when the base is a name some
        worker lists: SGLang does not check it); an adapter no worker lists, only to
        workers that list nothing (which may have it)."""
        key = (role, model, dialect)
        found = self._pools.get(key)
        if found is None:
            if model is not None and model not in self.known_models:
                return self._unlisted(role, model, dialect)
            chosen = [
                w
                for w in self.workers
                if w.role == role
                and (model is None or w.serves(model))
                and (dialect is None or w.dialect == dialect)
            ]
            found = self._pools[key] = interleave(chosen)
        return found

    def _unlisted(self, role: Role, model: str, dialect: DialectName | None) -> tuple[Target, ...]:
        """The pool of a name no worker lists. Cached only when the names in it are listed
        ones (clients cannot grow the cache)."""
        known = self.known_models
        adapter = adapters.split(model, known)
        if adapter is None:
            # a plain name goes where any name is served: SGLang engines (they serve whatever
            # a client writes, "default" say) and workers that list none
            return interleave(
                w
                for w in self.workers
                if w.role == role
                and (w.dialect == "sglang" or not (w.models or w.model))
                and (dialect is None or w.dialect == dialect)
            )
        base, name = adapter
        listed = name in known
        found = interleave(
            w
            for w in self.workers
            if w.role == role
            and (dialect is None or w.dialect == dialect)
            and (
                (
                    w.dialect == "sglang"
                    and name in w.models
                    and (base not in known or w.serves(base))
                )
                if listed
                else not (w.models or w.model)
            )
        )
        if listed and (not base or base in known):
            self._pools[(role, model, dialect)] = found
        return found

    def named(self, model: str | None, lora_path: object = None) -> str | None:
        """The name a request runs under (``adapters.named``): its ``model``, or with
        SGLang's ``lora_path`` ``model:adapter``; its pool is ``pool``'s of that name."""
        return adapters.named(model, lora_path, self.known_models)

    def adapter(self, name: str | None) -> str | None:
        """The LoRA adapter a request runs under ``name`` (as ``named`` writes it), None
        for a base model: what affinity is kept by. An engine caches each adapter's KV
        apart, and the base's once, however a request names it (SGLang's /generate names
        no model; its OpenAI paths do)."""
        if name is None:
            return None
        if name.startswith(":"):
            return name[1:]
        if name in self.listed_adapters:
            return name
        found = adapters.split(name, self.known_models)
        return None if found is None else found[1]

    def model_cards(self) -> dict[str, dict[str, Any]]:
        """One card per model, as the engines wrote it (the first worker listing it), with
        the smallest ``max_model_len`` of those that serve it: a request fits them all."""
        cards: dict[str, dict[str, Any]] = {}
        for w in self.workers:
            for m in w.models or ((w.model,) if w.model else ()):
                card = w.cards.get(m) or {"id": m, "object": "model", "owned_by": "dprouter"}
                seen = cards.setdefault(m, dict(card))
                limits = [x for x in (seen.get("max_model_len"), card.get("max_model_len")) if x]
                if limits:
                    seen["max_model_len"] = min(limits)
        return cards

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self.workers:
            for m in w.models or ((w.model,) if w.model else ()):
                seen.setdefault(m, None)
        return list(seen)


class Registry:
    """Workers and their targets. ``dp_aware`` False gives each worker one
    target with no rank: the engine's own balancer then places the request."""

    def __init__(self, dp_aware: bool = True, board: Board | None = None) -> None:
        self.dp_aware = dp_aware
        self.board = board or Board()  # load per slot; the registry hands the slots out
        self.workers: dict[str, Worker] = {}
        self.snapshot = Snapshot(0, ())
        self.listeners: list[Callable[[], None]] = []  # told of every rebuild
        self.stale = False  # membership comes from a source that cannot be read just now
        self.held = False  # a ready worker is held (paused, updating): requests may wait
        self._version = 0

    def add(self, worker: Worker) -> Worker:
        if worker.id in self.workers:
            raise Duplicate(f"worker id {worker.id!r} already registered")
        clash = next((w for w in self.workers.values() if w.url == worker.url), None)
        if clash is not None:
            raise Duplicate(f"worker {worker.url} already registered as {clash.id!r}")
        worker.board, worker.slot = self.board, self.board.take()
        self.workers[worker.id] = worker
        self.rebuild()
        return worker

    def remove(self, worker_id: str) -> Worker:
        worker = self.workers.pop(worker_id)
        for t in worker.targets:
            self.board.give(t.slot)
        self.board.give(worker.slot)
        worker.targets = []  # every rank of the worker leaves with it
        self.rebuild()
        return worker

    def next_id(self, role: Role = "regular") -> str:
        prefix = {"regular": "w", "prefill": "p", "decode": "d"}[role]
        n = 0
        while f"{prefix}{n}" in self.workers:
            n += 1
        return f"{prefix}{n}"

    def mark_ready(self, worker: Worker) -> None:
        """Discovery (or configuration) settled ``worker.ranks``: give it targets."""
        wanted: list[int | None] = [None]
        if self.dp_aware and worker.ranks > 1:
            wanted = list(range(worker.ranks))
        have = {t.rank: t for t in worker.targets}  # keep live targets and their counts
        worker.targets = [
            have.pop(r) if r in have else Target(worker, r, self.board) for r in wanted
        ]
        for gone in have.values():
            self.board.give(gone.slot)
        worker.state = "ready"
        worker.error = None
        self.rebuild()

    def mark_discovering(self, worker: Worker) -> None:
        """Out of the snapshot until discovery finds it again (it stopped answering)."""
        worker.state = "discovering"
        self.rebuild()

    def mark_error(self, worker: Worker, error: str) -> None:
        worker.state = "error"
        worker.error = error
        self.rebuild()

    def mark_stale(self, stale: bool) -> bool:
        """The membership source can (True) or cannot be read just now; True when that is
        news (the snapshot is rebuilt, so followers and metrics learn of it)."""
        if self.stale == stale:
            return False
        self.stale = stale
        self.rebuild()
        return True

    def rebuild(self) -> None:
        self._version += 1
        ready = tuple(w for w in self.workers.values() if w.ready and w.targets)
        self.held = any(w.held is not None for w in ready)
        ready = tuple(w for w in ready if w.held is None) if self.held else ready
        self.snapshot = Snapshot(self._version, ready)
        for listener in self.listeners:
            listener()

    def hold(self, worker: Worker, why: str | None) -> None:
        """``worker`` takes no new request while ``why`` (None: it takes them again)."""
        if worker.held != why:
            worker.held = why
            self.rebuild()

    def set_weight_version(self, worker: Worker, version: str) -> bool:
        """``worker`` serves weights ``version`` now; True when that is news (the snapshot
        is rebuilt, so followers and requests waiting for those weights learn of it)."""
        if worker.weight_version == version:
            return False
        worker.weight_version = version
        worker.version_since = time.monotonic()
        self.rebuild()
        return True

    def ready(self) -> list[Worker]:
        """Ready workers, held or not: those an engine command reaches."""
        return [w for w in self.workers.values() if w.ready and w.targets]

    def targets(self) -> list[Target]:
        return [t for w in self.workers.values() for t in w.targets]


def worker_from_spec(spec: WorkerSpec, registry: Registry) -> Worker:
    return Worker(
        id=spec.id or registry.next_id(spec.role),
        url=spec.url,
        role=spec.role,
        dialect=spec.dialect,
        dp_size=spec.dp_size,
        rank_offset=spec.rank_offset,
        model=spec.model,
        bootstrap_port=spec.bootstrap_port,
        tp_size=spec.tp_size,
        kv_events=spec.kv_events,
        kv_replay=spec.kv_replay,
        kv_block_size=spec.kv_block_size,
        api_key=spec.api_key,
        admin_key=spec.admin_key,
    )
