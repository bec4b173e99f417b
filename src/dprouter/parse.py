"""Reading a client request: just enough validation to route it and fail clearly.

The engine validates the rest; the router checks the fields it relies on, so
a wrong type is a 400 naming the field rather than a routing accident.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Kind = Literal["completion", "chat", "generate"]
KEY_HEADERS = ("X-SMG-Routing-Key", "X-Session-ID")
KEY_FIELDS = ("session_id", "user")
MAX_KEY = 512
AFFINITY_CHARS = 4096  # prefix affinity looks no further into a prompt
DEFAULT_OUTPUT = 256  # expected output tokens when the client sets no limit


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@dataclass(slots=True)
class Incoming:
    body: dict[str, Any]
    model: str | None
    stream: bool
    key: str | None
    text: str
    tokens: int


def _typed(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise BadRequest(f"{name} must be {what}, got {type(value).__name__}", name)
    return value


def _limit(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = _typed(body, name, (int,), "an integer")
        if value is not None:
            if value < 1:
                raise BadRequest(f"{name} must be at least 1, got {value}", name)
            return int(value)
    return None


def _chat_text(messages: list[Any]) -> str:
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string or a list", "messages")
    return "\n".join(parts)


def _prompt_text(body: Mapping[str, Any], kind: Kind) -> str:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        return _chat_text(messages)
    name = "prompt" if kind == "completion" else "text"
    prompt = body.get(name)
    if kind == "generate" and prompt is None and isinstance(body.get("input_ids"), list):
        return " ".join(map(str, body["input_ids"][:AFFINITY_CHARS]))
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return first if isinstance(first, str) else " ".join(map(str, prompt[:AFFINITY_CHARS]))
    raise BadRequest(f"{name} must be a non-empty string or list", name)


def routing_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    for name in KEY_HEADERS:
        value = headers.get(name)
        if value is not None:
            if not value or len(value) > MAX_KEY:
                raise BadRequest(f"{name} must be 1 to {MAX_KEY} characters", name)
            return value
    for name in KEY_FIELDS:
        value = _typed(body, name, (str,), "a string")
        if value:
            return str(value)[:MAX_KEY]
    return None


def parse(raw: bytes, kind: Kind, headers: Mapping[str, str]) -> Incoming:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = _typed(body, "model", (str,), "a string")
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    if kind == "generate":
        params = _typed(body, "sampling_params", (dict,), "an object") or {}
        limit = _limit(params, "max_new_tokens")
    else:
        limit = _limit(body, "max_completion_tokens", "max_tokens")
    text = _prompt_text(body, kind)
    return Incoming(
        body=body,
        model=model,
        stream=stream,
        key=routing_key(headers, body),
        text=text[:AFFINITY_CHARS],
        tokens=len(text) // 4 + (limit or DEFAULT_OUTPUT),
    )
