"""Processes the HTTP scenarios start: pinned to a core, read back when ready, stopped
by their PID, and measured from /proc (CPU seconds and peak memory of the whole tree).

Ports: our own processes (``dprouter serve``, ``dprouter sim``, the bench backend and
bare proxy) bind port 0 and print the URL they got, which ``url_in`` reads back;
only third-party peers, which must bind a port they are given, get ``free_port``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")
DPROUTER = [sys.executable, "-m", "dprouter"]


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the tree, reaped children included."""
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / CLK


def preemptions(pid: int) -> int:
    """Times the tree's processes were switched out while runnable (nonvoluntary_ctxt_switches
    of /proc/PID/status): on a machine with fewer free cores than busy processes, the cost
    that comes with the cores, not with the router."""
    return _status_sum(pid, r"nonvoluntary_ctxt_switches:\s+(\d+)")


def _status_mb(pid: int, field: str) -> float:
    """A memory field of /proc/PID/status (VmHWM, VmRSS), summed over the tree."""
    return _status_sum(pid, rf"{field}:\s+(\d+) kB") / 1024


def _status_sum(pid: int, pattern: str) -> int:
    """A number of /proc/PID/status (``pattern``'s group), summed over the tree."""
    total = 0
    for p in tree(pid):
        try:
            found = re.search(pattern, Path(f"/proc/{p}/status").read_text())
        except OSError:
            continue
        total += int(found[1]) if found else 0
    return total


def peak_rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    """Resident memory of the tree now."""
    return _status_mb(pid, "VmRSS")


class Proc:
    """A child process in its own process group, optionally pinned to ``cpus``."""

    def __init__(
        self, argv: Sequence[str], cpus: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.argv = [*(["taskset", "-c", cpus] if cpus else []), *argv]
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, ready: str | None = None, seconds: float = 60) -> str:
        """Start and read output until a line matches ``ready`` (a regex); returns that line.
        With no ``ready``, return at once (the caller polls the service itself)."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(self.env or {})},
        )
        assert self.proc.stdout is not None
        line = ""
        if ready is not None:
            async with asyncio.timeout(seconds):
                while True:
                    line = (await self.proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        raise RuntimeError(f"{self.argv} exited:\n{''.join(self.lines[-20:])}")
                    self.lines.append(line)
                    if re.search(ready, line):
                        break
        asyncio.get_running_loop().create_task(self._drain())
        return line

    async def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode(errors="replace"))
            del self.lines[:-200]

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(self.proc.wait(), wait)
                return
            except TimeoutError:
                continue


def url_in(line: str) -> str:
    """The URL a process printed on ``line`` ("dprouter on http://127.0.0.1:PORT: ...",
    "vllm-0 vllm dp_size=2 http://127.0.0.1:PORT", "ready http://127.0.0.1:PORT")."""
    found = re.search(r"http://\S+", line)
    if found is None:
        raise ValueError(f"no URL in {line!r}")
    return found[0].rstrip(":")


def urls_in(lines: Sequence[str], prefix: str) -> list[str]:
    """The URLs of the engines ``dprouter sim`` listed (its lines starting ``prefix``)."""
    return [url_in(line) for line in lines if line.startswith(prefix)]


def free_port() -> int:
    """A loopback port in 20000-29999 (clear of the ephemeral range) that was free a moment
    ago, for a third-party peer that binds the port it is given. Another process may take
    it before the peer binds it: ``peers.start_on_free_port`` starts the peer again on
    another port if it exits before serving."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")
