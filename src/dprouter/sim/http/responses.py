"""Response bodies and SSE chunks in the shapes vLLM and SGLang send."""

from __future__ import annotations

import time
from collections.abc import Sequence
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

    def full(self, texts: Sequence[str], use: dict[str, Any]) -> dict[str, Any]:
        """The whole answer: one choice per sampled sequence."""
        choices: list[dict[str, Any]] = []
        for index, text in enumerate(texts):
            if self.kind == "chat":
                message = {"role": "assistant", "content": text}
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text}
            choice.update(logprobs=None, finish_reason="length", stop_reason=None)
            choices.append(choice)
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = use
        return body

    def opening(self, index: int = 0) -> bytes:
        """Chat streams open each choice with the assistant role; completions do not."""
        if self.kind != "chat":
            return b""
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def piece(self, text: str, last: bool, index: int = 0) -> bytes:
        finish = "length" if last else None
        if self.kind == "chat":
            return self._chunk({"content": text}, finish, index)
        return self._chunk(text, finish, index)

    def _chunk(self, delta: Any, finish: str | None, index: int) -> bytes:
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": delta}
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
