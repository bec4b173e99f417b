"""One serving process of ``--processes N`` (started by ``processes.Supervisor``).

Nothing heavy is imported before ``main`` runs: prometheus_client must be put in
multiprocess mode before the router's metrics exist.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dprouter.fleet.board import Board
    from dprouter.multiproc.supervisor import Seat

log = logging.getLogger("dprouter")


def main(seat: Seat) -> None:
    logging.basicConfig(
        level=seat.log_level, format=f"%(asctime)s %(levelname)s [{seat.row}] %(message)s"
    )
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = seat.metrics
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides
    # the parent made it and unlinks it; a spawned process shares the parent's resource
    # tracker, which unlinks nothing while the parent lives
    memory = SharedMemory(seat.board)
    board = asyncio.run(serve(seat, memory))
    board.close()
    memory.close()


async def serve(seat: Seat, memory: SharedMemory) -> Board:
    from dprouter.core import gc_tuning
    from dprouter.fleet.board import Board
    from dprouter.fleet.board_lock import Turn
    from dprouter.fleet.registry import Registry
    from dprouter.multiproc.follower import Channel, Follower
    from dprouter.server.app import Router

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    board = Board(rows=seat.rows, row=seat.row, buffer=memory.buf)
    board.turn = Turn(seat.turn, board, holder=seat.row + 1)
    registry = Registry(dp_aware=seat.config.dp_aware != "off", board=board)
    channel = Channel(seat.control)
    router = Router(
        seat.config,
        registry=registry,
        monitor=Follower(registry, channel, seat.row),
        control=channel,
        metrics_dir=seat.metrics,
        turn=board.turn,
    )
    try:
        await router.start()
        gc_tuning.tune()
        channel.send({"kind": "listening", "row": seat.row})
        await stop.wait()
        log.info("serving process %d stopping", seat.row)
    finally:
        await router.stop()
        await channel.close()
    return board
