"""One serving process of ``--processes N`` (started by ``supervisor.Supervisor``).

``main`` puts prometheus_client in multiprocess mode before the router's metrics exist
(each metric takes its value class when it is made, so importing it first is no harm).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

from dprouter.config import RouterConfig
from dprouter.core import gc_tuning
from dprouter.fleet.board import Board
from dprouter.fleet.board_lock import BoardLock, Semaphore
from dprouter.fleet.registry import Registry
from dprouter.multiproc.control import LISTENING
from dprouter.multiproc.control_link import Channel, ControlLink, Follower
from dprouter.server.app import build_app
from dprouter.server.router import Router

log = logging.getLogger("dprouter")


@dataclass(frozen=True)
class Seat:
    """What a serving process is given: its row on the board and where the rest is."""

    config: RouterConfig
    row: int
    rows: int
    board: str  # the shared memory's name
    control: str  # the control plane's Unix socket
    metrics: str  # prometheus_client's multiprocess directory
    log_level: int
    lock: Semaphore  # the board lock's: one decision at a time (``board_lock``)


def main(seat: Seat) -> None:
    logging.basicConfig(
        level=seat.log_level, format=f"%(asctime)s %(levelname)s [{seat.row}] %(message)s"
    )
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = seat.metrics
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides
    # the parent forwards SIGHUP (a TLS reload): one before the handler is in must not kill
    # this process, and the certificate it then loads is the new one anyway
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # the parent made it and unlinks it; a spawned process shares the parent's resource
    # tracker, which unlinks nothing while the parent lives
    memory = SharedMemory(seat.board)
    board = asyncio.run(serve(seat, memory))
    board.close()
    memory.close()


async def serve(seat: Seat, memory: SharedMemory) -> Board:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    board = Board(rows=seat.rows, row=seat.row, buffer=memory.buf)
    board.lock = BoardLock(seat.lock, board, holder=seat.row + 1)
    registry = Registry(dp_aware=seat.config.dp_aware != "off", board=board)
    channel = Channel(seat.control)
    follower = Follower(registry, channel, seat.row)
    app = build_app(
        seat.config,
        registry=registry,
        monitor=follower,
        control=ControlLink(channel, follower, seat.config, seat.rows),
        metrics_dir=seat.metrics,
        lock=board.lock,
    )
    router = Router.of(app)
    if router.tls is not None:  # each process serves with its own context: each reloads it
        loop.add_signal_handler(signal.SIGHUP, router.reload_tls)
    try:
        await router.start()
        gc_tuning.tune()
        channel.send({"kind": LISTENING, "row": seat.row})
        await stop.wait()
        log.info("serving process %d stopping", seat.row)
    finally:
        await router.stop()
        await channel.close()
    return board
