"""Each routed request's trace (OpenTelemetry) and its id (``X-Request-Id``).

A request's id is the client's ``X-Request-Id`` when it is fit (printable ASCII, at
most 128 characters), else one made here (uuid4, hex); it goes to the engine with every
attempt, back on the answer, and into every log line made while the request is handled
(``core/log_filter.py``). It lives in the request's task (a context variable, read in
0.03 us; an aiohttp request has a task of its own, and the tasks it starts inherit it).

Tracing is off unless ``--tracing``: then nothing of OpenTelemetry is imported, every
span is ``NO_SPAN``, and each hook is a call that returns at once. On, the router has a
``TracerProvider`` of its own (never the global one: two routers in one process keep
their traces apart), its spans batched (``BatchSpanProcessor``) to an OTLP/HTTP
exporter that reads the standard ``OTEL_EXPORTER_OTLP_*`` variables itself, the batches
``OTEL_BSP_*``, the resource ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``
(service.name "dprouter" unless they say otherwise). A request's spans:

- the root (SERVER), its parent the client's ``traceparent``/``tracestate``;
- "admission": the time it queued at the front door;
- "decision", one per pick of a policy: its policy, the target, the load seen there,
  the candidates and which attempt it was (P/D: one per side);
- "attempt", one per engine call (P/D: one per leg), its ``traceparent`` sent to the
  engine: the target, the status, why it failed (a retry is a sibling attempt);
- "relay", under the attempt whose answer reaches the client: bytes, reads, and the
  seconds from the engine's headers to the first byte of the body.

A request whose trace the sampler leaves out (``OTEL_TRACES_SAMPLER``, or a client's
``traceparent`` not sampled under a parent-based sampler) has its root and nothing
below it: the engine gets the root's context, marked not sampled, and no span is made
that would not be recorded (they cost 30-40 us a request, where the root costs 25).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from dprouter.core.errors import Failed
from dprouter.core.headers import REQUEST_ID_HEADER
from dprouter.core.log_filter import REQUEST_ID, tag_requests

if TYPE_CHECKING:  # never imported at run time unless tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

Value = str | int | float | bool
Watch = Callable[[bytes], None]
LONGEST_ID = 128  # characters of a client's request id kept; a longer one is replaced
NULL: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def fit_request_id(given: str | None) -> str | None:
    """``given`` if it may serve as a request id in headers and log lines, else None."""
    if given and len(given) <= LONGEST_ID and given.isascii() and given.isprintable():
        return given
    return None


def new_request_id() -> str:
    """A uuid4 in hex: ``uuid.uuid4().hex`` builds a UUID object (2 us); this, 0.6 us."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    return raw.hex()


def request_id(request: web.Request) -> str:
    """The id of the request this task handles: decided on the first call (the client's
    ``X-Request-Id`` if fit, else a new one), the same on every later one."""
    rid = REQUEST_ID.get()
    if rid is None:
        rid = fit_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
        REQUEST_ID.set(rid)
    return rid


class Chosen(Protocol):
    """What a decision span reads of the target a policy chose (``fleet`` ``Target``)."""

    @property
    def label(self) -> str: ...
    @property
    def load(self) -> int: ...
    @property
    def token_load(self) -> int: ...


