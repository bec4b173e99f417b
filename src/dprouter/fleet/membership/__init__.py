"""Membership sources: where workers come from besides the command line.

Each source learns of workers and tells the registry (``add``, ``remove``) and
the monitor (``watch`` discovers a new one, ``forget`` stops that); it never
routes and never reaches into another source. They run where the registry is
owned: the router itself, or the parent of ``--processes``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from dprouter.fleet.monitor import Monitor


class Source(Protocol):
    name: str
    synced: asyncio.Event  # set once the source has been read whole

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def worker_name(url: str) -> str:
    """A worker's name (its key under the prefix, and its id) when none is given: the
    host and port of its URL, the same on every replica."""
    netloc = urlsplit(url).netloc
    return re.sub(r"[^A-Za-z0-9._-]", "-", netloc)


async def read_within(sources: Sequence[Source], seconds: float) -> bool:
    """Wait up to ``seconds`` for every source's first whole read; False if one is late
    (its workers join when it answers)."""
    try:
        async with asyncio.timeout(seconds):
            for source in sources:
                await source.synced.wait()
    except TimeoutError:
        return False
    return True


async def settled(sources: Sequence[Source], monitor: Monitor, seconds: float) -> bool:
    """Wait for every source's first whole read, then for the discovery of every worker,
    ``seconds`` in all; False if some are late."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    read = await read_within(sources, seconds)
    return await monitor.settled_within(max(deadline - loop.time(), 0.0)) and read
