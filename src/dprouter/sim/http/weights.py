"""What an RL framework asks of an engine around a weight update, as each real engine
answers it: pause (requests held, retracted or aborted by mode), flush, weight updates
that move the version, continue, aborts, memory release and resume.

SGLang 0.5.23's paths and shapes (``sglang/srt/entrypoints/http_server.py``); vLLM
0.32's RL routes (``vllm/entrypoints/rl/online/api_router.py``, served by the real
engine only with ``VLLM_SERVER_DEV_MODE=1``). While paused, new requests wait inside
the engine until it continues, as both engines hold them; ``hits`` counts every call.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from dprouter.sim.http.auth import admin

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

SGLANG_MODES = ("abort", "retract", "in_place")
VLLM_MODES = ("abort", "keep", "wait")


class Weights:
    """One engine's pause state and weights' version (SGLang's default is ``default``)."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.paused: str | None = None  # the pause mode, while paused
        self.version = "default"
        self.asleep = False
        self.updates = 0  # weight updates taken
        self.update_time = 0.0  # seconds each takes (a test makes it slow)
        self.retracted = 0  # requests a retract pause sent back to the queue
        self._running = asyncio.Event()
        self._running.set()

    async def admitted(self) -> None:
        """A new request waits here while the engine is paused."""
        await self._running.wait()

    def pause(self, mode: str) -> None:
        runner = self.server.runner
        if mode == "abort":
            runner.abort_all()
        elif mode in ("retract", "keep"):
            self.retracted += runner.live()
        self.paused = mode
        self._running.clear()
        runner.hold(True)

    def resume(self) -> None:
        self.paused = None
        self._running.set()
        self.server.runner.hold(False)

    def routes(self) -> list[web.RouteDef]:
        if self.server.persona.name == "vllm":
            return [
                web.post("/pause", self.vllm_pause),
                web.post("/resume", self.vllm_resume),
                web.get("/is_paused", self.vllm_is_paused),
                web.post("/abort_requests", self.vllm_abort),
                web.post("/update_weight_version", self.vllm_version),
                web.get("/weight_info", self.vllm_weight_info),
                web.post("/sleep", self.vllm_sleep),
                web.post("/wake_up", self.vllm_wake),
                web.get("/is_sleeping", self.vllm_is_sleeping),
                web.post("/init_weight_transfer_engine", self.succeed),
                web.post("/shutdown_weight_transfer_engine", self.succeed),
                web.post("/start_weight_update", self.succeed),
                web.post("/update_weights", self.update_weights),
                web.post("/finish_weight_update", self.update_weights),
            ]
        update = [
            "/update_weights_from_disk",
            "/update_weights_from_distributed",
            "/update_weights_from_tensor",
        ]
        plain = [
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/begin_weight_update",
            "/end_weight_update",
        ]
        return [
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.route("*", "/flush_cache", self.flush_cache),
            web.post("/update_weight_version", self.update_weight_version),
            web.route("*", "/release_memory_occupation", self.release_memory),
            web.route("*", "/resume_memory_occupation", self.resume_memory),
            *(web.post(path, self.update_weights) for path in update),
            *(web.post(path, self.succeed) for path in plain),
        ]

    # -- SGLang ---------------------------------------------------------------------

    @admin
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _object(request)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in SGLANG_MODES:
            return _unprocessable("mode", mode, SGLANG_MODES)
        self.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @admin
    async def continue_generation(self, _: web.Request) -> web.Response:
        self.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @admin
    async def flush_cache(self, _: web.Request) -> web.Response:
        """Refused while requests run, unless a pause aborted or retracted them."""
        live = self.server.runner.live()
        if live and self.paused not in ("abort", "retract"):
            return web.Response(status=400, text="Flush cache failed.\n")
        self.server.reset_prefix_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    @admin
    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _object(request)
        if isinstance(body, web.Response):
            return body
        if request.path.endswith("_disk") and not isinstance(body.get("model_path"), str):
            return _unprocessable("model_path", body.get("model_path"), ("a path",))
        await asyncio.sleep(self.update_time)
        self.updates += 1
        message = "Succeeded to update model weights."
        version = body.get("weight_version")
        if version is not None:
            self.version = str(version)
            message += f" Weight version updated to {version}."
        answer: dict[str, Any] = {"success": True, "message": message}
        if request.path.endswith("_disk"):
            answer["num_paused_requests"] = 0
        return web.json_response(answer)

    @admin
    async def update_weight_version(self, request: web.Request) -> web.Response:
        said = await _new_version(request)
        if isinstance(said, web.Response):
            return said
        body, version = said
        if body.get("abort_all_requests"):
            self.server.runner.abort_all()
        self.version = version
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    @admin
    async def release_memory(self, _: web.Request) -> web.Response:
        self.asleep = True
        return web.Response(status=200)

    @admin
    async def resume_memory(self, _: web.Request) -> web.Response:
        self.asleep = False
        return web.Response(status=200)

    @admin
    async def succeed(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": f"{request.path[1:]} done"})

    # -- vLLM -----------------------------------------------------------------------

    async def vllm_pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in VLLM_MODES:
            return _unprocessable("mode", mode, VLLM_MODES)
        if mode == "wait":  # what is in flight finishes first (30 s at most); new ones wait
            self._running.clear()
            try:
                for _ in range(3000):
                    if not self.server.runner.live():
                        break
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self._running.set()  # the pause never happened
                raise
        self.pause(mode)
        return web.json_response({"status": "paused"})

    async def vllm_resume(self, _: web.Request) -> web.Response:
        self.resume()
        return web.json_response({"status": "resumed"})

    async def vllm_is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused is not None})

    async def vllm_abort(self, request: web.Request) -> web.Response:
        body = await _object(request)
        if isinstance(body, web.Response):
            return body
        ids = body.get("request_ids")
        if ids:
            aborted = sum(self.server.runner.abort_rid(str(rid)) for rid in ids)
        else:
            aborted = self.server.runner.abort_all()
        return web.json_response({"status": "aborted", "aborted": aborted})

    async def vllm_version(self, request: web.Request) -> web.Response:
        said = await _new_version(request)
        if isinstance(said, web.Response):
            return said
        self.version = version = said[1]
        return web.json_response({"success": True, "new_version": version})

    async def vllm_weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def vllm_sleep(self, _: web.Request) -> web.Response:
        self.asleep = True
        self.server.reset_prefix_cache()
        return web.Response(status=200)

    async def vllm_wake(self, _: web.Request) -> web.Response:
        self.asleep = False
        return web.Response(status=200)

    async def vllm_is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.asleep})


async def _object(request: web.Request) -> dict[str, Any] | web.Response:
    """The body as a JSON object; none at all is an empty one."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return web.json_response({"detail": "JSON decode error"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"detail": "the body must be a JSON object"}, status=422)
    return body


async def _new_version(request: web.Request) -> tuple[dict[str, Any], str] | web.Response:
    """``update_weight_version``'s body and its ``new_version`` (a string, in both engines)."""
    body = await _object(request)
    if isinstance(body, web.Response):
        return body
    version = body.get("new_version")
    if not isinstance(version, str):
        return _unprocessable("new_version", version, ("a string",))
    return body, version


def _unprocessable(field: str, value: object, wanted: tuple[str, ...]) -> web.Response:
    """FastAPI's answer to a field it cannot take."""
    detail = [
        {
            "type": "value_error",
            "loc": ["body", field],
            "msg": f"Input should be {' or '.join(wanted)}",
            "input": value,
        }
    ]
    return web.json_response({"detail": detail}, status=422)
