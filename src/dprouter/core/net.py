"""Listening sockets: bound up front, so port 0 works and the real port is known."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

log = logging.getLogger("dprouter.net")
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def bind(
    host: str, port: int, backlog: int = 4096, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    """A listening socket on ``host:port`` (IPv6 when the host has a colon).

    ``reuse_port``: several processes listen on the port (SO_REUSEPORT), each with its
    own accept queue; ``listen=False`` only holds the port (the parent of serving
    processes does, so that port 0 is resolved once and a restarted process finds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        if listen:
            sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def check_backlog(backlog: int) -> str | None:
    """The kernel caps the listen backlog at net.core.somaxconn; say so if it bites."""
    try:
        cap = int(SOMAXCONN.read_text())
    except (OSError, ValueError):
        return None
    if cap < backlog:
        return (
            f"listen backlog {backlog} is capped by net.core.somaxconn={cap}: bursts beyond "
            f"{cap} pending connections may be reset (raise it with sysctl)"
        )
    return None


def url_of(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
