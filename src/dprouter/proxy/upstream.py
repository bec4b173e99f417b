"""Sending an attempt to an engine: one aiohttp client session shared by every request,
and ``Upstream.post``, which turns what went wrong before an answer into ``Failed``."""

from __future__ import annotations

import asyncio
import contextlib
import io

import aiohttp
from aiohttp import hdrs
from multidict import CIMultiDict

from dprouter.config import RouterConfig
from dprouter.core.errors import Failed
from dprouter.core.tls import EngineAccess
from dprouter.core.types import Side
from dprouter.fleet.targets import Target, Worker
from dprouter.fleet.worker_spec import own_key
from dprouter.proxy.upload import Upload

NO_TIMER = contextlib.nullcontext()
LARGE = 1 << 20  # bytes: aiohttp warns of a body this large sent as one piece


class UpstreamRequest(aiohttp.ClientRequest):
    """aiohttp's request with no Accept-Encoding of its own: answers pass through
    undecoded, so an engine may compress only for a client that asked. The same as
    ``skip_auto_headers=("Accept-Encoding",)``, which costs 8 us per request (a
    sorted CIMultiDict and a header copy built per request, timed under ``bench
    overhead``); a class default costs nothing."""

    DEFAULT_HEADERS = {hdrs.ACCEPT: "*/*"}  # noqa: RUF012 (aiohttp's own attribute)


def upstream_session(
    config: RouterConfig, access: EngineAccess | None = None
) -> aiohttp.ClientSession:
    """The session every attempt goes over; ``https://`` workers with ``access``'s TLS
    context (None: made from ``config``'s ``--engine-ca/--engine-cert/--engine-key``)."""
    if access is None:
        access = EngineAccess.load(config.engine_ca, config.engine_cert, config.engine_key)
    # a burst queues for an upstream connection rather than exhausting file descriptors
    connector = aiohttp.TCPConnector(
        limit=config.upstream_connections,
        limit_per_host=config.upstream_per_worker,
        keepalive_timeout=config.upstream_keepalive,
        ssl=access.connector_ssl,
    )
    timeout = aiohttp.ClientTimeout(
        total=config.total_timeout or None,
        sock_connect=config.connect_timeout,
        sock_read=config.read_timeout or None,
    )
    # No cookie jar: a cookie an engine sets goes to the client it answered (the relay
    # passes Set-Cookie on), never out with another's request.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        request_class=UpstreamRequest,
    )


class Upstream:
    """Posts attempts over the shared session, each with its first-byte timer and the
    key of the worker it goes to."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        connect_timeout: float,
        first_byte_timeout: float,
        access: EngineAccess | None = None,
    ) -> None:
        self.session = session
        self.access = access or EngineAccess()
        self.connect_timeout = connect_timeout
        fb = first_byte_timeout  # the answer must start in time; off: no timer per request
        self.first_byte_timeout = fb
        self.first_byte = (lambda: asyncio.timeout(fb)) if fb else (lambda: NO_TIMER)

    async def post(
        self,
        target: Target,
        path: str,
        data: bytes | Upload,
        headers: CIMultiDict[str],
        side: Side | None = None,
        method: str = "POST",
    ) -> aiohttp.ClientResponse:
        """Send one attempt; what went wrong before an answer raises ``Failed``."""
        url = target.worker.url + path
        headers = self.keyed(target.worker, headers)
        # a large body held whole is written a piece at a time (as aiohttp asks), from a
        # fresh reader per attempt; an upload is its own reader
        body = io.BytesIO(data) if isinstance(data, bytes) and len(data) > LARGE else data
        try:
            timer = self._first_byte(data)
            if timer is NO_TIMER:  # no timer (the default): no context entered, 1 us less
                return await self.session.request(method, url, data=body, headers=headers)
            async with timer:
                return await self.session.request(method, url, data=body, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            raise Failed(target, "connect", f"cannot connect ({exc.os_error})", side) from exc
        except aiohttp.ConnectionTimeoutError as exc:
            wait = f"no connection within {self.connect_timeout:g} s"
            raise Failed(target, "connect_timeout", wait, side) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Failed(target, "no_answer", f"{type(exc).__name__} {exc}".strip(), side) from exc
        finally:
            if isinstance(data, Upload):
                data.on_sent = None  # the answer came, or the attempt is over: no clock to start

    def keyed(self, worker: Worker, headers: CIMultiDict[str]) -> CIMultiDict[str]:
        """``headers`` with ``worker``'s key in place of whatever the client sent; a copy,
        as they go again to the next target on a retry, which may have another key."""
        key = self.access.authorization(own_key(worker))
        if key is None:
            return headers
        headers = headers.copy()
        headers[hdrs.AUTHORIZATION] = key
        return headers

    def _first_byte(self, data: bytes | Upload) -> contextlib.AbstractAsyncContextManager[object]:
        """The first-byte timer. A streamed upload can take longer to send than any answer
        takes to start: its clock starts once its last byte went (the total timeout, kept
        by the session, still counts the upload)."""
        fb = self.first_byte_timeout
        if not fb or not isinstance(data, Upload):
            return self.first_byte()
        timer = asyncio.timeout(None)
        loop = asyncio.get_running_loop()
        data.on_sent = lambda: timer.reschedule(loop.time() + fb)
        return timer
