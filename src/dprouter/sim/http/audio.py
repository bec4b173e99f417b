"""Audio endpoints of a simulated engine: the transcript says which bytes arrived
(length and CRC-32 of the file), so a test can tell the file passed unchanged.

The form is read part by part as it arrives, and counted so, so that a test can see
an upload reach the engine while the client is still sending it (``arrived``), one
that was not read to its end (``broken``), and the SHA-256 of each file a rank took (``files``)."""

from __future__ import annotations

import hashlib
import zlib
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from dprouter.sim.http.served import Refused, dumps, fail, place

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer


class Audio:
    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.arrived = 0  # file bytes read so far, of every upload
        self.broken = 0  # uploads not read to their end (the client or the router left)
        self.files: defaultdict[int, list[str]] = defaultdict(list)  # rank: SHA-256 per file

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
            whole = False
            try:
                fields, file = await self._read(request)
                whole = True
            except (ValueError, AssertionError, KeyError, HttpProcessingError) as exc:
                raise fail(server, 400, f"Invalid multipart body: {exc}") from None
            finally:
                self.broken += not whole
            if file is None:
                raise fail(server, 400, "file is required")
            model = fields.get("model")
            if isinstance(model, str):
                message = server.persona.model_error(model, server.config.model)
                if message is not None:
                    raise fail(server, 404, message, "NotFoundError")
            fields["file"] = file
            rank = await place(server, request, fields)
        except Refused as refused:
            return refused.response
        self.files[rank].append(file["sha256"])
        text = f"{file['size']} bytes, crc {file['crc']:08x}"
        headers = {"x-sim-engine": server.engine_id, "x-sim-dp-rank": str(rank)}
        return web.json_response({"text": text}, headers=headers, dumps=dumps)

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The form's text fields, and what its file part held (None: no file)."""
        fields: dict[str, Any] = {}
        file: dict[str, Any] | None = None
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader) or part.name is None:
                raise ValueError("a form part without a name")
            if part.filename is None:
                fields[part.name] = await part.text()
                continue
            digest, crc, size = hashlib.sha256(), 0, 0
            while chunk := await part.read_chunk():
                digest.update(chunk)
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
                self.arrived += len(chunk)
                if size > self.server.max_body:
                    raise fail(self.server, 413, f"Request body exceeds {self.server.max_body}")
            if part.name == "file":
                file = {
                    "name": part.filename,
                    "size": size,
                    "crc": crc,
                    "sha256": digest.hexdigest(),
                }
        return fields, file
