"""A stream's read timeout (``--read-timeout``) for a clock read per event, not a timer.

aiohttp keeps the session's ``sock_read`` by cancelling its timer and making a new
one on every read from the socket: 17 times for a 16-event stream, 2 to 3 us
each (a ``TimerHandle`` pushed on the loop's heap, compared by a Python
``__lt__``) -- a third of what the router added to a stream over a bare proxy
(``bench overhead``). Once a stream's headers are in, the relay takes the timeout
over: each event read notes the time, and one timer, when it comes due, either
finds that an event came since (and is set again for that event's deadline)
or fails the read the way aiohttp would have, with ``SocketTimeoutError``.
"""

from __future__ import annotations

import asyncio

import aiohttp

EARLY = 1e-3  # seconds: a timer the loop ran this close to its deadline counts as due


class Idle:
    """Fails ``upstream``'s body with ``SocketTimeoutError`` once ``seconds`` pass with no
    ``touch``. ``stop`` when the body is done."""

    __slots__ = ("_handle", "_loop", "_seconds", "_upstream", "last")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, upstream: aiohttp.ClientResponse
    ) -> None:
        self._loop, self._seconds, self._upstream = loop, seconds, upstream
        self.last = loop.time()  # of the last event read; the caller sets it (``touch``)
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + seconds, self._due)

    def touch(self) -> None:
        self.last = self._loop.time()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _due(self) -> None:
        deadline = self.last + self._seconds
        if self._loop.time() + EARLY < deadline:  # an event came meanwhile
            self._handle = self._loop.call_at(deadline, self._due)
            return
        self._handle = None
        exc = aiohttp.SocketTimeoutError("Timeout on reading data from socket")
        self._upstream.content.set_exception(exc)  # the relay's read raises it


def take_over(loop: asyncio.AbstractEventLoop, upstream: aiohttp.ClientResponse) -> Idle | None:
    """Take ``upstream``'s read timeout from aiohttp for the rest of its body (None: it
    has none). aiohttp's timer for the last read stays until its next read, so nothing
    goes untimed meanwhile; the protocol takes the session's timeout again for the
    next request on the connection."""
    connection = upstream.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is None or not protocol.read_timeout:
        return None
    seconds = protocol.read_timeout
    protocol.read_timeout = None
    return Idle(loop, seconds, upstream)
