"""A client request as the router takes it in: parsed, checked, and what goes on.

Plain and P/D paths both start here, so a header or a field is dropped the same
way on every path: hop-by-hop headers, SGLang's override headers, the client's
API key unless the router forwards it, and a client's rank unless trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from dprouter.config import RouterConfig
from dprouter.core.errors import BadRequest, error
from dprouter.core.headers import HOP_BY_HOP, JSON_TYPE, without
from dprouter.core.types import Incoming, Kind
from dprouter.engines import dialects
from dprouter.proxy.limiter import ENTRY, Entry
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.parse import parse
from dprouter.proxy.upload import Upload, read_upload

NOT_FORWARDED = HOP_BY_HOP | dialects.OVERRIDE_HEADERS
NOT_FORWARDED_WITH_AUTH = NOT_FORWARDED | {"authorization"}  # a client's key is not the engine's


@dataclass(slots=True)
class ClientRequest:
    raw: bytes  # the body as it came: forwarded as is when nothing in it changes
    incoming: Incoming
    headers: CIMultiDict[str]  # to forward; a header the client repeated stays repeated
    pinned: int | None  # the rank a trusted client named (P/D: the decode's)
    pinned_prefill: int | None  # P/D: the prefill rank a trusted client named
    changed: bool  # a client rank field was removed from the body
    form: bool = False  # multipart/form-data: forwarded as it came, the rank in a header
    upload: Upload | None = None  # the rest of a form still to stream (``raw`` is its start)


def forwarded(request: web.Request, config: RouterConfig) -> CIMultiDict[str]:
    """The client's headers that go on to the engine."""
    dropped = NOT_FORWARDED if config.forward_authorization else NOT_FORWARDED_WITH_AUTH
    return without(request.headers, dropped)


async def read_request(
    request: web.Request,
    kind: Kind,
    config: RouterConfig,
    metrics: RouterMetrics,
    several: bool = True,
) -> ClientRequest | web.Response:
    """The request, or the error to answer with (nothing reached an engine). A form is
    read only up to where it can be routed (``several``: more than one model is served)."""
    try:
        form = kind == "audio"
        upload = None
        if form:
            incoming, raw, upload = await read_upload(request, config.max_body, several)
        else:
            raw = await request.read()
            incoming = parse(raw, kind, request.headers)
        entry: Entry | None = request.get(ENTRY)
        if entry is not None:  # the front door let it in: its caller, and their tokens
            incoming.caller = entry.caller
            refusal = entry.charge(incoming.tokens)
            if refusal is not None:
                metrics.limited.labels(entry.label, refusal.limit).inc()
                return refusal.answer()
        headers = forwarded(request, config)
        if not form:
            headers.update(JSON_TYPE)  # read as JSON, so sent as JSON, rewritten or not
        if upload is not None and request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)  # as declared: not chunked
        pinned = prefill = None
        if config.trust_client_rank:
            pinned = dialects.client_rank(headers, incoming.body)
            if config.pd is None:  # a rankless target passes the client's rank to its engine
                return ClientRequest(raw, incoming, headers, pinned, None, False, form, upload)
            # P/D: the ranks pick the pair; each leg then carries its own target's rank
            prefill = dialects.client_prefill_rank(incoming.body)
        changed = dialects.strip_client_rank(headers, incoming.body)
        return ClientRequest(raw, incoming, headers, pinned, prefill, changed, form, upload)
    except web.HTTPRequestEntityTooLarge:
        metrics.rejected.labels("too_large").inc()
        return error(413, f"request body exceeds {config.max_body} bytes")
    except BadRequest as exc:
        metrics.rejected.labels("bad_request").inc()
        return error(exc.status, exc.message, exc.param)
