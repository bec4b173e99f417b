"""The generation endpoints of a simulated engine: parse, place, stream or answer."""

from __future__ import annotations

import asyncio
import uuid
import zlib
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
        self.answered_as = server.config.model  # the model its answer names

    def fail(
        self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None
    ) -> web.Response:
        body = self.server.persona.error_body(status, message, etype, param, self.kind)
        return web.json_response(body, status=status, headers=self.headers, dumps=_dumps)

    async def stream_fail(
        self, message: str, said: dict[str, Any] | None = None
    ) -> web.StreamResponse:
        """Engines that already chose to stream report errors inside a 200 SSE body (``said``:
        the error's fields besides its message, where the engine words it otherwise)."""
        resp = web.StreamResponse(headers={**self.headers, "Content-Type": "text/event-stream"})
        await resp.prepare(self.request)
        error = {"message": message, **(said or {"type": "BadRequestError", "param": None})}
        error.setdefault("code", 400)
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
        adapters = server.adapters
        message = server.persona.model_error(parsed.model, server.config.model, adapters.loaded)
        if message is not None:
            adapters.missed()
            return self.fail(404, message, "NotFoundError", "model")
        lora = server.persona.adapter(body, server.config.model, adapters.loaded)
        try:
            adapter = None if lora is None else adapters.resolve(lora)
        except ValueError as exc:  # SGLang: the tokenizer manager's ValueError
            if parsed.stream and self.kind == "generate":  # /generate had begun its stream
                said = {"type": "invalid_request_error", "code": 400, "retryable": False}
                return await self.stream_fail(str(exc), said)
            # the OpenAI endpoints start a stream only past it; a whole answer's is "BadRequest"
            return self.fail(400, str(exc), "BadRequestError" if parsed.stream else "BadRequest")
        self.answered_as = server.persona.answer_model(body, server.config.model, lora)
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
        if parsed.n > 1 and server.config.pd is not None:
            return self.fail(400, "the simulated engine samples n > 1 on regular engines only")
        failed = await self.pd_step(body, parsed, rid, rank)
        if failed is not None:
            server.record(self.request, body, None)
            return failed
        await server.weights.admitted()  # a paused engine holds new requests
        max_tokens = 1 if self.prefill_key is not None else parsed.max_tokens  # prefill: one

        def sample(own: str, tokens: int = max_tokens) -> SimRequest:
            bootstrap = room if isinstance(room, int) else None
            return SimRequest(
                own,
                parsed.prompt_ids,
                tokens,
                server.runner.now(),
                rank,
                bootstrap,
                remote_kv=self.remote_kv,
                lora=adapter,
            )

        if parsed.n > 1 and server.persona.name == "sglang":
            # SGLang (tokenizer_manager, parallel sampling) first runs a copy that only
            # computes the prompt, then the n samples, which find it cached
            copy = sample(f"{rid}-prompt", 1)
            try:
                progress = server.runner.submit(copy)
            except DispatchError as exc:
                server.record(self.request, body, None)
                return self.fail(400, str(exc))
            try:
                failed = await self.ended([progress])
                if failed is not None:
                    return failed
            finally:
                if not copy.done:
                    server.runner.abort(copy)
        reqs: list[SimRequest] = []
        queues: list[asyncio.Queue[tuple[int, bool]]] = []
        try:
            for k in range(parsed.n):  # the first keeps the request's id, which an abort names
                req = sample(rid if k == 0 else f"{rid}-{k}")
                queues.append(server.runner.submit(req))
                reqs.append(req)
        except DispatchError as exc:
            for req in reqs:
                server.runner.abort(req)
            server.record(self.request, body, None)
            return await self.stream_fail(str(exc)) if parsed.stream else self.fail(400, str(exc))
        server.record(self.request, body, reqs[0].rank)
        self.headers["x-sim-dp-rank"] = str(reqs[0].rank)
        try:
            if parsed.stream:
                return await self.stream(reqs, parsed, queues)
            return await self.whole(reqs, parsed, queues)
        finally:
            for req in reqs:
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

    async def ended(self, queues: list[asyncio.Queue[tuple[int, bool]]]) -> web.Response | None:
        """Wait for every sequence to end; the error answer if one was aborted or the
        engine stopped."""
        for queue in queues:
            done = False
            while not done:
                generated, done = await queue.get()
                if generated == ABORTED:
                    return self.fail(499, "request aborted", "AbortedError")
                if generated < 0:
                    return self.fail(503, "engine shut down", "ServiceUnavailableError")
        return None

    async def whole(
        self, reqs: list[SimRequest], parsed: Parsed, queues: list[asyncio.Queue[tuple[int, bool]]]
    ) -> web.StreamResponse:
        failed = await self.ended(queues)
        if failed is not None:
            return failed
        digests = _digests(reqs)
        texts = [_text(d, 0, req.generated) for d, req in zip(digests, reqs, strict=True)]
        first = reqs[0]
        if self.kind == "generate":
            answers: list[dict[str, Any]] = []
            for req, text in zip(reqs, texts, strict=True):
                meta = generate_meta(
                    req.rid,
                    req.prompt_len,
                    req.generated,
                    req.cached_tokens,
                    True,
                    self.server.runner.now() - req.arrival,
                )
                meta["weight_version"] = self.server.weights.version
                answer = {
                    "text": text,
                    "output_ids": self.server.encoder.encode(text, special=False),
                    "meta_info": meta,
                }
                answers.append(answer)
            # SGLang answers n > 1 samples with a list, one object each
            body: Any = answers[0] if len(answers) == 1 else answers
        else:
            use = usage(first.prompt_len, _generated(reqs), _cached(reqs))
            body = Render(self.kind, first.rid, self.answered_as, False).full(texts, use)
            if self.server.persona.name == "sglang":  # 0.5.23's whole OpenAI answers say it
                body["metadata"] = {"weight_version": self.server.weights.version}
        if self.prefill_key is not None:
            params = self.server.publish_kv(self.prefill_key, first, self.prefill_meta)
            if params is not None:
                body["kv_transfer_params"] = params
        return web.json_response(body, headers=self.headers, dumps=_dumps)

    async def stream(
        self, reqs: list[SimRequest], parsed: Parsed, queues: list[asyncio.Queue[tuple[int, bool]]]
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
        first, n = reqs[0], len(reqs)
        render = Render(self.kind, first.rid, self.answered_as, parsed.include_usage)
        merged: asyncio.Queue[tuple[int, int, bool]] = asyncio.Queue()

        async def follow(k: int, queue: asyncio.Queue[tuple[int, bool]]) -> None:
            done = False
            while not done:
                generated, done = await queue.get()
                await merged.put((k, generated, done))
                done = done or generated < 0

        followers = [asyncio.create_task(follow(k, q)) for k, q in enumerate(queues)]
        digests = _digests(reqs)
        texts = [""] * n
        sent = [0] * n
        try:
            for k in range(n):
                await resp.write(render.opening(k))
            open_ = n
            while open_:
                k, generated, done = await merged.get()
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
                req = reqs[k]
                piece = _text(digests[k], sent[k], generated)
                sent[k] = generated
                if done:
                    open_ -= 1
                if self.kind == "generate":
                    texts[k] += piece
                    meta = generate_meta(
                        req.rid,
                        req.prompt_len,
                        generated,
                        req.cached_tokens,
                        done,
                        self.server.runner.now() - req.arrival,
                    )
                    meta["weight_version"] = self.server.weights.version
                    chunk: dict[str, Any] = {"text": texts[k], "meta_info": meta}
                    if n > 1:
                        chunk["index"] = k  # SGLang numbers each sample's chunks
                    await resp.write(sse(chunk))
                else:
                    await resp.write(render.piece(piece, done, k))
            if self.prefill_key is not None:
                self.server.publish_kv(self.prefill_key, first, self.prefill_meta)
            if self.kind == "generate":
                await resp.write(DONE)
            else:
                use = usage(first.prompt_len, sum(sent), _cached(reqs))
                await resp.write(render.closing(use))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        finally:
            for task in followers:
                task.cancel()
        return resp


def _digests(reqs: list[SimRequest]) -> list[int]:
    """What each sample's words are drawn from: the same prompt gives the same first
    sample, and each other sample words of its own."""
    digest = prompt_digest(reqs[0].prompt_ids)
    return [digest] + [zlib.crc32(k.to_bytes(4, "little"), digest) for k in range(1, len(reqs))]


def _text(digest: int, start: int, end: int) -> str:
    """Output tokens ``start`` to ``end`` of the sample drawn from ``digest``."""
    return "".join(output_token(digest, i) for i in range(start, end))


def _generated(reqs: list[SimRequest]) -> int:
    return sum(req.generated for req in reqs)


def _cached(reqs: list[SimRequest]) -> int:
    """The prompt is counted once: its cached part, as the sample that found most of it."""
    return max(req.cached_tokens for req in reqs)


async def handle(server: SimServer, request: web.Request, kind: Kind) -> web.StreamResponse:
    server.active += 1  # requests inside the engine now, whatever stage they are at
    try:
        return await Generation(server, request, kind).run()
    finally:
        server.active -= 1
