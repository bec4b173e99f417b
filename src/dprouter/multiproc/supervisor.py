"""``--processes N``: N serving processes on one port, one control plane, one board.

The parent makes the shared board (before any child starts: on Python 3.11 a
segment made by a child could be unlinked when that child exits), holds the
port (so port 0 resolves once and a replacement process finds the same one),
runs the control plane and starts the serving processes. Each serving process
listens on the port with SO_REUSEPORT, so the kernel spreads connections over
them. A serving process that dies is replaced; what it had in flight is
released from the board first, so no count leaks. SIGTERM reaches every
serving process, each drains with the one grace, and the parent exits last.
SIGHUP (``reload_tls``) is forwarded likewise: each serving process reloads its own
TLS context, once the parent has seen the new pair load.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
from dataclasses import replace
from multiprocessing.shared_memory import SharedMemory

from prometheus_client.multiprocess import mark_process_dead

from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError
from dprouter.core.net import bind, url_of
from dprouter.core.service import Service
from dprouter.core.tls import https, server_context
from dprouter.fleet.board import Board, size_of
from dprouter.fleet.board_lock import BoardLock, hand_back
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.membership import settled
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.multiproc.serving_process import Seat, main

log = logging.getLogger("dprouter")
SPAWN = multiprocessing.get_context("spawn")  # never fork a process with a running loop
START_TIMEOUT = 60.0  # seconds for every serving process to listen
REAP = 5.0  # seconds an ended serving process may take to finish exiting
REAP_POLL = 0.005  # seconds between looks meanwhile


class Supervisor(Service):
    """The parent: same surface as ``Router`` (start, stop, settled, url, registry)."""

    def __init__(self, config: RouterConfig) -> None:
        from dprouter.multiproc.control import ControlPlane

        self.config = config = validate(config)
        # the pair is checked here, once: a bad file fails the start, not every process (and
        # before the shared memory exists, which nothing would unlink)
        self.tls = config.tls_cert is not None and config.tls_key is not None
        if config.tls_cert is not None and config.tls_key is not None:
            server_context(config.tls_cert, config.tls_key)
        access = config.engine_access()
        self.rows = config.process_count
        self._memory = SharedMemory(create=True, size=size_of(self.rows))
        self.board = Board(rows=self.rows, buffer=self._memory.buf)
        self.semaphore = SPAWN.Semaphore(1)  # the board lock's, shared by every process
        self.board.lock = BoardLock(self.semaphore, self.board, holder=self.rows + 1)
        self.registry = Registry(dp_aware=config.dp_aware != "off", board=self.board)
        for spec in config.workers:
            self.registry.add(worker_from_spec(spec, self.registry))
        self.monitor = Monitor(self.registry, config.monitor_options(), access)
        self.breakers = Breakers(self.registry, config.breaker_options())
        self.control = ControlPlane(config, self.registry, self.monitor, self.breakers)
        self._dir = tempfile.mkdtemp(prefix="dprouter-")
        self.port = config.port
        self._held: socket.socket | None = None  # the port, held while the processes serve
        self.metrics_port = config.metrics_port  # --metrics-port, held alike
        self._held_metrics: socket.socket | None = None
        self.children: dict[int, multiprocessing.process.BaseProcess] = {}
        self.stopping = False
        self.replaced = 0  # serving processes replaced after they died
        self.gave_up = asyncio.Event()  # they kept dying at start-up: the router cannot serve
        self.ended = asyncio.Event()  # stopping, and every serving process has ended
        self._reaping: set[asyncio.Task[None]] = set()  # serving processes on their way out
        self._quick_deaths = 0
        self._hash_seed = str(secrets.randbelow(1 << 32))

    @property
    def url(self) -> str:
        return https(url_of(self.config.host, self.port), self.tls)

    @property
    def metrics_url(self) -> str | None:
        """Where ``--metrics-port`` serves ``/metrics``; None without it."""
        if self.metrics_port is None:
            return None
        return url_of(self.config.metrics_host or self.config.host, self.metrics_port) + "/metrics"

    def reload_tls(self) -> bool:
        """SIGHUP to every serving process, if the new pair loads (else logged, and each
        keeps the pair it has). True when forwarded."""
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None or key is None:
            log.warning("TLS reload asked for, but the router serves plain HTTP")
            return False
        try:
            server_context(cert, key)
        except ConfigError as exc:
            log.error("TLS reload failed, the certificate in use stays: %s", exc)
            return False
        for child in self.children.values():
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGHUP)
        return True

    async def start(self) -> None:
        """Returns once every serving process listens."""
        try:
            held = bind(self.config.host, self.port, reuse_port=True, listen=False)
            self._held = held
            self.port = held.getsockname()[1]
            if self.metrics_port is not None:
                host = self.config.metrics_host or self.config.host
                metrics = bind(host, self.metrics_port, reuse_port=True, listen=False)
                self._held_metrics = metrics
                self.metrics_port = metrics.getsockname()[1]
            os.mkdir(os.path.join(self._dir, "metrics"))
            await self.control.start(os.path.join(self._dir, "control.sock"))
            for row in range(self.rows):
                self._spawn(row)
            async with asyncio.timeout(START_TIMEOUT):
                while len(self.control.listening) < self.rows:
                    if self.gave_up.is_set():
                        raise RuntimeError("the serving processes could not start (see the log)")
                    self.control.joined.clear()
                    await self.control.joined.wait()
        except BaseException:
            await self.stop()
            raise

    def _spawn(self, row: int) -> None:
        seat = Seat(
            # each process draws its own random numbers (seed + row): two drawing the same
            # would pick the same targets in step and, in SGLang P/D, the same bootstrap
            # rooms -- one request's KV consumed by another's
            config=replace(
                self.config,
                port=self.port,
                metrics_port=self.metrics_port,
                processes=1,
                seed=self.config.seed + row,
            ),
            row=row,
            rows=self.rows,
            board=self._memory.name,
            control=os.path.join(self._dir, "control.sock"),
            metrics=os.path.join(self._dir, "metrics"),
            log_level=logging.getLogger().level,
            lock=self.semaphore,
        )

        child = SPAWN.Process(target=main, args=(seat,), name=f"dprouter-{row}", daemon=False)
        # one string hash seed for all serving processes, chosen per run: str hashes and set
        # orders alike in each (what they tell each other no longer depends on it: cache_aware's
        # prefix blocks are its own kernel's hashes)
        before = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = self._hash_seed
        try:
            child.start()
        finally:
            if before is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = before
        self.children[row] = child
        self.watch(row, child)

    def watch(self, row: int, child: multiprocessing.process.BaseProcess) -> None:
        """Take ``child`` as the serving process of ``row``, and learn when it ends."""
        loop = asyncio.get_running_loop()
        loop.add_reader(child.sentinel, self._exiting, row, child, loop.time())

    def _exiting(
        self, row: int, child: multiprocessing.process.BaseProcess, started: float
    ) -> None:
        """The sentinel reads as closed once the process has closed its files on the way
        out, a moment before it can be reaped. Reaping then without waiting found it still
        running, and nothing reaped it after: a zombie, and a stop waiting out the grace
        for it. So its end is awaited, without holding up the control plane meanwhile."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.sentinel)
        task = loop.create_task(self._ended(row, child, started))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _ended(
        self, row: int, child: multiprocessing.process.BaseProcess, started: float
    ) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(round(REAP / REAP_POLL)):  # a look at exitcode reaps it
            if child.exitcode is not None:
                break
            await asyncio.sleep(REAP_POLL)
        self.control.listening.discard(row)
        if hand_back(self.semaphore, self.board, row):
            log.warning("serving process %d died holding the board lock: handed back", row)
        self.board.release(row)  # its requests are in flight no more
        if child.pid is not None:  # its livemax gauges (loop lag) count no more
            mark_process_dead(child.pid, os.path.join(self._dir, "metrics"))  # type: ignore[no-untyped-call]
        if self.stopping:
            if not any(c.is_alive() for c in self.children.values()):
                self.ended.set()
            return
        quick = loop.time() - started < 2.0
        self._quick_deaths = self._quick_deaths + 1 if quick else 0
        if self._quick_deaths >= 5:
            log.error("serving processes keep dying at start-up: giving up")
            self.gave_up.set()
            self.control.joined.set()
            return
        log.warning(
            "serving process %d (pid %s) ended with %s: replacing it",
            row,
            child.pid,
            child.exitcode,
        )
        self.replaced += 1
        self._spawn(row)

    async def stop(self) -> None:
        """SIGTERM to every serving process; each drains with the grace; then the rest."""
        self.stopping = True
        alive = [c for c in self.children.values() if c.is_alive()]
        for child in alive:
            if child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)
        if alive:
            try:
                async with asyncio.timeout(self.config.grace + 5.0):
                    await self.ended.wait()
            except TimeoutError:
                log.error("serving processes still running after the grace: killing them")
        for child in self.children.values():
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGKILL)
            child.join(1.0)
        for task in self._reaping:  # the board they would release is closed next
            task.cancel()
        await asyncio.gather(*self._reaping, return_exceptions=True)
        await self.control.stop()
        for held in (self._held, self._held_metrics):
            if held is not None:
                held.close()
        self.board.close()
        self._memory.close()
        self._memory.unlink()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def settled(self, seconds: float) -> bool:
        return await settled(self.control.sources, self.monitor, seconds)
