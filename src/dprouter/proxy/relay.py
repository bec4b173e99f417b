"""Passing an engine's answer back to the client, unchanged and unbuffered.

A non-stream answer is read whole, then sent; if reading it fails nothing has
reached the client yet, so ``UpstreamBroke`` lets the caller try elsewhere.
An SSE stream is written read by read as it arrives; if the engine breaks it
off, the client gets an error event (on a line of its own) and ``[DONE]``, and
the answer is marked ``CUT`` so that the caller counts it against the target's
breaker (an engine that dies mid-stream, OOM-killed say, is as broken as one
answering 500, though the status already said 200).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from dprouter.core.errors import UpstreamBroke, grace_over, sse_error
from dprouter.core.headers import (
    HOP_BY_HOP,
    REQUEST_ID_HEADER,
    TARGET_HEADER,
    WEIGHT_VERSION_HEADER,
    without,
)
from dprouter.core.log_filter import REQUEST_ID
from dprouter.core.tracing import NO_SPAN, Span
from dprouter.fleet import weights
from dprouter.fleet.targets import Outstanding, Target, Worker
from dprouter.proxy.metrics import TargetSeries
from dprouter.proxy.read_timeout import take_over

SPEND = 16  # stream events (output tokens) spent off a request's count in one board write
CUT = web.ResponseKey("dprouter.cut", bool)  # set on a response whose stream broke off
STREAMING = web.RequestKey("dprouter.streaming", web.StreamResponse)  # the stream under way
# an answer of a worker stated its weights' version; the request was sent at that time
Stated = Callable[[Worker, str, float], None]


def was_cut(answer: web.StreamResponse) -> bool:
    """The answer's stream broke off after it began. An answer is a mapping whose ``get``
    of a missing key raises and catches a KeyError (2 us): most have no keys at all."""
    return len(answer) > 0 and answer.get(CUT, False)


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    target: Target,
    series: TargetSeries,
    started: float,
    counted: Outstanding | None = None,
    watch: Callable[[bytes], None] | None = None,
    extra: dict[str, str] | None = None,
    span: Span = NO_SPAN,
    stated: Stated | None = None,
) -> web.StreamResponse:
    """Answer ``request`` with ``upstream``; always closes or releases ``upstream``. A
    stream's events spend ``counted``'s output budget as they pass, and its chunks
    pass ``watch`` (the Responses API learns a stream's response id so). ``span``: the
    attempt's, under which the relay has its own. ``stated`` learns the weights' version
    an SGLang answer states (a whole one: in its header too; a stream: in its first
    event, after the headers went with the version known before)."""
    loop = asyncio.get_running_loop()
    # a multidict keeps repeated headers (two Set-Cookie, say) that a dict would merge away
    headers = without(upstream.headers, HOP_BY_HOP)
    headers[TARGET_HEADER] = target.label
    rid = REQUEST_ID.get()
    if rid is not None:  # the request's, not whatever id the engine answered with
        headers[REQUEST_ID_HEADER] = rid
    worker = target.worker
    if worker.dialect != "sglang":
        stated = None  # the others' answers state no version
    if extra:
        headers.update(extra)
    done = False
    try:
        with span.relay() as relayed:
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise UpstreamBroke(f"{type(exc).__name__} {exc}") from exc
                series.first_byte.observe(loop.time() - started)
                relayed.passed(len(body))
                version = _version(body, worker, started, stated)
                if version is not None:
                    headers[WEIGHT_VERSION_HEADER] = version
                resp: web.StreamResponse = web.Response(
                    status=upstream.status, body=body, headers=headers
                )
            else:
                if worker.weight_version is not None:
                    headers[WEIGHT_VERSION_HEADER] = worker.weight_version
                if stated is not None:
                    watch = _learning(watch, worker, started, stated)
                resp = web.StreamResponse(status=upstream.status, headers=headers)
                try:
                    await resp.prepare(request)
                    request[STREAMING] = resp  # begun: whatever happens, this is the answer
                    watch = relayed.watching(watch)  # off: ``watch`` as it was
                    await _stream(resp, upstream, target, series, started, counted, watch)
                    if was_cut(resp):
                        relayed.set("dprouter.failure", "stream_cut")
                except aiohttp.ClientConnectionResetError as exc:
                    # a write found the client's connection closing: it left, and the
                    # cancellation that says so comes a loop turn later. It ends as a client
                    # that leaves does (the engine's connection closed, an SGLang engine told
                    # to abort), not as a stream the engine cut, nor as a router error
                    raise asyncio.CancelledError from exc
        done = True
    finally:
        if done:
            upstream.release()
        else:
            upstream.close()  # client gone or engine broke: the engine sees the disconnect
    series.answered(upstream.status)
    series.duration.observe(loop.time() - started)
    return resp


def _version(body: bytes, worker: Worker, asked: float, stated: Stated | None) -> str | None:
    """The version a whole answer goes out with: the one it states, else the worker's."""
    if stated is not None:
        said = weights.stated(body)
        if said is not None:
            stated(worker, said, asked)
            return said
    return worker.weight_version


def _learning(
    watch: Callable[[bytes], None] | None, worker: Worker, asked: float, stated: Stated
) -> Callable[[bytes], None]:
    """``watch`` that also reads the version off the stream's first chunk (SGLang's
    /generate states it in every event; its OpenAI streams in none)."""
    first = True

    def passing(chunk: bytes) -> None:
        nonlocal first
        if first:
            first = False
            said = weights.stated(chunk)
            if said is not None:
                stated(worker, said, asked)
        if watch is not None:
            watch(chunk)

    return passing


async def _stream(
    resp: web.StreamResponse,
    upstream: aiohttp.ClientResponse,
    target: Target,
    series: TargetSeries,
    started: float,
    counted: Outstanding | None,
    watch: Callable[[bytes], None] | None,
) -> None:
    """Pass the stream on. An engine that breaks it off, or the end of the router's grace
    period, still leaves the client a well-formed ending: an error event and ``[DONE]``.

    Each event is taken for one output token (vLLM and SGLang stream a token per
    event by default) and spent off the request's count in batches of ``SPEND``:
    one board write per batch, not per token."""
    loop = asyncio.get_running_loop()
    # the last two chunks written (none is empty): their last two bytes, an event boundary
    # or not, are only looked at if the stream breaks; no slicing per read
    before, last = b"", b"\n\n"
    first = True
    events = 0
    idle = take_over(loop, upstream)  # the read timeout, kept for a clock read per read
    try:
        async for chunk in upstream.content.iter_any():
            if first:
                series.first_byte.observe(loop.time() - started)
                first = False
            await resp.write(chunk)
            if idle is not None:  # counted from here: a slow client is not an idle engine
                idle.last = loop.time()  # ``touch``, without a call per read
            if watch is not None:
                watch(chunk)
            before, last = last, chunk
            if counted is not None:
                events += chunk.count(b"\n\n")
                if events >= SPEND:
                    counted.spend(events)
                    events = 0
    except aiohttp.ClientConnectionResetError:
        raise  # a write to the client's connection, not a read from the engine: see relay
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        timed_out = isinstance(exc, TimeoutError)
        series.failed("stream_timeout" if timed_out else "stream_cut")
        message = (
            f"upstream {target.label} ran past the read or total timeout mid-stream"
            if timed_out
            else f"upstream {target.label} closed the stream before it finished"
        )
        resp[CUT] = True  # answered, though badly: the caller counts it against the target
        await _last_words(resp, (before + last)[-2:], sse_error(502, message))
        return
    except asyncio.CancelledError as exc:
        if grace_over(exc):  # else the client left: nobody to tell
            series.failed("shutdown")
            message = "the router stopped: its grace period ran out before this stream ended"
            await _last_words(resp, (before + last)[-2:], sse_error(503, message))
        raise  # on, so that the engine is told (connection closed, SGLang aborted)
    finally:
        if idle is not None:
            idle.stop()
    if counted is not None:
        counted.spend(max(events - 1, 0))  # the rest, less the closing [DONE]
    await resp.write_eof()


async def _last_words(resp: web.StreamResponse, tail: bytes, event: bytes) -> None:
    gap = b"" if tail == b"\n\n" else b"\n\n"  # end a half-written event first
    await resp.write(gap + event)
    await resp.write_eof()
