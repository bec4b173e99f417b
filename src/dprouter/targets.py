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

from yarl import URL

Role = Literal["regular", "prefill", "decode"]
DialectName = Literal["vllm", "sglang"]
ROLES: tuple[Role, ...] = ("regular", "prefill", "decode")


def normalise_url(raw: str) -> str:
    """``http://host:port``; IPv6 hosts stay bracketed. A path is refused: the router
    appends the client's own path (``/v1/completions``, ...) to the worker's URL."""
    url = URL(raw if "://" in raw else f"http://{raw}")
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"worker URL {raw!r} must be http(s)://host:port")
    if url.user or url.password or url.query_string or url.fragment:
        raise ValueError(f"worker URL {raw!r} must not carry credentials, a query or a fragment")
    if url.path.strip("/"):
        raise ValueError(
            f"worker URL {raw!r} has a path ({url.path}): give the engine's root, "
            f"{url.origin()}; the router adds /v1/... itself"
        )
    return str(url.origin())


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
    bootstrap_port: int | None = None  # SGLang P/D prefill
    tp_size: int | None = None
    zmq_address: str | None = None  # MoRIIO: "host:IP,handshake:PORT,notify:PORT"
    transfer_mode: str | None = None  # MoRIIO: READ or WRITE
    # learnt by discovery
    ranks: int = 0  # DP ranks this endpoint takes (0: not discovered yet)
    dp_attention: bool = False
    models: tuple[str, ...] = ()
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # as /v1/models wrote them
    state: Literal["discovering", "ready", "error"] = "discovering"
    error: str | None = None
    # load of the whole worker, kept with its targets'
    outstanding: int = 0
    outstanding_tokens: int = 0
    targets: list[Target] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def serves(self, model: str) -> bool:
        known = self.models or ((self.model,) if self.model else ())
        return not known or model in known


class Target:
    """One routable unit. Equal by identity; ``label`` names it in logs and metrics."""

    __slots__ = (
        "_outstanding",
        "_reported",
        "label",
        "load",
        "outstanding_tokens",
        "rank",
        "tripped",
        "worker",
    )

    def __init__(self, worker: Worker, rank: int | None) -> None:
        self.worker = worker
        self.rank = rank
        self.label = worker.id if rank is None else f"{worker.id}/{rank}"
        self._outstanding = 0
        self._reported = 0
        # the router's own count, or the engine's when it knows of more (other clients);
        # kept up to date on every change so that policies compare it at C speed
        self.load = 0
        self.outstanding_tokens = 0  # prompt + expected output tokens of those in flight
        self.tripped = False  # its circuit breaker is open: out of the snapshot

    @property
    def outstanding(self) -> int:
        """Requests the router has in flight here."""
        return self._outstanding

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        self._outstanding = value
        self.load = max(value, self._reported)

    @property
    def reported(self) -> int:
        """Running + waiting the engine last reported for this rank."""
        return self._reported

    @reported.setter
    def reported(self, value: int) -> None:
        self._reported = value
        self.load = max(self._outstanding, value)

    @property
    def rank_label(self) -> str:
        return "" if self.rank is None else str(self.rank)

    def __repr__(self) -> str:
        return f"Target({self.label})"


class Outstanding:
    """Counts a request against its target for as long as the block runs.

    Released on every exit (error, cancellation, client disconnect), so the
    counts never drift and need no periodic reset.
    """

    __slots__ = ("target", "tokens")

    def __init__(self, target: Target, tokens: int) -> None:
        self.target = target
        self.tokens = tokens

    def __enter__(self) -> Target:
        t = self.target
        t.outstanding += 1
        t.outstanding_tokens += self.tokens
        t.worker.outstanding += 1
        t.worker.outstanding_tokens += self.tokens
        return t

    def __exit__(self, *exc: object) -> None:
        t = self.target
        t.outstanding -= 1
        t.outstanding_tokens -= self.tokens
        t.worker.outstanding -= 1
        t.worker.outstanding_tokens -= self.tokens
