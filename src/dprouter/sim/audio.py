"""Audio endpoints of a simulated engine: the transcript says which bytes arrived
(length and CRC-32 of the file), so a test can tell the file passed unchanged."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dprouter.sim.served import Refused, dumps, fail, place

if TYPE_CHECKING:
    from dprouter.sim.server import SimServer


class Audio:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        routes = [web.post("/v1/audio/transcriptions", self.transcribe)]
        if self.server.persona.name == "vllm":
            routes.append(web.post("/v1/audio/translations", self.transcribe))
        return routes

    async def transcribe(self, request: web.Request) -> web.Response:
        server = self.server
        try:
            if not request.content_type.startswith("multipart/"):
                raise fail(server, 400, "expected multipart/form-data")
            try:
                form = await request.post()
            except (ValueError, AssertionError, KeyError, HttpProcessingError) as exc:
                raise fail(server, 400, f"Invalid multipart body: {exc}") from None
            upload = form.get("file")
            if not isinstance(upload, web.FileField):
                raise fail(server, 400, "file is required")
            data = upload.file.read()
            fields: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
            model = fields.get("model")
            if isinstance(model, str):
                message = server.persona.model_error(model, server.config.model)
                if message is not None:
                    raise fail(server, 404, message, "NotFoundError")
            fields["file"] = {"name": upload.filename, "size": len(data), "crc": zlib.crc32(data)}
            rank = await place(server, request, fields)
        except Refused as refused:
            return refused.response
        text = f"{len(data)} bytes, crc {zlib.crc32(data):08x}"
        headers = {"x-sim-engine": server.engine_id, "x-sim-dp-rank": str(rank)}
        return web.json_response({"text": text}, headers=headers, dumps=dumps)
