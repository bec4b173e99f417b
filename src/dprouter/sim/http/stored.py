"""The Responses API of a simulated engine: responses kept in this engine's memory.

As in vLLM and SGLang, a stored response lives only in the engine that made it: a
``GET``, a ``cancel`` or a ``previous_response_id`` that reaches another engine gets
404. A background response stays ``in_progress`` for a tenth of a second per
requested output token (unless cancelled), so a test can cancel it in time.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from dprouter.sim.http.served import Refused, body_of, dumps, fail, place
from dprouter.sim.model.tokens import output_token, prompt_digest

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

WORDS_MAX = 16  # output words actually written, whatever the budget
SECONDS_PER_TOKEN = 0.1  # a background response's pace
WORD = re.compile(r"\s*\S+")  # a streamed delta: a word and the space before it


@dataclass
class Stored:
    obj: dict[str, Any]
    context: str  # the conversation so far, which a follow-up extends
    rank: int
    ready_at: float = 0.0  # background: when it completes
    cancelled: bool = False
    fields: dict[str, Any] = field(default_factory=dict)


def _input_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for item in value:
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):
                content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(str(content or ""))
        return "\n".join(parts)
    raise ValueError("input must be a string or a list of items")


class Responses:
    def __init__(self, server: SimServer, clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.kept: dict[str, Stored] = {}
        self.clock = clock

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{id}", self.retrieve),
            web.post("/v1/responses/{id}/cancel", self.cancel),
        ]

    def _missing(self, rid: str) -> web.Response:
        return fail(
            self.server, 404, f"Response with id '{rid}' not found.", "NotFoundError"
        ).response

    def _headers(self, rank: int) -> dict[str, str]:
        return {"x-sim-engine": self.server.engine_id, "x-sim-dp-rank": str(rank)}

    def _current(self, kept: Stored) -> dict[str, Any]:
        obj = kept.obj
        if obj["status"] == "in_progress" and not kept.cancelled and self.clock() >= kept.ready_at:
            obj.update(kept.fields, status="completed")
        return obj

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        try:
            body = await body_of(server, request)
            try:
                text = _input_text(body.get("input"))
            except ValueError as exc:
                raise fail(server, 400, str(exc)) from None
            previous = body.get("previous_response_id")
            context = ""
            if previous is not None:
                before = self.kept.get(str(previous))
                if before is None:
                    return self._missing(str(previous))
                context = before.context
            rank = await place(server, request, body)
        except Refused as refused:
            return refused.response
        budget = body.get("max_output_tokens")
        budget = budget if isinstance(budget, int) and budget > 0 else WORDS_MAX
        context = f"{context}\nuser: {text}"
        ids = server.encoder.encode(context)
        digest = prompt_digest(ids)
        words = [output_token(digest, i) for i in range(min(budget, WORDS_MAX))]
        answer = "".join(words).strip()
        prompt_tokens, out_tokens = len(ids), len(words)
        rid = "resp_" + uuid.uuid4().hex
        done = {
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_" + uuid.uuid4().hex,
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": answer, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": out_tokens,
                "total_tokens": prompt_tokens + out_tokens,
            },
        }
        obj: dict[str, Any] = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model") or server.config.model,
            "previous_response_id": previous,
            "store": body.get("store", True) is not False,
            "background": bool(body.get("background")),
            "status": "in_progress",
            "output": [],
            "usage": None,
        }
        kept = Stored(obj, f"{context}\nassistant: {answer}", rank, fields=done)
        if obj["background"]:
            kept.ready_at = self.clock() + budget * SECONDS_PER_TOKEN
        else:
            obj.update(done)
        if obj["store"]:
            self.kept[rid] = kept
        if body.get("stream") is True:
            return await self._stream(request, kept)
        return web.json_response(obj, headers=self._headers(rank), dumps=dumps)

    async def _stream(self, request: web.Request, kept: Stored) -> web.StreamResponse:
        """The events vLLM streams for a message, in its order: the response created and in
        progress, its output item and content part announced, the text a word per delta,
        then each closed in turn and the response completed."""
        headers = {**self._headers(kept.rank), "Content-Type": "text/event-stream"}
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        seq = 0

        async def event(kind: str, **data: Any) -> None:
            nonlocal seq
            line = orjson.dumps({"type": kind, "sequence_number": seq, **data})
            await resp.write(f"event: {kind}\n".encode() + b"data: " + line + b"\n\n")
            seq += 1

        item = kept.fields["output"][0]  # the message, as it is once complete
        text = item["content"][0]["text"]
        at = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        opening = {**kept.obj, "status": "in_progress", "output": [], "usage": None}
        await event("response.created", response=opening)
        await event("response.in_progress", response=opening)
        begun = {**item, "status": "in_progress", "content": []}
        await event("response.output_item.added", output_index=0, item=begun)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await event("response.content_part.added", **at, part=part)
        for piece in WORD.findall(text):
            await event("response.output_text.delta", **at, delta=piece, logprobs=[])
            await asyncio.sleep(0)
        await event("response.output_text.done", **at, text=text, logprobs=[])
        await event("response.content_part.done", **at, part={**part, "text": text})
        await event("response.output_item.done", output_index=0, item=item)
        kept.obj.update(kept.fields, status="completed")
        await event("response.completed", response=kept.obj)
        await resp.write_eof()
        return resp

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        kept = self.kept.get(rid)
        self.server.record(request, None, None if kept is None else kept.rank)
        if kept is None:
            return self._missing(rid)
        self.server.served[(request.path, kept.rank)] += 1
        return web.json_response(self._current(kept), headers=self._headers(kept.rank), dumps=dumps)

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        kept = self.kept.get(rid)
        self.server.record(request, None, None if kept is None else kept.rank)
        if kept is None:
            return self._missing(rid)
        obj = self._current(kept)
        if not obj["background"]:
            return fail(self.server, 400, "Cannot cancel a synchronous response.").response
        if obj["status"] == "in_progress":
            kept.cancelled = True
            obj["status"] = "cancelled"
        return web.json_response(obj, headers=self._headers(kept.rank), dumps=dumps)
