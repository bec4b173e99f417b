"""The ``dprouter`` command: a thin layer over the Python API.

Each command's module is imported only when that command is asked for, so
``dprouter serve`` loads the router alone: not the simulator, the benchmarks,
or their plotting and progress-bar libraries (the ``bench`` extra).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
from collections.abc import Iterator
from types import FrameType

import click

# name -> "module:attribute" of the click command
COMMANDS = {
    "bench": "dprouter.bench.command:bench",
    "demo": "dprouter.cli.demo:demo",
    "launch": "dprouter.cli.launch:launch",
    "register": "dprouter.cli.register:register",
    "serve": "dprouter.cli.serve:serve",
    "sim": "dprouter.sim.command:sim",
    "top": "dprouter.cli.top:top_command",
}


def stopped_early(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while a command is still loading (its modules take seconds on a busy host)
    or setting up, before its own handling is in place: nothing serves yet, so the process
    ends at once, cleanly (exit 0) and saying so; the default action ends it silently
    with 143."""
    os.write(2, b"dprouter: SIGTERM before it started: stopped\n")  # no lock to deadlock on
    raise SystemExit(0)


@contextlib.contextmanager
def stopping_early() -> Iterator[None]:
    """``stopped_early`` on SIGTERM for the block; the handler before it afterwards."""
    before = signal.signal(signal.SIGTERM, stopped_early)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class LazyGroup(click.Group):
    """A group whose commands are imported when they are looked up (click's lazy pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, name = COMMANDS[cmd_name].split(":")
        with stopping_early():
            command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command), COMMANDS[cmd_name]
        return command


@click.group(cls=LazyGroup)
@click.version_option(package_name="dprouter")
def main() -> None:
    """dprouter: route LLM requests to (worker, dp_rank) targets."""
