"""Telling an SGLang engine that a request's client left: ``POST /abort_request``.

Closing the upstream connection stops a vLLM engine's generation; SGLang has
not always noticed a closed connection (sglang #6280), so the router names
the request by its ``rid`` -- the client's, or one it writes into the body --
and asks the engine to abort it when the client disconnects. ``/abort_request`` is one
of SGLang's admin endpoints: an engine started with ``--admin-api-key`` takes that key
alone there (``EngineAccess.admin_authorization``); one that refuses the router's is
said once per worker, loudly, for its generations would run on for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import hdrs

from dprouter.core.tls import EngineAccess
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import own_key

log = logging.getLogger("dprouter.cancel")
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5)


def ensure_rid(body: dict[str, Any]) -> tuple[str, bool]:
    """The request id the engine will know the request by; True when it was added."""
    rid = body.get("rid")
    if isinstance(rid, str) and rid:
        return rid, False
    rid = body["rid"] = f"dprouter-{uuid.uuid4().hex}"
    return rid, True


class Aborter:
    def __init__(self, session: aiohttp.ClientSession, access: EngineAccess | None = None) -> None:
        self.session = session  # the attempts' own: its TLS context
        self.access = access or EngineAccess()  # ...and the key the engine wants
        self._pending: set[asyncio.Task[None]] = set()  # held so they are not collected
        self._refused: set[str] = set()  # workers whose refusal was said

    def on_cancel(self, worker: Worker, rid: str | None) -> _Watch:
        return _Watch(self, worker, rid)

    def abort(self, worker: Worker, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post(worker, rid))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, worker: Worker, rid: str) -> None:
        url = worker.url + "/abort_request"
        key = self.access.admin_authorization(worker.admin_key, own_key(worker))
        headers = {hdrs.AUTHORIZATION: key} if key is not None else None
        try:
            async with self.session.post(
                url, json={"rid": rid}, headers=headers, timeout=ABORT_TIMEOUT
            ) as r:
                await r.read()
            if r.status in (401, 403) and worker.id not in self._refused:
                self._refused.add(worker.id)
                log.warning(
                    "%s refused the abort of a request whose client left (%d): its "
                    "generation runs on; an engine started with --admin-api-key needs it "
                    "as --engine-admin-key or the worker's admin_key",
                    worker.id,
                    r.status,
                )
        except (aiohttp.ClientError, TimeoutError) as exc:  # it may be gone altogether
            log.debug("abort of %s on %s failed: %s", rid, worker.id, exc)


class _Watch:
    """A block that, cancelled (the client left), aborts ``rid`` on ``worker``."""

    __slots__ = ("aborter", "rid", "worker")

    def __init__(self, aborter: Aborter, worker: Worker, rid: str | None) -> None:
        self.aborter, self.worker, self.rid = aborter, worker, rid

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.rid is not None and et is not None and issubclass(et, asyncio.CancelledError):
            self.aborter.abort(self.worker, self.rid)
