"""One simulated engine behind an HTTP endpoint (aiohttp), in either persona."""

from __future__ import annotations

import asyncio
import hashlib
import random
import secrets
import ssl
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from dprouter.core.log_filter import quiet_malformed
from dprouter.core.net import bind, url_of
from dprouter.core.tls import https
from dprouter.sim.http import endpoints
from dprouter.sim.http.audio import Audio
from dprouter.sim.http.auth import is_admin
from dprouter.sim.http.endpoints import Handler
from dprouter.sim.http.kvpublish import KvPublishers
from dprouter.sim.http.lora import Adapters
from dprouter.sim.http.metrics import vllm_registry
from dprouter.sim.http.pd import Me
from dprouter.sim.http.pd_side import PdSide
from dprouter.sim.http.persona import persona_for
from dprouter.sim.http.pooling import Pooling
from dprouter.sim.http.runner import EngineRunner
from dprouter.sim.http.stored import Responses
from dprouter.sim.http.weights import Weights
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.encoder import encoder_for
from dprouter.sim.model.engine import Engine
from dprouter.sim.model.request import SimRequest


@dataclass(frozen=True)
class Received:
    """What a generation request looked like when it reached the engine."""

    path: str
    headers: CIMultiDict[str]  # repeated headers stay repeated
    body: Any
    rank: int | None  # the rank that served it (None: rejected before placement)


# ``--api-key`` guards what the real engines guard: vLLM the API's prefixes (its
# /metrics, /health and /server_info stay open), SGLang every path but its probes'
GUARDED = {"vllm": ("/v1", "/v2", "/inference", "/cohere")}
OPEN = {"sglang": ("/health", "/ready", "/metrics")}


def guarded(persona: str, path: str) -> bool:
    if persona in GUARDED:
        return path.startswith(GUARDED[persona])
    return not path.startswith(OPEN.get(persona, ()))


