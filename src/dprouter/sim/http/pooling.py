"""Pooling and tokenizer endpoints of a simulated engine, in its persona's shapes.

Vectors and scores are functions of the text alone (CRC-32), so a test can tell that
an answer belongs to its input; a batch (a list of inputs) is one request.
"""

from __future__ import annotations

import re
import time
import uuid
import zlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from dprouter.sim.http.served import Refused, body_of, dumps, fail, place
from dprouter.sim.model.tokens import tokenize

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

DIM = 8  # embedding width
PIECE = re.compile(r"\w+|[^\w\s]")  # one token each, as in sim/tokens.py


def vector(text: str) -> list[float]:
    return [(zlib.crc32(text.encode(), i) % 2000) / 1000 - 1 for i in range(DIM)]


def relevance(query: str, text: str) -> float:
    return (zlib.crc32(f"{query}\x00{text}".encode()) % 1000) / 1000


def texts(body: dict[str, Any], *names: str) -> list[str]:
    for name in names:
        value = body.get(name)
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return list(value)
    raise ValueError(f"{' or '.join(names)} must be a string or a list of strings")


class Pooling:
    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.words: dict[int, str] = {}  # token id -> token, for /detokenize

    def routes(self) -> list[web.RouteDef]:
        v = self.server.persona.name == "vllm"
        common = [
            web.post("/v1/embeddings", self.embeddings),
            web.post("/v1/rerank", self.rerank),
            web.post("/v1/score", self.score),
            web.post("/classify", self.classify),
        ]
        if v:
            return [
                *common,
                web.post("/score", self.score),
                web.post("/rerank", self.rerank),
                web.post("/v2/rerank", self.rerank),
                web.post("/pooling", self.pooling),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
            ]
        return [
            *common,
            web.post("/encode", self.encode),
            web.post("/v1/tokenize", self.tokenize),
            web.post("/v1/detokenize", self.detokenize),
        ]

    async def _answer(
        self, request: web.Request, build: Any, *names: str, native: bool = False
    ) -> web.Response:
        server = self.server
        try:
            body = await body_of(server, request)
            try:
                inputs = texts(body, *names)
            except ValueError as exc:
                raise fail(server, 400, str(exc)) from None
            rank = await place(server, request, body, "generate" if native else "completion")
        except Refused as refused:
            refused.response.headers["x-sim-engine"] = server.engine_id
            return refused.response
        answer = build(body, inputs)
        headers = {"x-sim-engine": server.engine_id, "x-sim-dp-rank": str(rank)}
        return web.json_response(answer, headers=headers, dumps=dumps)

    def _head(self, body: dict[str, Any], prefix: str) -> dict[str, Any]:
        return {
            "id": prefix + uuid.uuid4().hex,
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or self.server.config.model,
        }

    def _usage(self, inputs: list[str]) -> dict[str, Any]:
        n = sum(len(self.server.encoder.encode(t)) for t in inputs)
        return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}

    async def embeddings(self, request: web.Request) -> web.Response:
        def build(body: dict[str, Any], inputs: list[str]) -> dict[str, Any]:
            data = [
                {"object": "embedding", "embedding": vector(t), "index": i}
                for i, t in enumerate(inputs)
            ]
            return {**self._head(body, "embd-"), "data": data, "usage": self._usage(inputs)}

        return await self._answer(request, build, "input")

    async def pooling(self, request: web.Request) -> web.Response:
        def build(body: dict[str, Any], inputs: list[str]) -> dict[str, Any]:
            data = [
                {"index": i, "object": "pooling", "data": vector(t)} for i, t in enumerate(inputs)
            ]
            return {**self._head(body, "pool-"), "data": data, "usage": self._usage(inputs)}

        return await self._answer(request, build, "input")

    async def classify(self, request: web.Request) -> web.Response:
        def build(body: dict[str, Any], inputs: list[str]) -> dict[str, Any]:
            data = []
            for i, t in enumerate(inputs):
                p = relevance("", t)
                label = "LABEL_1" if p >= 0.5 else "LABEL_0"
                data.append({"index": i, "label": label, "probs": [1 - p, p], "num_classes": 2})
            return {**self._head(body, "classify-"), "data": data, "usage": self._usage(inputs)}

        return await self._answer(request, build, "input", "text")

    async def encode(self, request: web.Request) -> web.Response:
        """SGLang's native embedding endpoint: one object per input, with meta_info."""

        def build(body: dict[str, Any], inputs: list[str]) -> Any:
            out = [
                {
                    "embedding": vector(t),
                    "meta_info": {
                        "id": uuid.uuid4().hex,
                        "prompt_tokens": len(self.server.encoder.encode(t)),
                    },
                }
                for t in inputs
            ]
            return out if isinstance(body.get("text"), list) else out[0]

        return await self._answer(request, build, "text", native=True)

    async def score(self, request: web.Request) -> web.Response:
        def build(body: dict[str, Any], inputs: list[str]) -> dict[str, Any]:
            query = str(body.get("text_1") or body.get("query") or "")
            scores = [relevance(query, t) for t in inputs]
            if self.server.persona.name == "sglang":  # SGLang: a list of scores per item
                return {"scores": scores, "model": body.get("model"), "object": "scoring"}
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            return {**self._head(body, "score-"), "data": data, "usage": self._usage(inputs)}

        return await self._answer(request, build, "text_2", "items")

    async def rerank(self, request: web.Request) -> web.Response:
        def build(body: dict[str, Any], inputs: list[str]) -> Any:
            query = str(body.get("query") or "")
            ranked = sorted(
                ((i, t, relevance(query, t)) for i, t in enumerate(inputs)), key=lambda r: -r[2]
            )
            if self.server.persona.name == "sglang":  # SGLang: a bare list
                return [{"score": s, "document": t, "index": i} for i, t, s in ranked]
            results = [
                {"index": i, "document": {"text": t}, "relevance_score": s} for i, t, s in ranked
            ]
            head = self._head(body, "rerank-")
            del head["object"], head["created"]
            return {
                **head,
                "usage": {"total_tokens": self._usage(inputs)["total_tokens"]},
                "results": results,
            }

        return await self._answer(request, build, "documents")

    async def tokenize(self, request: web.Request) -> web.Response:
        """No rank: the tokenizer lives in the API server, before any engine core."""
        server = self.server
        try:
            body = await body_of(server, request)
        except Refused as refused:
            return refused.response
        prompt = body.get("prompt")
        messages = body.get("messages")
        if isinstance(messages, list):
            prompt = "\n".join(str(m.get("content", "")) for m in messages)
        if not isinstance(prompt, str):
            return fail(server, 400, "prompt must be a string").response
        server.record(request, body, None)
        server.served[(request.path, None)] += 1
        encoder = server.encoder
        if encoder.real:  # tokenizer files: the ids the engine computes
            turns = [
                (str(m.get("role", "user")), str(m.get("content", ""))) for m in messages or ()
            ]
            ids = (
                encoder.encode_chat(turns) if isinstance(messages, list) else encoder.encode(prompt)
            )
        else:
            ids = tokenize(prompt)
            for piece in PIECE.findall(prompt):  # remembered, so /detokenize can answer
                self.words[tokenize(piece)[0]] = piece
        answer = {
            "count": len(ids),
            "max_model_len": server.config.limits.max_model_len,
            "tokens": ids,
        }
        return web.json_response(answer, headers={"x-sim-engine": server.engine_id}, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        server = self.server
        try:
            body = await body_of(server, request)
        except Refused as refused:
            return refused.response
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return fail(server, 400, "tokens must be a list of integers").response
        server.record(request, body, None)
        server.served[(request.path, None)] += 1
        text = server.encoder.decode(tokens)
        if text is None:
            text = " ".join(self.words.get(t, f"<{t}>") for t in tokens)
        key = "prompt" if server.persona.name == "vllm" else "text"
        answer = {key: text}
        return web.json_response(answer, headers={"x-sim-engine": server.engine_id}, dumps=dumps)
