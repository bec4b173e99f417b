"""How this package's log lines read: a malformed request logged as the client's fault,
and a line made while a request is handled naming that request."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

# the id of the request the current task handles (``core/tracing.py`` ``request_id``)
REQUEST_ID: ContextVar[str | None] = ContextVar("dprouter.request_id", default=None)


class MalformedIsNoError(logging.Filter):
    """aiohttp logs every malformed request at ERROR with a traceback; on a port a scanner
    finds that floods the log. Such a request is the client's fault and already answered
    400: one WARNING line says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            reason = " ".join(str(exc.message).split())[:200]
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "malformed request from %s refused: %s", (remote, reason)
            record.exc_info = record.exc_text = None
        return True


QUIET = MalformedIsNoError()


def quiet_malformed() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if QUIET not in server_log.filters:
        server_log.addFilter(QUIET)


class RequestTagged:
    """A log record factory: a record made while a request is handled (in its task, or a
    task it started) carries ``request_id`` and ends with ``[request ID]``. A factory, not
    a filter, as a logger's filter sees only its own records, not those of the loggers
    below it (``dprouter.breaker``...) nor aiohttp's; it runs only for records a level lets
    through, and costs a context variable read (0.03 us) there."""

    def __init__(self, made: Any) -> None:
        self.made = made  # the factory before this one

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record: logging.LogRecord = self.made(*args, **kwargs)
        rid = record.request_id = REQUEST_ID.get()
        if rid is not None:
            if not record.args:  # not %-formatted: the id is taken as it is
                record.msg = f"{record.msg} [request {rid}]"
            elif isinstance(record.args, tuple):
                record.msg = f"{record.msg} [request %s]"
                record.args = (*record.args, rid)
        return record


def tag_requests() -> None:
    """Name the request in the log lines made while it is handled (once per process)."""
    if not isinstance(logging.getLogRecordFactory(), RequestTagged):
        logging.setLogRecordFactory(RequestTagged(logging.getLogRecordFactory()))
