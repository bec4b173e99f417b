"""The words the whole router shares, as types: roles, dialects, P/D flows, request kinds.

See ``shared vocabulary`` in docs/architecture.md: a worker is one engine endpoint, a
target one of its DP ranks; a role says what a worker does; a dialect how an engine
kind wants its rank written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["regular", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("regular", "prefill", "decode")
Side = Literal["prefill", "decode"]  # the two legs of a P/D request
DialectName = Literal["vllm", "sglang"]
# a P/D flow, chosen at start-up
PdMode = Literal["vllm-nixl", "vllm-mooncake", "vllm-moriio", "sglang"]
PD_MODES: tuple[PdMode, ...] = ("vllm-nixl", "vllm-mooncake", "vllm-moriio", "sglang")
DpAware = Literal["auto", "off"]
DispatchMode = Literal["auto", "off"]  # auto: hold where running caps are known
SamplesMode = Literal["split", "together"]  # a request's n samples: routed one by one, or not
# how a request's body is read: each endpoint names one (see server/endpoints.py)
Kind = Literal["completion", "chat", "generate", "pooling", "tokenizer", "responses", "audio"]
# what a caller may do: use the models (the data plane), or also run the router (the admin
# API, RL and engine commands, the dashboard)
Access = Literal["user", "admin"]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as the front door knows them (``server/identity.py``)."""

    tenant: str  # whose limits and fair share it counts against
    access: Access
    priority: int = 0  # its class, as an index into --classes (0: the highest)
    weight: float = 1.0  # its tenant's share of its class when the fleet is full


ANONYMOUS = Caller("anonymous", "user")  # no identity configured: everyone is this one


@dataclass(slots=True)
class Incoming:
    """A client request as the router reads it: just enough to route it."""

    body: dict[str, Any]
    model: str | None
    stream: bool
    key: str | None  # routing key (session), if the client sent one
    text: str  # the prompt's start, for prefix affinity
    tokens: int  # prompt + output budget
    output: int = 0  # the output budget (max_tokens, or the default when unset)
    prompt_tokens: int = 0  # estimated
    limit: int | None = None  # max_tokens as sent; None: unset
    exact: bool = False  # the request runs to its limit (ignore_eos, min = max tokens)
    group: int = 0  # which prompt (or X-DPRouter-Group) it samples: its lengths' history
    samples: int = 1  # n: sequences sampled from the one prompt (each a running slot)
    caller: Caller = ANONYMOUS  # who sent it: its class and tenant order it when held
