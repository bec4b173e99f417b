"""What a P/D engine runs beside its HTTP face: the KV store and take endpoint
(prefill), a client to take KV with (decode), SGLang's and Mooncake's bootstrap
listeners and MoRIIO's registration heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from dprouter.core.net import bind
from dprouter.sim.http.kvstore import KvStore
from dprouter.sim.http.pd import Located, mooncake_query, prefill_answer
from dprouter.sim.model.config import PdConfig
from dprouter.sim.model.request import SimRequest
from dprouter.sim.model.tokens import prompt_digest

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

log = logging.getLogger("dprouter.sim")


class PdSide:
    def __init__(self, server: SimServer, pd: PdConfig) -> None:
        self.server = server
        self.pd = pd
        self.store = KvStore(server.engine_id, server.config.dp_size)
        self.session: aiohttp.ClientSession | None = None
        self.bootstrap_port: int | None = None
        self.queries = 0  # Mooncake: GET /query answered
        self.located: Located = {}  # Mooncake decode: the engines its prefills listed
        self._bootstrap: web.AppRunner | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/sim/kv/take", self.take)] if self.pd.role == "prefill" else []

    async def start(self) -> None:
        self.store = KvStore(self.server.engine_id, self.server.config.dp_size)  # a fresh process
        self.located = {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        if self.pd.mode in ("sglang", "vllm-mooncake") and self.pd.role == "prefill":
            app = web.Application()
            app.add_routes(self.routes())
            if self.pd.mode == "vllm-mooncake":
                app.add_routes([web.get("/query", self.query)])
            self._bootstrap = web.AppRunner(app, access_log=None)
            await self._bootstrap.setup()
            sock = bind(self.server.host, self.bootstrap_port or self.pd.bootstrap_port)
            self.bootstrap_port = sock.getsockname()[1]
            await web.SockSite(self._bootstrap, sock).start()
        if self.pd.mode == "vllm-moriio" and self.pd.registration:
            self._heartbeat = asyncio.create_task(self._register(), name="moriio-heartbeat")

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._bootstrap is not None:
            await self._bootstrap.cleanup()
            self._bootstrap = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def publish(self, key: str, req: SimRequest, meta: dict[str, object]) -> dict[str, Any] | None:
        """A prefill finished: keep its KV; returns the vLLM connector's params."""
        assert req.rank is not None
        self.store.publish(key, req.rank, prompt_digest(req.prompt_ids), req.prompt_len, meta)
        c = self.server.config
        return prefill_answer(
            self.pd,
            self.store,
            key,
            req.rank,
            self.server.host,
            self.server.port,
            req.prompt_len,
            c.tp_size,
        )

    async def query(self, request: web.Request) -> web.Response:
        """Mooncake's bootstrap server: this engine's ranks and where to pull from."""
        self.queries += 1
        return web.json_response(mooncake_query(self.store, self.server.host, self.server.port))

    async def take(self, request: web.Request) -> web.Response:
        try:
            ask = await request.json()
            rank = ask.get("rank")
            if rank is None and self.pd.mode == "sglang":
                rank = int(ask["key"]) % self.store.dp_size  # SGLang's own rule for a room
            claims = ask.get("claims") or {}
            if not isinstance(claims, dict):
                raise TypeError("claims must be a map")
            wait = min(float(ask.get("wait", 0)), 60.0)
            status, message, tokens = await self.store.take(
                str(ask["key"]), rank, ask.get("engine"), int(ask["digest"]), wait, claims
            )
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad take request: {exc}"}, status=400)
        if status != 200:
            return web.json_response({"error": message}, status=status)
        return web.json_response({"prompt_tokens": tokens})

    def registration(self) -> dict[str, Any]:
        host, port = self.server.host, self.server.port
        c = self.server.config
        return {
            "type": "P" if self.pd.role == "prefill" else "D",
            "http_address": f"{host}:{port}",
            # the simulated transfer runs over HTTP, so the handshake port is the HTTP port
            "zmq_address": f"host:{host},handshake:{port},notify:{port}",
            "dp_size": c.dp_size,
            "tp_size": c.tp_size,
            "transfer_mode": self.pd.transfer_mode,
        }

    async def _register(self) -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(str(self.pd.registration))
        try:
            while True:
                await sock.send(msgpack.packb(self.registration()))
                await asyncio.sleep(self.pd.heartbeat)
        finally:
            sock.close(0)
            ctx.term()
