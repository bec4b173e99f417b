"""Response bodies and SSE chunks in the shapes vLLM and SGLang send."""

from __future__ import annotations

import time
from typing import Any

import orjson

from dprouter.sim.http.protocol import Kind

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Render:
    """Builds one request's response in its endpoint's shape."""

    def __init__(self, kind: Kind, rid: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, use: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason="length", stop_reason=None)
        body["choices"] = [choice]
        body["usage"] = use
        return body

    def opening(self) -> bytes:
        """Chat streams open with the assistant role; completions have no opening."""
        if self.kind != "chat":
            return b""
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str, last: bool) -> bytes:
        finish = "length" if last else None
        if self.kind == "chat":
            return self._chunk({"content": text}, finish)
        return self._chunk(text, finish)

    def _chunk(self, delta: Any, finish: str | None) -> bytes:
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": delta}
        choice.update(logprobs=None, finish_reason=finish, stop_reason=None)
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def closing(self, use: dict[str, Any]) -> bytes:
        if not self.include_usage:
            return DONE
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._head(obj)
        body["choices"] = []
        body["usage"] = use
        return sse(body) + DONE


def generate_meta(
    rid: str, prompt: int, completion: int, cached: int, finished: bool, latency: float
) -> dict[str, Any]:
    """SGLang ``/generate`` meta_info; ``finish_reason`` is null until the last chunk."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "length", "length": completion} if finished else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
    }
    if finished:
        meta["e2e_latency"] = latency
    return meta