class SimServer:
    """A simulated engine: the model, its real-time runner and its HTTP face.

    ``crash()`` drops every connection and stops listening, as a killed process
    would; ``start()`` again brings a fresh engine up on the same port.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_id: str = "engine-0",
        host: str = "127.0.0.1",
        port: int = 0,
        max_body: int = 64 << 20,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.config = config
        # as the engines' --api-key: a request without it answers 401 (``refused`` counts);
        # SGLang's --admin-api-key, its admin endpoints' (``auth.admin``) key instead
        self._key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self._admin = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        self.refused: Counter[str] = Counter()  # "GET /v1/loads": refused for want of the key
        self.tls = tls  # HTTPS (a client CA in it: a client certificate required)
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.max_body = max_body
        self.persona = persona_for(config.persona)
        self.received: deque[Received] = deque(maxlen=10_000)
        self.hits: Counter[str] = Counter()  # "GET /metrics": requests per method and path
        self.abort_requests: deque[object] = deque(maxlen=10_000)  # rids sent to /abort_request
        self.served: Counter[tuple[str, int | None]] = Counter()  # (path, rank): non-generation
        self.next_rank = 0  # where the next unpinned non-generation request goes
        self.started = asyncio.Event()
        self.generation_requests = 0
        self.active = 0  # generation requests being handled right now
        self.rng = random.Random(config.faults.seed)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self.engine: Engine
        self.runner: EngineRunner
        self.weights: Weights
        self.adapters: Adapters
        self.pd = PdSide(self, config.pd) if config.pd is not None else None
        self.responses = Responses(self)
        self.audio = Audio(self)  # kept across restarts: what each rank took, in all
        self.encoder = encoder_for(config.tokenizer)  # read once, here: never on a request
        kv = config.kv_events
        # kept across restarts: the ports stay, the sequences start again from 0
        self.kv = KvPublishers(kv, config.persona, config.dp_size, host) if kv.enabled else None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client a decode engine takes KV with."""
        assert self.pd is not None and self.pd.session is not None
        return self.pd.session

    def publish_kv(
        self, key: str, req: SimRequest, meta: dict[str, object]
    ) -> dict[str, Any] | None:
        assert self.pd is not None
        return self.pd.publish(key, req, meta)

    def me(self) -> Me:
        assert self.pd is not None
        return Me(self.config.dp_size, self.config.tp_size, self.pd.registration()["zmq_address"])

    @property
    def url(self) -> str:
        return https(url_of(self.host, self.port), self.tls is not None)

    def _make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body,
            middlewares=[self._count, self._guard, endpoints.not_found],
        )
        if self.persona.name == "vllm":
            self.registry = vllm_registry(self.engine)
        app.add_routes(endpoints.Endpoints(self).routes())
        app.add_routes(self.weights.routes())
        app.add_routes(self.adapters.routes())
        app.add_routes(Pooling(self).routes())
        app.add_routes(self.audio.routes())
        app.add_routes(self.responses.routes())
        if self.pd is not None:
            app.add_routes(self.pd.routes())
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.hits[f"{request.method} {request.path}"] += 1
        return await handler(request)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The engines' ``--api-key``: ``Authorization: Bearer KEY`` or 401, as they answer
        it (compared by digest, in constant time, as vLLM does). SGLang's admin endpoints
        take its --admin-api-key alone where it has one, as its ``decide_request_auth``."""
        if request.method == "OPTIONS" or not guarded(self.persona.name, request.path):
            return await handler(request)
        wanted = self._key
        sglang_admin = self.persona.name == "sglang" and is_admin(request.match_info.handler)
        if self._admin is not None and sglang_admin:
            wanted = self._admin
        if wanted is None:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(given.encode()).digest()
        if scheme.lower() == "bearer" and secrets.compare_digest(digest, wanted):
            return await handler(request)
        self.refused[f"{request.method} {request.path}"] += 1
        return web.json_response({"error": "Unauthorized"}, status=401)

    async def start(self) -> None:
        quiet_malformed()  # peers probe with HTTP/2 prior knowledge: one line, not a trace
        self.engine = Engine(self.config, self.engine_id, record_events=self.kv is not None)
        self.responses = Responses(self)  # a restarted engine has forgotten them all
        if self.kv is not None:
            await self.kv.start()
        self.runner = EngineRunner(self.engine, self.kv.flush if self.kv is not None else None)
        self.runner.start()
        self.weights = Weights(self)  # a restarted engine runs, with the weights it loads
        self.adapters = Adapters(self)  # ... and the adapters it starts with
        self.generation_requests = 0
        self.started_at = asyncio.get_running_loop().time()
        if self.pd is not None:
            await self.pd.start()
        self._runner = web.AppRunner(
            self._make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock, ssl_context=self.tls)
        await self._site.start()
        self.started.set()

    def reset_prefix_cache(self) -> None:
        """Every rank forgets its cache; the AllBlocksCleared events go out at once."""
        self.engine.reset_prefix_cache()
        if self.kv is not None:
            self.kv.flush(self.engine.ranks)

    async def stop(self) -> None:
        await self.runner.stop()  # in-flight requests end with an error, not a hang
        if self.kv is not None:
            await self.kv.stop()
        if self.pd is not None:
            await self.pd.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._site = None
        self.started.clear()

    async def crash(self) -> None:
        """Die like a killed process: reset every connection, stop listening, lose all state."""
        if self._runner is None:
            return
        server = self._runner.server
        if self._site is not None:
            await self._site.stop()
        if server is not None:
            for handler in server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        await self.runner.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.pd is not None:
            await self.pd.stop()
        await self._runner.cleanup()
        self._runner = self._site = None
        self.started.clear()

    def record(self, request: web.Request, body: Any, rank: int | None) -> None:
        self.received.append(Received(request.path, CIMultiDict(request.headers), body, rank))

    def now_wall(self) -> float:
        return asyncio.get_running_loop().time() - self.started_at
