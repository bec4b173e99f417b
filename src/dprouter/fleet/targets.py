"""Workers and targets: what the router routes to.

A worker is one engine HTTP endpoint; a target is one of its DP ranks,
``(worker, dp_rank)``, with ``dp_rank`` None when the worker has one rank or
the router leaves the rank to the engine. Target objects live as long as their
worker and carry their own load, so a policy reads load straight off the
snapshot it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dprouter.core.types import DialectName, Role
from dprouter.fleet import adapters
from dprouter.fleet.board import Board

# why a ready worker is held (``Worker.held``, set by the engine commands the router
# relays), and the one word each is shown by: the dashboard, ``dprouter top`` and the
# ``state`` of ``dprouter_worker_held``
PAUSED, UPDATING, ASLEEP = "paused", "updating its weights", "asleep"
HOLDS = {PAUSED: "paused", UPDATING: "updating", ASLEEP: "asleep"}


@dataclass(eq=False)
class Worker:
    """One engine endpoint: its configuration and what discovery learnt."""

    id: str
    url: str
    role: Role = "regular"
    dialect: DialectName | None = None  # None: discover it
    dp_size: int | None = None  # None: discover it; explicit wins
    rank_offset: int | None = None  # vLLM hybrid LB: first global rank behind this endpoint
    model: str | None = None  # configured model name, if any
    bootstrap_port: int | None = None  # P/D prefill: SGLang's, or vLLM Mooncake's server
    tp_size: int | None = None
    zmq_address: str | None = None  # MoRIIO: "host:IP,handshake:PORT,notify:PORT"
    transfer_mode: str | None = None  # MoRIIO: READ or WRITE
    kv_events: str | None = None  # KV-event publisher: tcp://HOST:PORT (rank r: PORT + r), auto
    kv_replay: str | None = None  # its replay socket, likewise
    kv_block_size: int | None = None  # the engine's block size, before its first event says
    api_key: str | None = field(default=None, repr=False)  # its own; never shown
    admin_key: str | None = field(default=None, repr=False)  # SGLang's --admin-api-key
    # learnt by discovery
    ranks: int = 0  # DP ranks this endpoint takes (0: not discovered yet)
    dp_attention: bool = False
    models: tuple[str, ...] = ()
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # as /v1/models wrote them
    state: Literal["discovering", "ready", "error"] = "discovering"
    error: str | None = None
    # set by the engine commands the router relays (``server/commands.py``): why a ready
    # worker takes no new request just now (paused, updating its weights, asleep)...
    held: str | None = None
    weight_version: str | None = None  # ...and the weights' version it serves (None: unsaid)
    version_since: float = 0.0  # time.monotonic() when the router last changed it
    targets: list[Target] = field(default_factory=list)
    # where the whole worker's load is counted (given by the registry that holds it)
    board: Board | None = field(default=None, repr=False)
    slot: int = -1

    @property
    def outstanding(self) -> int:
        """Requests in flight on any rank of the worker, in the whole router."""
        return 0 if self.board is None else self.board.inflight_of(self.slot)

    @property
    def outstanding_tokens(self) -> int:
        return 0 if self.board is None else self.board.tokens_of(self.slot)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def hold(self) -> str | None:
        """``held`` in one word (``HOLDS``): paused, updating or asleep; None: not held."""
        return None if self.held is None else HOLDS.get(self.held, self.held)

    def serves(self, model: str) -> bool:
        """``model`` is a name it lists (any name, when it lists none), or, on SGLang, a
        ``base:adapter`` of an adapter it lists (``fleet/adapters``)."""
        known = self.models or ((self.model,) if self.model else ())
        if not known or model in known:
            return True
        adapter = adapters.split(model, known) if self.dialect == "sglang" else None
        return adapter is not None and adapter[1] in known


class Target:
    """One routable unit. Equal by identity; ``label`` names it in logs and metrics.

    Its load lives on the board, in its slot: the whole router's count, whichever
    serving process sent the requests."""

    __slots__ = ("board", "label", "rank", "slot", "tripped", "worker")

    def __init__(
        self, worker: Worker, rank: int | None, board: Board | None = None, slot: int = -1
    ) -> None:
        if board is None:  # a target on its own (tests): a board of its own
            board = worker.board
            if board is None:
                board = worker.board = Board(slots=64)
                worker.slot = board.take()
        self.board = board
        self.slot = board.take() if slot < 0 else slot
        self.worker = worker
        self.rank = rank
        self.label = worker.id if rank is None else f"{worker.id}/{rank}"
        self.tripped = False  # its circuit breaker is open: out of the snapshot

    @property
    def outstanding(self) -> int:
        """Requests the router has in flight here."""
        return self.board.inflight_of(self.slot)

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        self.board.set_inflight(self.slot, value)

    @property
    def outstanding_tokens(self) -> int:
        """Prompt + expected output tokens of the requests in flight here."""
        return self.board.tokens_of(self.slot)

    @outstanding_tokens.setter
    def outstanding_tokens(self, value: int) -> None:
        self.board.set_tokens(self.slot, value)

    @property
    def reported(self) -> int:
        """Running + waiting the engine last reported for this rank."""
        return self.board.reported_of(self.slot)

    @reported.setter
    def reported(self, value: int) -> None:
        self.board.report(self.slot, value)

    def report(self, requests: int, tokens: int) -> None:
        """What the engine last said of this rank: requests running + waiting, and the
        tokens they hold (0: not said)."""
        self.board.report(self.slot, requests, tokens)

    @property
    def reported_tokens(self) -> int:
        return self.board.reported_tokens_of(self.slot)

    @property
    def token_load(self) -> int:
        """The router's tokens in flight, or the engine's report plus what the router
        sent since, when that is more (what ``min_tokens`` compares)."""
        return self.board.token_load_of(self.slot)

    @property
    def load(self) -> int:
        """The router's own count, or the engine's when it knows of more (other clients)."""
        return self.board.load_of(self.slot)

    @property
    def rank_label(self) -> str:
        return "" if self.rank is None else str(self.rank)

    def __repr__(self) -> str:
        return f"Target({self.label})"


class Outstanding:
    """Counts a request against its target for as long as the block runs.

    Released on every exit (error, cancellation, client disconnect), so the
    counts never drift and need no periodic reset. ``claim`` counts it before
    the block, in the same step as the decision (see ``board_lock``)."""

    __slots__ = ("claimed", "left", "requests", "seen", "target", "tokens")

    def __init__(self, target: Target, tokens: int, output: int = 0, requests: int = 1) -> None:
        self.target = target
        self.requests = requests  # a request sampling n sequences takes n running slots
        self.tokens = tokens  # counted now: prompt + output budget left
        self.left = output  # of which output budget, spent as the stream passes
        self.seen = 0  # output tokens seen go by
        self.claimed = False

    def spend(self, generated: int) -> None:
        """``generated`` more output tokens went by: that much less work is left here."""
        self.seen += generated
        n = min(generated, self.left)
        if n > 0 and self.claimed:
            t = self.target
            self.left -= n
            self.tokens -= n
            t.board.add(t.slot, 0, -n, t.worker.slot, -n)

    def claim(self) -> Outstanding:
        t = self.target
        t.board.add(t.slot, self.requests, self.tokens, t.worker.slot, self.left)
        self.claimed = True
        return self

    def __enter__(self) -> Target:
        if not self.claimed:
            self.claim()
        return self.target

    def __exit__(self, *exc: object) -> None:
        t = self.target
        t.board.add(t.slot, -self.requests, -self.tokens, t.worker.slot, -self.left)
        self.claimed = False
