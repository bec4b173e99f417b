"""MoRIIO instances announce themselves over ZMQ; silent ones are expired.

The router binds a ROUTER socket; each engine sends a msgpack map about every
3 s: ``type`` (``P`` or ``D``; ``HELLO`` is ignored), ``http_address``,
``zmq_address``, ``dp_size``, ``tp_size``, ``transfer_mode``. A new address
becomes a worker of its role at once (its ranks are what it says); one not
heard from for ``timeout`` seconds is removed, all its ranks with it, and
comes back when it speaks again. Every instance must use the transfer mode
of the first one; others are refused, with a log line saying why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from dprouter.core.types import Role
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import normalise_url

log = logging.getLogger("dprouter.registration")
ROLES: dict[str, Role] = {"P": "prefill", "D": "decode"}


MODES = ("READ", "WRITE")
MAX_RANKS = 1024  # a dp or tp size beyond this is a malformed message, not a machine


def _size(msg: dict[str, Any], name: str) -> int:
    value = msg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_RANKS:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_RANKS}, got {value!r}")
    return value


class Registration:
    def __init__(
        self,
        registry: Registry,
        address: str,
        timeout: float,
        forget: Callable[[str], None] = lambda worker_id: None,
    ) -> None:
        self.registry = registry
        self.address = address
        self.timeout = timeout
        self.forget = forget  # an expired worker's other background work stops too
        self.seen: dict[str, float] = {}  # worker id -> last heartbeat (monotonic)
        self._refused: set[str] = set()  # addresses already warned about
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.address.endswith(":0"):  # any free port: read the real one back
            port = sock.bind_to_random_port(self.address.rsplit(":", 1)[0])
            self.address = f"{self.address.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(self.address)
        self._tasks = [
            asyncio.create_task(self._listen(sock), name="registration"),
            asyncio.create_task(self._expire(), name="registration-expiry"),
        ]
        log.info("MoRIIO registration on %s", self.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _listen(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    self.heard(msgpack.unpackb(frames[-1]))
                except Exception as exc:  # one bad message must not silence registration
                    log.warning("registration message ignored: %s: %s", type(exc).__name__, exc)
        finally:
            sock.close(0)

    def heard(self, msg: Any) -> Worker | None:
        """One heartbeat; returns the worker it keeps alive (None: ignored or refused)."""
        if not isinstance(msg, dict):
            raise ValueError("a registration message is a map")
        kind = msg.get("type")
        if kind == "HELLO":
            return None
        if kind not in ROLES:
            raise ValueError(f"type must be P, D or HELLO, got {kind!r}")
        url = normalise_url(str(msg["http_address"]))
        mode = msg.get("transfer_mode")
        if mode not in MODES:
            raise ValueError(f"transfer_mode must be READ or WRITE, got {mode!r}")
        dp, tp = _size(msg, "dp_size"), _size(msg, "tp_size")
        zmq_address = msg.get("zmq_address")
        if not isinstance(zmq_address, str) or "handshake:" not in zmq_address:
            raise ValueError(f"zmq_address must be host:IP,handshake:PORT,..., got {zmq_address!r}")
        running = self.mode  # checked only once the message is known to be whole
        if running is not None and mode != running:
            if url not in self._refused:
                self._refused.add(url)
                log.error(
                    "MoRIIO instance %s refused: transfer mode %s, but this deployment "
                    "runs %s (all instances must agree)",
                    url,
                    mode,
                    running,
                )
            return None
        self._refused.discard(url)
        worker = next((w for w in self.registry.workers.values() if w.url == url), None)
        shape = (ROLES[kind], dp, tp, zmq_address, mode)
        if (
            worker is not None
            and (
                worker.role,
                worker.ranks,
                worker.tp_size,
                worker.zmq_address,
                worker.transfer_mode,
            )
            != shape
        ):
            self.registry.remove(worker.id)  # it came back different: register it afresh
            worker = None
        if worker is None:
            role = ROLES[kind]
            worker = Worker(
                id=self.registry.next_id(role),
                url=url,
                role=role,
                dialect="vllm",
                dp_size=dp,
                tp_size=tp,
                zmq_address=zmq_address,
                transfer_mode=mode,
            )
            worker.ranks = dp
            self.registry.add(worker)
            self.registry.mark_ready(worker)
            log.info(
                "MoRIIO %s instance %s registered as %s: dp %d, tp %d, %s",
                role,
                url,
                worker.id,
                dp,
                tp,
                mode,
            )
        self.seen[worker.id] = asyncio.get_running_loop().time()
        return worker

    @property
    def mode(self) -> str | None:
        """The transfer mode of the instances registered now (None: there are none)."""
        return next((w.transfer_mode for w in self.registry.workers.values()), None)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(max(self.timeout / 4, 0.05))
            self.expire(asyncio.get_running_loop().time())

    def expire(self, now: float) -> None:
        for worker_id, last in list(self.seen.items()):
            if now - last > self.timeout:
                del self.seen[worker_id]
                if worker_id in self.registry.workers:
                    self.forget(worker_id)
                    worker = self.registry.remove(worker_id)
                    log.warning(
                        "MoRIIO instance %s (%s) expired: no heartbeat for %.1fs",
                        worker.url,
                        worker_id,
                        now - last,
                    )
