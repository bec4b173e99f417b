"""Every engine endpoint the router serves besides completions, chat and ``/generate``:
which engines serve it, and how the router routes it. One table; the routes, the
OpenAPI description and docs/router.md follow it. A path not in it is the router's
own 404 and never reaches an engine (``/sleep``, weight updates, profiling...).

Routings:

- ``policy``: by the policy over the model's targets, like completions (rank written);
- ``any``: any ready worker serving the model, least busy first (no rank, no count);
- ``stored``: the target that made the response named in the path or body;
- ``each``: every ready worker, answered as one table (``admin``: behind the token).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from typing import TYPE_CHECKING, Literal

from aiohttp import web

from dprouter.admin import denied
from dprouter.guard import guarded
from dprouter.kept import Kept
from dprouter.parse import Kind
from dprouter.proxy import Proxy, no_pool
from dprouter.relay import error
from dprouter.stored import SharedKept, Stored
from dprouter.targets import DialectName, Worker
from dprouter.unranked import Unranked

if TYPE_CHECKING:
    from dprouter.app import Parts

Routing = Literal["policy", "any", "stored", "each", "admin"]
BOTH: tuple[DialectName, ...] = ("vllm", "sglang")
VLLM: tuple[DialectName, ...] = ("vllm",)
SGLANG: tuple[DialectName, ...] = ("sglang",)


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    engines: tuple[DialectName, ...]
    routing: Routing
    kind: Kind | None  # how the body is read; None: no body
    summary: str

    @property
    def dialect(self) -> DialectName | None:
        """The one dialect whose workers serve it (None: either)."""
        return self.engines[0] if len(self.engines) == 1 else None


def _pooling(path: str, engines: tuple[DialectName, ...], summary: str) -> Endpoint:
    return Endpoint("POST", path, engines, "policy", "pooling", summary)


ENDPOINTS: tuple[Endpoint, ...] = (
    _pooling("/v1/embeddings", BOTH, "Embeddings"),
    _pooling("/v1/score", BOTH, "Scores of text pairs"),
    _pooling("/score", VLLM, "Scores of text pairs (vLLM)"),
    _pooling("/v1/rerank", BOTH, "Rerank documents against a query"),
    _pooling("/rerank", VLLM, "Rerank (vLLM)"),
    _pooling("/v2/rerank", VLLM, "Rerank, Cohere v2 shape (vLLM)"),
    _pooling("/pooling", VLLM, "Pooled hidden states (vLLM)"),
    _pooling("/classify", BOTH, "Classification"),
    _pooling("/encode", SGLANG, "Embeddings, SGLang's native shape"),
    Endpoint("POST", "/v1/audio/transcriptions", BOTH, "policy", "audio", "Transcribe audio"),
    Endpoint("POST", "/v1/audio/translations", VLLM, "policy", "audio", "Translate audio (vLLM)"),
    Endpoint("POST", "/tokenize", VLLM, "any", "tokenizer", "Tokenize (vLLM)"),
    Endpoint("POST", "/detokenize", VLLM, "any", "tokenizer", "Detokenize (vLLM)"),
    Endpoint("POST", "/v1/tokenize", SGLANG, "any", "tokenizer", "Tokenize (SGLang)"),
    Endpoint("POST", "/v1/detokenize", SGLANG, "any", "tokenizer", "Detokenize (SGLang)"),
    Endpoint("POST", "/v1/responses", BOTH, "stored", "responses", "Create a response"),
    Endpoint("GET", "/v1/responses/{id}", BOTH, "stored", None, "A stored response"),
    Endpoint("POST", "/v1/responses/{id}/cancel", BOTH, "stored", None, "Cancel a response"),
    Endpoint("GET", "/health_generate", SGLANG, "any", None, "One worker generates a token"),
    Endpoint("GET", "/server_info", SGLANG, "any", None, "One worker's server info"),
    Endpoint("GET", "/get_server_info", SGLANG, "any", None, "One worker's server info"),
    Endpoint("GET", "/model_info", SGLANG, "any", None, "One worker's model info"),
    Endpoint("GET", "/get_model_info", SGLANG, "any", None, "One worker's model info"),
    Endpoint("GET", "/get_load", SGLANG, "each", None, "Each worker's load"),
    Endpoint("POST", "/reset_prefix_cache", VLLM, "admin", None, "Reset each prefix cache"),
    Endpoint("POST", "/flush_cache", SGLANG, "admin", None, "Flush each radix cache"),
)


class Surface:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        # response ids: this process's, and the control plane's under --processes N
        self.kept = Kept() if parts.control is None else SharedKept(parts.control)
        self._unranked: Unranked | None = None
        self._stored: Stored | None = None

    def routes(self) -> list[web.RouteDef]:
        handlers = {
            "policy": self.by_policy,
            "any": self.anyone,
            "stored": self.stored,
            "each": self.each,
            "admin": self.each,
        }
        routes = [web.route(e.method, e.path, partial(handlers[e.routing], e)) for e in ENDPOINTS]
        return [*routes, web.get("/version", self.version)]

    def _proxy(self) -> Proxy | web.Response:
        proxy = self.parts.proxy
        if not isinstance(proxy, Proxy):  # a P/D router pairs generation only
            return error(404, "a P/D router serves completions, chat and /generate only")
        return proxy

    @property
    def unranked(self) -> Unranked:
        if self._unranked is None:
            proxy = self.parts.proxy
            assert proxy is not None
            p = self.parts
            self._unranked = Unranked(p.config, p.registry, p.metrics, proxy.rules)
        return self._unranked

    async def by_policy(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        proxy = self._proxy()
        if isinstance(proxy, web.Response):
            return proxy
        assert endpoint.kind is not None
        call = partial(proxy.handle, request, endpoint.kind, endpoint.dialect)
        return await guarded(self.parts, request, call)

    async def anyone(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        call = partial(self.unranked.anyone, request, endpoint.kind, endpoint.dialect)
        return await guarded(self.parts, request, call)

    async def stored(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        proxy = self._proxy()
        if isinstance(proxy, web.Response):
            return proxy
        if self._stored is None:
            p = self.parts
            self._stored = Stored(p.config, p.registry, p.metrics, proxy, self.unranked, self.kept)
        flow = self._stored.create if endpoint.kind is not None else self._stored.follow
        return await guarded(self.parts, request, partial(flow, request))

    async def each(self, endpoint: Endpoint, request: web.Request) -> web.Response:
        if endpoint.routing == "admin" and (refused := self.denied(request)) is not None:
            return refused
        workers: list[Worker] | None = None
        named = request.query.get("worker")
        if named is not None:
            worker = self.parts.registry.workers.get(named)
            if worker is None:
                return error(404, f"no worker {named!r}", "worker")
            workers = [worker]

        def path(w: Worker) -> str | None:
            return endpoint.path if w.dialect in endpoint.engines else None

        rows = await self.unranked.fan(request, path, endpoint.method, workers)
        if not rows:
            return no_pool(self.parts.registry, self.parts.metrics, endpoint.dialect, endpoint.path)
        ok = all(r["status"] is not None and r["status"] < 300 for r in rows)
        return web.json_response({"workers": rows}, status=200 if ok else 502)

    async def version(self, request: web.Request) -> web.Response:
        """The router's version, and each ready worker's (SGLang tells it in server_info)."""

        def path(w: Worker) -> str:
            return "/server_info" if w.dialect == "sglang" else "/version"

        rows = await self.unranked.fan(request, path)
        for row in rows:
            body = row.pop("body", None)
            row["version"] = body.get("version") if isinstance(body, dict) else None
        return web.json_response({"version": version("dprouter"), "workers": rows})

    def denied(self, request: web.Request) -> web.Response | None:
        return denied(self.parts.config.admin_token, request)