class Counted(Protocol):
    """What counts a request on its target (``fleet`` ``Outstanding``)."""

    @property
    def claimed(self) -> bool: ...
    @property
    def requests(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class Span:
    """A span of a request's trace, or none: with tracing off every span is ``NO_SPAN``,
    whose methods do nothing. A block (``with``) ends it, and notes why it failed."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def set(self, key: str, value: Value) -> None:
        """An attribute of the span."""

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """This span as the parent of what the engine does: ``traceparent`` in ``headers``
        (and ``tracestate``, baggage, by ``OTEL_PROPAGATORS``)."""

    def relay(self) -> Span:
        """The span of relaying this attempt's answer to the client, under this one."""
        return self

    def watching(self, watch: Watch | None) -> Watch | None:
        """``watch``, and the relay's count of what passes (a stream's bytes and reads)."""
        return watch

    def passed(self, size: int, reads: int = 1) -> None:
        """``size`` bytes of the answer passed in ``reads`` reads (a whole answer: one)."""


NO_SPAN = Span()


class Passing(Span):
    """An engine call of a request whose trace is not recorded: no span of its own, the
    root's context (not sampled) passed on to the engine, so that the engine's own
    tracing follows the same decision."""

    __slots__ = ("root", "tracing")

    def __init__(self, root: OtelSpan, tracing: Tracing) -> None:
        self.root = root
        self.tracing = tracing

    def inject(self, headers: MutableMapping[str, str]) -> None:
        self.tracing.inject(self.root, headers)


class Live(Span):
    """A span of OpenTelemetry's, while tracing is on."""

    __slots__ = ("began", "bytes", "reads", "recording", "span", "tracing")

    def __init__(self, span: OtelSpan, tracing: Tracing) -> None:
        self.span = span
        self.tracing = tracing
        self.recording = span.is_recording()  # False: sampled out, and so is all below it
        self.began = time.monotonic()
        self.bytes = self.reads = 0

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.reads:
            self.span.set_attribute("dprouter.bytes", self.bytes)
            self.span.set_attribute("dprouter.reads", self.reads)
        if e is not None:
            self.tracing.failed(self.span, e)
        self.span.end()

    def set(self, key: str, value: Value) -> None:
        self.span.set_attribute(key, value)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        self.tracing.inject(self.span, headers)

    def relay(self) -> Span:
        return self.tracing.child(self.span, "relay", {})

    def watching(self, watch: Watch | None) -> Watch | None:
        def counted(chunk: bytes) -> None:
            self.passed(len(chunk))
            if watch is not None:
                watch(chunk)

        return counted

    def passed(self, size: int, reads: int = 1) -> None:
        if not self.reads:
            self.span.add_event("first byte")
            self.span.set_attribute("dprouter.first_byte_s", time.monotonic() - self.began)
        self.bytes += size
        self.reads += reads


SPAN = web.RequestKey("dprouter.span", Live)  # the request's root span, while tracing is on


class Tracing:
    """The router's tracing, on or off (``--tracing``), and the tag of its log lines
    with request ids (``core/log_filter.py``), on either way. One per router, passed to
    every flow; ``stop`` flushes what is left to export."""

    def __init__(self, on: bool) -> None:
        tag_requests()
        self.on = on
        self.tracer: Tracer | None = None
        self.provider: TracerProvider | None = None
        if on:
            self.provider, self.tracer = _provider()
            from opentelemetry import propagate, trace

            self._extract = propagate.extract
            self._inject = propagate.inject
            self._in_context = trace.set_span_in_context
            self._status = trace.Status
            self._error = trace.StatusCode.ERROR
            self._server = trace.SpanKind.SERVER
            self._client = trace.SpanKind.CLIENT

    def request(self, request: web.Request, kind: str) -> contextlib.AbstractContextManager[None]:
        """The root span of one routed request (SERVER), for the block: its parent the
        request's W3C ``traceparent``/``tracestate``, the request's id an attribute, and
        itself kept in the request (``SPAN``) for the spans below it. A block that does
        nothing when tracing is off, or when the request has its root already (the
        front door made it, and the proxy asks again)."""
        if self.tracer is None or SPAN in request:
            return NULL
        return self._root(request, kind)

    def admission(
        self, request: web.Request, started_ns: int, attributes: Mapping[str, str | int | float]
    ) -> None:
        """A finished "admission" span under the request's root, from ``started_ns``
        (``time.time_ns()``, OpenTelemetry's clock) to now: the time it queued at the
        front door, and ``attributes`` (tenant, class, outcome, ...)."""
        if self.tracer is None or (root := self._recorded(request)) is None:
            return
        span = self.tracer.start_span(
            "admission", self._in_context(root), attributes=attributes, start_time=started_ns
        )
        span.end()

    def clock(self) -> int:
        """Now, for a span that starts before what it records is known (0 when off)."""
        return 0 if self.tracer is None else time.time_ns()

    def decision(
        self,
        request: web.Request,
        started_ns: int,
        policy: str,
        target: Chosen,
        candidates: int,
        attempt: int,
        side: str = "regular",
        counted: Counted | None = None,
    ) -> None:
        """A finished "decision" span, from ``started_ns`` (``clock``) to now: ``policy``
        chose ``target`` among ``candidates`` on the ``attempt``-th attempt (0: the first)
        for ``side``, and the load it saw there: the board's, less this request where
        ``counted`` already counts it (claimed with the pick)."""
        if self.tracer is None or (root := self._recorded(request)) is None:
            return
        load, tokens = target.load, target.token_load
        if counted is not None and counted.claimed:
            load, tokens = load - counted.requests, tokens - counted.tokens
        attributes: dict[str, Value] = {
            "dprouter.policy": policy,
            "dprouter.target": target.label,
            "dprouter.load": load,
            "dprouter.token_load": tokens,
            "dprouter.candidates": candidates,
            "dprouter.attempt": attempt,
            "dprouter.side": side,
        }
        span = self.tracer.start_span(
            "decision", self._in_context(root), attributes=attributes, start_time=started_ns
        )
        span.end()

    def attempt(
        self, request: web.Request, target: str, attempt: int, side: str = "regular"
    ) -> Span:
        """The span of one call to an engine (CLIENT) under the request's root: ``target``
        (its label), the ``attempt``-th of the request, ``side`` of a pair. Its block
        notes a failure (``Failed``: the cause) and ends it; ``inject`` it into the
        headers sent, ``set`` the answer's status. A request sampled out gets a
        ``Passing``: the engine is told so, and nothing is recorded."""
        if self.tracer is None or (root := request.get(SPAN)) is None:
            return NO_SPAN
        if not root.recording:
            return Passing(root.span, self)
        attributes: dict[str, Value] = {
            "dprouter.target": target,
            "dprouter.attempt": attempt,
            "dprouter.side": side,
        }
        return self.child(root.span, "attempt", attributes, self._client)

    async def serve(
        self, request: web.Request, kind: str, answering: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """``answering`` under the request's root span (``request``), its id decided first
        (``request_id``) and put on the answer (a stream's, by the relay)."""
        request_id(request)
        with self.request(request, kind):
            return self.answered(request, await answering)

    def answered(self, request: web.Request, answer: web.StreamResponse) -> web.StreamResponse:
        """``answer``, named by the request's id (unless already sent: a stream's is named
        by the relay), its status on the root span: for every answer, the router's own
        refusals too."""
        if not answer.prepared:
            answer.headers[REQUEST_ID_HEADER] = request_id(request)
        if self.tracer is not None and SPAN in request:
            request[SPAN].set("http.response.status_code", answer.status)
        return answer

    async def stop(self) -> None:
        """Export what is left, then stop (in a thread: the exporter's calls block, and
        the collector may answer on this very loop, a test's receiver say)."""
        if self.provider is not None:
            await asyncio.to_thread(self.provider.shutdown)

    # -- while on ----------------------------------------------------------------------

    def _recorded(self, request: web.Request) -> OtelSpan | None:
        """The request's root span if its trace is recorded (sampled), else None."""
        root = request.get(SPAN)
        return root.span if root is not None and root.recording else None

    @contextlib.contextmanager
    def _root(self, request: web.Request, kind: str) -> Iterator[None]:
        assert self.tracer is not None
        resource = request.match_info.route.resource
        route = request.path if resource is None else resource.canonical
        attributes: dict[str, Value] = {
            "http.request.method": request.method,
            "http.route": route,
            "url.path": request.path,
            "dprouter.kind": kind,
            "dprouter.request_id": request_id(request),
        }
        span = self.tracer.start_span(
            f"{request.method} {route}",
            self._extract(request.headers),
            self._server,
            attributes=attributes,
        )
        root = request[SPAN] = Live(span, self)
        with root:
            yield

    def child(
        self, parent: OtelSpan, name: str, attributes: Mapping[str, Value], kind: Any = None
    ) -> Live:
        assert self.tracer is not None
        context = self._in_context(parent)
        if kind is None:
            return Live(self.tracer.start_span(name, context, attributes=attributes), self)
        return Live(self.tracer.start_span(name, context, kind, attributes=attributes), self)

    def inject(self, span: OtelSpan, headers: MutableMapping[str, str]) -> None:
        self._inject(headers, self._in_context(span))

    def failed(self, span: OtelSpan, e: BaseException) -> None:
        """What ended ``span`` early: an attempt's failure, a client that left, a bug."""
        if isinstance(e, Failed):
            # a pair's leg ended by its other leg's failure says so, not that leg's cause
            attrs = getattr(span, "attributes", None) or {}
            side = attrs.get("dprouter.side")
            theirs = e.side is not None and side not in (None, "regular", e.side)
            span.set_attribute("dprouter.failure", f"{e.side}_failed" if theirs else e.cause)
            span.set_status(self._status(self._error, str(e)))
        elif isinstance(e, asyncio.CancelledError):
            span.set_attribute("dprouter.failure", "cancelled")  # the client left, or a stop
        else:
            span.record_exception(e)
            span.set_status(self._status(self._error, f"{type(e).__name__}: {e}"))


# what ``_provider`` imports, from the ``tracing`` extra
NEEDED = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def missing_modules() -> list[str]:
    """The modules of ``NEEDED`` this environment cannot import. Looking a submodule up
    imports its parents, and a missing parent raises rather than answering None."""
    absent = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            absent.append(name)
    return absent


def _provider() -> tuple[TracerProvider, Tracer]:
    """A provider of the router's own, its spans batched to OTLP over HTTP (protobuf),
    every setting from the standard environment variables."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = SERVICE_NAME in OTELResourceDetector().detect().attributes
    resource = Resource.create({} if named else {SERVICE_NAME: "dprouter"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider, provider.get_tracer("dprouter")
