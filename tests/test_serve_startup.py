"""``dprouter serve`` stopped before it serves: a SIGTERM while its modules load, and one
while a worker is still being discovered. Real processes, stopped by their PID."""

from __future__ import annotations

import asyncio
import selectors
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

STARTUP = "600"  # far beyond the tests' deadlines: a router that waits it out fails them


@pytest.fixture
def silent_worker() -> Iterator[socket.socket]:
    """A worker that takes connections (the kernel completes them) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


def probed(listener: socket.socket, seconds: float) -> socket.socket:
    """The first connection the router made to the worker: its discovery is under way.
    Kept open and never answered by the caller."""
    with selectors.DefaultSelector() as waiting:
        waiting.register(listener, selectors.EVENT_READ)
        assert waiting.select(seconds), "the router never tried the worker"
    return listener.accept()[0]


async def test_sigterm_while_discovering_stops_at_once_without_serving(
    silent_worker: socket.socket,
) -> None:
    url = f"http://127.0.0.1:{silent_worker.getsockname()[1]}"
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "dprouter", "serve", "--port", "0", "--worker", url),
        *("--startup-timeout", STARTUP),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        connection = await asyncio.to_thread(probed, silent_worker, 60)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)  # the grace is 30 s
        connection.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = err.decode()
    assert proc.returncode == 0, log
    assert "stopping: no new connections" in log
    assert "dprouter on" not in log and "still discovering" not in log  # it never served
    assert "Traceback" not in log


# `dprouter serve` whose command module takes as long to load as the test likes (as on a
# busy machine, seconds): a finder ahead of the others says when the import begins, then
# waits on stdin, where the test never writes
LOADING = """
import sys
from importlib.abc import MetaPathFinder


class Slow(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dprouter.cli.serve":
            print("loading", flush=True)
            sys.stdin.readline()
        return None


sys.meta_path.insert(0, Slow())
from dprouter.cli import main

main()
"""


async def test_sigterm_while_the_command_loads_stops_cleanly_and_says_so() -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", LOADING, "serve", "--port", "0"),
        *("--worker", "http://127.0.0.1:1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"loading\n"
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err  # not -15: the default action, silent
    assert err.decode().splitlines() == ["dprouter: SIGTERM before it started: stopped"]
