"""Routes of a simulated engine other than generation itself."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dprouter.sim.config import EngineConfig
from dprouter.sim.generation import handle
from dprouter.sim.rank import Rank

if TYPE_CHECKING:
    from dprouter.sim.server import SimServer

VERSION = "0.1.0-sim"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and methods answer as FastAPI does in both real engines."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def common_routes(server: SimServer) -> list[web.RouteDef]:
    async def health(_: web.Request) -> web.Response:
        after = server.config.faults.health_fail_after
        if after is not None and server.now_wall() >= after:
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        card = {
            "id": server.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": server.persona.name,
            "root": server.config.model,
            "parent": None,
            "max_model_len": server.config.limits.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle(server, request, "completion")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await handle(server, request, "chat")

    return [
        web.get("/health", health),
        web.get("/v1/models", models),
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat),
    ]


def vllm_routes(server: SimServer) -> list[web.RouteDef]:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(server.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ping(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    return [web.get("/metrics", metrics), web.get("/ping", ping), web.get("/version", version)]


def _pending_tokens(rank: Rank) -> int:
    return sum(r.prompt_len for r in rank.waiting)


def _load(rank: Rank) -> dict[str, Any]:
    """One rank's entry of SGLang 0.5.23's ``/v1/loads`` (its core fields that the
    model knows; a waiting prompt counts as uncached until it is scheduled)."""
    stats = rank.stats
    queries = stats.prefix_queries
    pending = _pending_tokens(rank)
    return {
        "timestamp": time.time(),
        "dp_rank": rank.index,
        "num_running_reqs": rank.num_running,
        "num_waiting_reqs": rank.num_waiting,
        "num_waiting_uncached_tokens": pending,
        "num_used_tokens": rank.kv_used,
        "num_total_tokens": rank.kv_used + pending,
        "max_total_num_tokens": rank.limits.kv_tokens,
        "max_running_requests": rank.limits.max_running,
        "token_usage": rank.kv_usage,
        "cache_hit_rate": stats.prefix_hits / queries if queries else 0.0,
    }


def server_args(config: EngineConfig, bootstrap_port: int | None) -> dict[str, Any]:
    """What ``/server_info`` says of the engine's shape, in the SGLang version imitated.

    SGLang 0.5.23 counts attention-DP ranks in ``attn_dp_size`` and reports ``dp_size: 1``
    for them (``enable_dp_attention`` kept for old clients); older SGLang counted them in
    ``dp_size`` with ``enable_dp_attention`` and had no ``attn_dp_size``.
    """
    c = config
    if c.legacy_sglang:
        shape: dict[str, Any] = {"dp_size": c.dp_size, "enable_dp_attention": c.dp_attention}
    elif c.dp_attention:
        shape = {"dp_size": 1, "attn_dp_size": c.dp_size, "enable_dp_attention": c.dp_size > 1}
    else:
        shape = {"dp_size": c.dp_size, "attn_dp_size": 1, "enable_dp_attention": False}
    # model_path and tokenizer_path are left out on purpose: peers that see them
    # try to download a tokenizer from a model hub
    return {
        "served_model_name": c.model,
        "tp_size": c.tp_size,
        **shape,
        "load_balance_method": c.dispatch_mode,
        "disaggregation_mode": c.pd.role if c.pd else "null",
        "disaggregation_bootstrap_port": bootstrap_port,
        "page_size": c.limits.block_size,
        "max_running_requests": c.limits.max_running,
        "chunked_prefill_size": c.cost.max_batched_tokens,
    }


def sglang_routes(server: SimServer) -> list[web.RouteDef]:
    def info() -> dict[str, Any]:
        c = server.config
        args = server_args(c, server.pd.bootstrap_port if server.pd else None)
        states = [
            {
                **args,
                "dp_rank": r.index,
                "last_gen_throughput": 0.0,
                "memory_usage": {"token_capacity": r.limits.kv_tokens},
                "effective_max_running_requests_per_dp": r.limits.max_running,
            }
            for r in server.engine.ranks
        ]
        return {
            **args,
            "status": "ready",
            "max_total_num_tokens": c.limits.kv_tokens,
            "max_req_input_len": c.limits.max_model_len - 1,
            "internal_states": states,
            "version": VERSION,
        }

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(info())

    async def loads(request: web.Request) -> web.Response:
        ranks = server.engine.ranks
        wanted = request.query.get("dp_rank")
        if wanted is not None:
            if not wanted.lstrip("-").isdigit():
                detail = [{"type": "int_parsing", "loc": ["query", "dp_rank"], "input": wanted}]
                return web.json_response({"detail": detail}, status=422)  # FastAPI's answer
            ranks = [r for r in ranks if r.index == int(wanted)]
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": VERSION,
                "accelerator": None,
                "num_accelerators": server.config.tp_size,
                "loads": [_load(r) for r in ranks],
            }
        )

    async def get_load(_: web.Request) -> web.Response:
        out = [
            {
                "dp_rank": r.index,
                "num_reqs": r.num_running + r.num_waiting,
                "num_waiting_reqs": r.num_waiting,
                "num_tokens": r.kv_used + _pending_tokens(r),
                "num_pending_tokens": _pending_tokens(r),
                "ts_tic": time.perf_counter(),
            }
            for r in server.engine.ranks
        ]
        return web.json_response(out)

    async def generate(request: web.Request) -> web.StreamResponse:
        return await handle(server, request, "generate")

    async def health_generate(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def abort_request(request: web.Request) -> web.Response:
        try:
            rid = (await request.json()).get("rid")
        except (ValueError, AttributeError):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        server.abort_requests.append(rid)
        if isinstance(rid, str):
            server.runner.abort_rid(rid)
        return web.Response(status=200)  # as SGLang: known or not

    return [
        web.get("/server_info", server_info),
        web.get("/get_server_info", server_info),
        web.get("/v1/loads", loads),
        web.post("/generate", generate),
        web.get("/health_generate", health_generate),
        web.post("/abort_request", abort_request),
        # SGLang 0.5.23 answers /get_load with 404
        *([web.get("/get_load", get_load)] if server.config.legacy_sglang else []),
    ]
