"""The generation endpoints of a simulated engine: parse, place, stream or answer."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from dprouter.sim.http.pd import (
    PdError,
    decode_ticket,
    prefill_key,
    prefill_meta,
    room_conflict,
    take,
)
from dprouter.sim.http.persona import RankError
from dprouter.sim.http.protocol import Kind, Parsed, parse
from dprouter.sim.http.responses import DONE, Render, generate_meta, sse, usage
from dprouter.sim.http.runner import ABORTED
from dprouter.sim.model.dispatch import DispatchError
from dprouter.sim.model.request import SimRequest
from dprouter.sim.model.tokens import output_token, prompt_digest

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

RID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-", "generate": ""}


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def too_long(limit: int, parsed: Parsed) -> str:
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{parsed.prompt_len_total} tokens ({len(parsed.prompt_ids)} in the messages, "
        f"{parsed.max_tokens} in the completion). Please reduce the length of the messages "
        "or completion."
    )


class Generation:
    """One request's journey through the engine."""

    def __init__(self, server: SimServer, request: web.Request, kind: Kind) -> None:
        self.server = server
        self.request = request
        self.kind = kind
        self.headers = {"x-sim-engine": server.engine_id}
        self.prefill_key: str | None = None  # a prefill keeps its KV under this key
        self.prefill_meta: dict[str, object] = {}  # and what it was told of its decode peer
        self.remote_kv = False  # a decode took its KV from a prefill engine
        self.early: web.StreamResponse | None = None  # a streaming decode's answer, begun

    def fail(
        self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None
    ) -> web.Response:
        body = self.server.persona.error_body(status, message, etype, param, self.kind)
        return web.json_response(body, status=status, headers=self.headers, dumps=_dumps)

    async def stream_fail(self, message: str) -> web.StreamResponse:
        """Engines that already chose to stream report errors inside a 200 SSE body."""
        resp = web.StreamResponse(headers={**self.headers, "Content-Type": "text/event-stream"})
        await resp.prepare(self.request)
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        await resp.write(sse({"error": error}) + DONE)
        await resp.write_eof()
        return resp

    async def run(self) -> web.StreamResponse:
        server = self.server
        server.generation_requests += 1
        faults = server.config.faults
        if faults.crash_after is not None and server.generation_requests > faults.crash_after:
            asyncio.get_running_loop().create_task(server.crash())
            await asyncio.Event().wait()  # cancelled when crash() resets this connection
        try:
            raw = await self.request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.fail(413, f"Request body exceeds {server.max_body} bytes")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self.fail(400, f"Invalid JSON body: {exc}")
        try:
            parsed = parse(self.kind, body, self.server.encoder)
        except ValueError as exc:
            return self.fail(400, str(exc))
        adapters = server.adapters.loaded
        message = server.persona.model_error(parsed.model, server.config.model, adapters)
        if message is not None:
            return self.fail(404, message, "NotFoundError", "model")
        try:
            lora = server.persona.adapter(body, server.config.model, adapters)
        except ValueError as exc:
            return self.fail(400, str(exc))
        try:
            rank = server.persona.pinned_rank(
                self.request.headers, body, server.config.dp_size, self.kind
            )
        except RankError as exc:
            server.record(self.request, body, None)
            return await self.stream_fail(str(exc)) if parsed.stream else self.fail(400, str(exc))
        limit = server.config.limits.max_model_len
        if parsed.prompt_len_total > limit:
            return self.fail(400, too_long(limit, parsed))
        if faults.delay > 0:
            await asyncio.sleep(faults.delay)
        if (
            server.generation_requests <= faults.fail_first
            or server.rng.random() < faults.fail_rate
        ):
            return self.fail(500, "simulated engine failure", "InternalServerError")
        if rank is not None and rank in faults.failing_ranks:
            return self.fail(500, f"simulated failure of rank {rank}", "InternalServerError")
        if faults.hang:
            await asyncio.Event().wait()  # until the client gives up
        room = body.get("bootstrap_room")
        rid = parsed.rid or RID_PREFIX[self.kind] + uuid.uuid4().hex
        failed = await self.pd_step(body, parsed, rid, rank)
        if failed is not None:
            server.record(self.request, body, None)
            return failed
        await server.weights.admitted()  # a paused engine holds new requests
        req = SimRequest(
            rid,
            parsed.prompt_ids,
            1 if self.prefill_key is not None else parsed.max_tokens,  # a prefill stops at one
            server.runner.now(),
            rank,
            room if isinstance(room, int) else None,
            remote_kv=self.remote_kv,
            lora=None if lora is None else adapters[lora],
        )
        try:
            queue = server.runner.submit(req)
        except DispatchError as exc:
            server.record(self.request, body, None)
            return await self.stream_fail(str(exc)) if parsed.stream else self.fail(400, str(exc))
        server.record(self.request, body, req.rank)
        self.headers["x-sim-dp-rank"] = str(req.rank)
        try:
            if parsed.stream:
                return await self.stream(req, parsed, queue)
            return await self.whole(req, parsed, queue)
        finally:
            if not req.done:
                server.runner.abort(req)  # client gone or server stopping: free the rank

    async def pd_step(
        self, body: Any, parsed: Parsed, rid: str, rank: int | None
    ) -> web.StreamResponse | None:
        """Prefill: note where the KV will be kept. Decode: take the KV first -- after
        answering its headers when streaming, as a real decode engine does."""
        pd = self.server.config.pd
        if pd is None:
            return None
        try:
            me = self.server.me()
            if pd.role == "prefill":
                config = self.server.config
                if pd.mode == "sglang":
                    conflict = room_conflict(body, rank, config.dp_size, config.dp_attention)
                    if conflict is not None:
                        return self.fail(500, conflict, "InternalServerError")
                self.prefill_key = prefill_key(pd, body, rid)
                self.prefill_meta = prefill_meta(pd, body, self.request.headers, me)
                return None
            ticket = decode_ticket(pd, body, self.request.headers, me)
        except PdError as exc:
            return self.fail(400, str(exc))
        if parsed.stream:
            headers = {**self.headers, "Content-Type": "text/event-stream"}
            if rank is not None:
                headers["x-sim-dp-rank"] = str(rank)
            self.early = web.StreamResponse(headers=headers)
            await self.early.prepare(self.request)
        try:
            assert self.server.pd is not None
            located = self.server.pd.located
            digest = prompt_digest(parsed.prompt_ids)
            await take(self.server.session, ticket, digest, pd.kv_wait, located)
        except PdError as exc:
            message = f"KV transfer failed: {exc}"
            if self.early is None:
                return self.fail(500, message, "KVTransferError")
            error = {"message": message, "type": "KVTransferError", "param": None, "code": 500}
            await self.early.write(sse({"error": error}) + DONE)
            await self.early.write_eof()
            return self.early
        self.remote_kv = True
        return None

    async def whole(
        self, req: SimRequest, parsed: Parsed, queue: asyncio.Queue[tuple[int, bool]]
    ) -> web.StreamResponse:
        done = False
        while not done:
            generated, done = await queue.get()
            if generated == ABORTED:
                return self.fail(499, "request aborted", "AbortedError")
            if generated < 0:
                return self.fail(503, "engine shut down", "ServiceUnavailableError")
        digest = prompt_digest(req.prompt_ids)
        text = "".join(output_token(digest, i) for i in range(req.generated))
        if self.kind == "generate":
            meta = generate_meta(
                req.rid,
                req.prompt_len,
                req.generated,
                req.cached_tokens,
                True,
                self.server.runner.now() - req.arrival,
            )
            meta["weight_version"] = self.server.weights.version
            body: dict[str, Any] = {
                "text": text,
                "output_ids": self.server.encoder.encode(text, special=False),
                "meta_info": meta,
            }
        else:
            use = usage(req.prompt_len, req.generated, req.cached_tokens)
            body = Render(self.kind, req.rid, self.server.config.model, False).full(text, use)
        if self.prefill_key is not None:
            params = self.server.publish_kv(self.prefill_key, req, self.prefill_meta)
            if params is not None:
                body["kv_transfer_params"] = params
        return web.json_response(body, headers=self.headers, dumps=_dumps)

    async def stream(
        self, req: SimRequest, parsed: Parsed, queue: asyncio.Queue[tuple[int, bool]]
    ) -> web.StreamResponse:
        if self.early is not None:  # a decode already answered its headers
            resp = self.early
        else:
            headers = {
                **self.headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
            resp = web.StreamResponse(headers=headers)
            await resp.prepare(self.request)
        render = Render(self.kind, req.rid, self.server.config.model, parsed.include_usage)
        digest = prompt_digest(req.prompt_ids)
        text = ""
        sent = 0
        try:
            await resp.write(render.opening())
            done = False
            while not done:
                generated, done = await queue.get()
                if generated < 0:
                    aborted = generated == ABORTED
                    error = {
                        "message": "request aborted" if aborted else "engine shut down",
                        "type": "AbortedError" if aborted else "ServiceUnavailableError",
                        "param": None,
                        "code": 499 if aborted else 503,
                    }
                    await resp.write(sse({"error": error}) + DONE)
                    return resp
                piece = "".join(output_token(digest, i) for i in range(sent, generated))
                sent = generated
                if self.kind == "generate":
                    text += piece
                    meta = generate_meta(
                        req.rid,
                        req.prompt_len,
                        sent,
                        req.cached_tokens,
                        done,
                        self.server.runner.now() - req.arrival,
                    )
                    meta["weight_version"] = self.server.weights.version
                    await resp.write(sse({"text": text, "meta_info": meta}))
                else:
                    await resp.write(render.piece(piece, done))
            if self.prefill_key is not None:
                self.server.publish_kv(self.prefill_key, req, self.prefill_meta)
            if self.kind == "generate":
                await resp.write(DONE)
            else:
                await resp.write(render.closing(usage(req.prompt_len, sent, req.cached_tokens)))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp


async def handle(server: SimServer, request: web.Request, kind: Kind) -> web.StreamResponse:
    server.active += 1  # requests inside the engine now, whatever stage they are at
    try:
        return await Generation(server, request, kind).run()
    finally:
        server.active -= 1
