"""Request bodies the simulated engines accept, validated like the real servers (pydantic)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dprouter.sim.model.encoder import BuiltinEncoder, Encoder

DEFAULT_MAX_TOKENS = 16
# the simulator's end of sequence: a prompt that ends with "eos=N" stops after N output
# tokens, under a larger max_tokens, as a model stops when it is done (a workload names
# each turn's true length; every router forwards the prompt unchanged)
EOS = re.compile(r"\beos=(\d+)\s*$")
Kind = Literal["completion", "chat", "generate"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionBody(_Body):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """A batch of one prompt is that prompt; the simulator takes no larger batches."""
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("the simulated engine serves one prompt per request")
            return v[0]
        return v


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)


class SamplingParams(_Body):
    max_new_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)


class GenerateBody(_Body):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    rid: str | None = None


@dataclass(frozen=True)
class Parsed:
    """What the engine needs from any generation body."""

    kind: Kind
    model: str | None
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    rid: str | None = None
    n: int = 1  # sequences sampled from the one prompt

    @property
    def prompt_len_total(self) -> int:
        """Tokens the request needs at its longest: prompt plus every output token."""
        return len(self.prompt_ids) + self.max_tokens


def parse(kind: Kind, body: object, encoder: Encoder | None = None) -> Parsed:
    """Validate a JSON body; raises ``ValueError`` with a message naming the field.
    ``encoder``: the engine's tokenizer (default: the built-in rule)."""
    return _check(_parse(kind, body, encoder or BuiltinEncoder()))


def _stop(text: str, limit: int) -> int:
    """Output tokens a prompt runs to: its ``eos=N`` if it ends with one, within ``limit``."""
    found = EOS.search(text[-32:])
    return min(limit, int(found.group(1))) if found else limit


def _parse(kind: Kind, body: object, encoder: Encoder) -> Parsed:
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    try:
        if kind == "completion":
            c = CompletionBody.model_validate(body)
            ids = encoder.encode(c.prompt) if isinstance(c.prompt, str) else c.prompt
            opts = c.stream_options
            limit = c.max_tokens or DEFAULT_MAX_TOKENS
            return Parsed(
                kind=kind,
                model=c.model,
                prompt_ids=ids,
                max_tokens=_stop(c.prompt, limit) if isinstance(c.prompt, str) else limit,
                stream=c.stream,
                include_usage=bool(opts and opts.include_usage),
                n=c.n,
            )
        if kind == "chat":
            ch = ChatBody.model_validate(body)
            opts = ch.stream_options
            limit = ch.max_completion_tokens or ch.max_tokens or DEFAULT_MAX_TOKENS
            return Parsed(
                kind=kind,
                model=ch.model,
                prompt_ids=encoder.encode_chat([(m.role, m.text()) for m in ch.messages]),
                max_tokens=_stop(ch.messages[-1].text(), limit),
                stream=ch.stream,
                include_usage=bool(opts and opts.include_usage),
                n=ch.n,
            )
        g = GenerateBody.model_validate(body)
        if (g.text is None) == (g.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        ids = encoder.encode(g.text) if g.text is not None else list(g.input_ids or [])
        return Parsed(
            kind=kind,
            model=None,
            prompt_ids=ids,
            stream=g.stream,
            include_usage=False,
            max_tokens=_stop(g.text or "", g.sampling_params.max_new_tokens or DEFAULT_MAX_TOKENS),
            rid=g.rid,
            n=g.sampling_params.n,
        )
    except ValidationError as exc:
        raise ValueError(describe(exc)) from None


def _check(parsed: Parsed) -> Parsed:
    if not parsed.prompt_ids:
        raise ValueError("prompt: the prompt cannot be empty")
    return parsed


def describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
