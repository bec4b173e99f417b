"""Every error of the router: the OpenAI shape its own answers take, and each exception.

The router's own errors follow OpenAI's shape and its lower-case ``*_error`` types, one
type per status, so that a type is never at odds with its status. The exceptions are
grouped by who raises them; each says what the caller does with it.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Protocol, TypeVar

import orjson
from aiohttp import web

from dprouter.core.types import Side

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    etype = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    error = {"message": message, "type": etype, "param": param, "code": status}
    return orjson.dumps({"error": error})


def error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = error_body(status, message, param)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """An error as the last event of a stream that has begun, and the stream's end."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"


# -- a stopping router ---------------------------------------------------------------

GRACE_OVER = "dprouter: the grace period ran out"  # the cancel message of a cut request


def grace_over(exc: asyncio.CancelledError) -> bool:
    """The request was cut because the router stopped (not because its client left)."""
    return bool(exc.args) and exc.args[0] == GRACE_OVER


# -- configuration -------------------------------------------------------------------


class ConfigError(ValueError):
    """The configuration cannot work; the message says what to change."""


class TokenizerError(ValueError):
    """A model directory without usable tokenizer files."""


# -- a client's request --------------------------------------------------------------


class BadRequest(Exception):
    """The request cannot be routed as it is: the client hears ``status`` and why."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class TooLarge(Exception):
    """A streamed upload passed ``--max-body`` as it streamed."""


# -- an attempt on an engine -----------------------------------------------------------


class Labelled(Protocol):
    label: str  # how logs and metrics name it (a target's ``worker/rank``)


T = TypeVar("T", bound=Labelled)


class Failed(Exception, Generic[T]):
    """An attempt (or one leg of a pair) on ``target`` failed before any byte reached the
    client: the retry rules decide whether it is tried again elsewhere."""

    def __init__(self, target: T, cause: str, message: str, side: Side | None = None) -> None:
        super().__init__(message)
        self.target = target
        self.cause = cause  # the metric label: connect, no_answer, status_503, ...
        self.message = message
        self.side = side  # P/D: which leg

    def __str__(self) -> str:
        return f"{self.side + ' ' if self.side else ''}{self.target.label}: {self.message}"


class UpstreamBroke(Exception):
    """The engine's answer broke off before any byte of it reached the client."""


class Answered(Exception):
    """A prefill engine answered with something other than success that the client is to
    hear itself (a request it refuses, or any answer on the last chance)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or "application/json"

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, headers={"Content-Type": self.content_type}
        )


# -- membership and discovery ----------------------------------------------------------


class Duplicate(ValueError):
    """A worker with this id or URL is registered already."""


class DiscoveryError(Exception):
    """The worker answered, but not as an engine we can route to."""


class Contradiction(DiscoveryError):
    """The worker contradicts its configuration, or reports a shape we cannot read:
    never route to it as it stands (asking again would give the same answer)."""


class EtcdError(Exception):
    """etcd could not be reached, or refused the call."""


class Compacted(EtcdError):
    """A watch asked for revisions etcd has compacted away: read everything again."""


class KubeError(Exception):
    """The API server could not be reached, or refused the call."""


class Gone(KubeError):
    """The watch asked for a version the server no longer keeps: list again."""


class PodError(ValueError):
    """The pod is ready but says something that cannot be a worker (a bad annotation)."""
