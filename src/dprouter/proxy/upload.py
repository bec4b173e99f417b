"""An audio upload streamed through: the router reads the start of a form only as far
as routing needs (the model field, and the file part begun), then hands the engine that
start and the rest of the client's stream as it arrives, byte for byte. A large file is
never held whole, and ``--max-body`` is counted as the bytes pass.

An upload streams once. Until the engine takes its first byte an attempt may go
elsewhere; after that a failure is answered, not retried: the bytes are gone.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import StreamReader, web

from dprouter.core.errors import BadRequest, TooLarge
from dprouter.core.types import DialectName, Incoming
from dprouter.fleet.registry import Snapshot
from dprouter.proxy import multipart

HEAD = 64 << 10  # the file part must begin within this: the fields before it are small
HOLD = 4 << 20  # several models served: how far a model field sent after the file is awaited


class Upload:
    """The body of one request: the start the router read, then the client's stream.
    aiohttp iterates it as the upstream request's body, one chunk at a time, so the
    client's stream is read no faster than the engine takes it."""

    __slots__ = ("begun", "client_gone", "count", "head", "limit", "on_sent", "rest", "too_large")

    def __init__(self, head: bytes, rest: StreamReader, limit: int) -> None:
        self.head = head
        self.rest = rest
        self.limit = limit
        self.count = len(head)
        self.begun = False  # an engine began taking it: no other attempt can have it
        self.too_large = False
        self.client_gone = False
        self.on_sent: Callable[[], None] | None = None  # the last byte went: start the clock

    def __aiter__(self) -> Upload:
        return self

    async def __anext__(self) -> bytes:
        if not self.begun:
            self.begun = True
            return self.head
        try:
            chunk = await self.rest.readany()
        except Exception:  # a reset, a malformed chunk: the client's side, whatever it was
            self.client_gone = True  # not the engine's fault: no breaker counts it
            raise
        if not chunk:
            if self.on_sent is not None:
                self.on_sent()
            raise StopAsyncIteration
        self.count += len(chunk)
        if self.count > self.limit:
            self.too_large = True
            raise TooLarge(f"request body exceeds {self.limit} bytes")
        return chunk


def several_models(snapshot: Snapshot, dialect: DialectName | None) -> bool:
    """More than one model among the workers of ``dialect``: an upload waits for its
    model field (with one, the field cannot change where it goes)."""
    models = {
        m
        for w in snapshot.workers
        if dialect is None or w.dialect == dialect
        for m in (w.models or ((w.model,) if w.model else ()))
    }
    return len(models) > 1


async def read_upload(
    request: web.Request, limit: int, several: bool
) -> tuple[Incoming, bytes, Upload | None]:
    """The request as routed, the bytes read, and the rest to stream (None: the whole
    body was read, small enough to be sent again on a retry)."""
    delim = multipart.delimiter(request.headers.get("Content-Type", ""))
    declared = request.content_length
    if declared is not None and declared > limit:  # refused before a byte is read
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
    content = request.content
    buf = bytearray()
    while True:
        chunk = await content.readany()
        buf += chunk
        if len(buf) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(buf))
        complete = not chunk or content.at_eof()
        seen = multipart.scan(buf, delim, complete)
        if complete:
            return multipart.incoming(seen, request.headers), bytes(buf), None
        if seen.file and ("model" in seen.fields or not several):
            break
        if not seen.file and len(buf) > HEAD:
            message = f"the file part must begin within the first {HEAD >> 10} KiB of the form"
            raise BadRequest(message, "file")
        if len(buf) > HOLD:
            message = (
                f"no model field within the first {HOLD >> 20} MiB of the form: this router"
                " serves several models; send the model field before the file"
            )
            raise BadRequest(message, "model")
    head = bytes(buf)
    return multipart.incoming(seen, request.headers), head, Upload(head, content, limit)
