"""How the HTTP servers of this package log a malformed request: as the client's fault."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


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
