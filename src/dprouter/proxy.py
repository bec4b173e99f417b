"""The request path: parse, pick a target, write its rank, forward, relay the answer.

Read as a sequence of steps in ``Proxy.handle``. Before the first byte reaches
the client a failed attempt -- no connection, no answer in time, a retryable
status, a body that breaks off -- is tried again on another target; the last
chance passes the engine's own answer through. The target's outstanding count
is held for exactly as long as its attempt runs, client disconnects included,
and a disconnect closes the upstream connection so the engine stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from dprouter import dialects
from dprouter.breaker import Breakers
from dprouter.cancel import Aborter, ensure_rid
from dprouter.config import RouterConfig
from dprouter.metrics import RouterMetrics
from dprouter.parse import BadRequest, Incoming, Kind, parse
from dprouter.policies import Policy, RequestInfo
from dprouter.registry import Registry
from dprouter.relay import CUT, HOP_BY_HOP, UpstreamBroke, error, relay
from dprouter.targets import DialectName, Outstanding, Target, Worker

# never forwarded: hop-by-hop headers, SGLang's override headers (see dialects), and
# unless asked, the client's API key (it is not the engine's)
NOT_FORWARDED = HOP_BY_HOP | dialects.OVERRIDE_HEADERS
NOT_FORWARDED_WITH_AUTH = NOT_FORWARDED | {"authorization"}
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
NO_TIMER = contextlib.nullcontext()
RETRY_BACKOFF_MAX = 1.0  # seconds, the longest wait between two attempts
REST_MAX = 60.0  # seconds, the longest pause a Retry-After can ask of a target


def retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds form; dates are ignored)."""
    if value is None or not value.strip().isdigit():
        return 0.0
    return min(float(value), REST_MAX)


async def back_off(attempt: int, base: float, jitter: random.Random) -> None:
    """Wait before attempt ``attempt`` (1, 2, ...): capped exponential backoff with jitter,
    so that a struggling fleet breathes and retries do not arrive in lock-step."""
    wait = min(base * 2 ** (attempt - 1), RETRY_BACKOFF_MAX)
    await asyncio.sleep(wait * jitter.uniform(0.5, 1.0))


def untried(
    pool: Sequence[Target], tried: list[Target], unopened: list[Target]
) -> Sequence[Target]:
    """The targets of ``pool`` not yet tried. Once each has been, those whose connection
    never opened in time go again (and leave ``unopened``): the request never reached them,
    and in a burst the router's own backlog can outlast the connect timer while the
    engine is fine."""
    left = tuple(t for t in pool if t not in tried) if tried else pool
    if left:
        return left
    again = tuple(dict.fromkeys(unopened))
    unopened.clear()
    return again


Admitted = tuple[bytes, Incoming, CIMultiDict[str], int | None, bool]


async def admit(
    request: web.Request, kind: Kind, config: RouterConfig, metrics: RouterMetrics
) -> Admitted | web.Response:
    """Read and check a request: ``(raw body, parsed, headers to forward, rank a trusted
    client pinned, whether the body changed)``, or the error to answer with."""
    try:
        raw = await request.read()
        incoming = parse(raw, kind, request.headers)
        dropped = NOT_FORWARDED if config.forward_authorization else NOT_FORWARDED_WITH_AUTH
        # a multidict: a header the client repeated goes on repeated, as it came
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in dropped
        )
        if config.trust_client_rank:
            return raw, incoming, headers, dialects.client_rank(headers, incoming.body), False
        return raw, incoming, headers, None, dialects.strip_client_rank(headers, incoming.body)
    except web.HTTPRequestEntityTooLarge:
        metrics.rejected.labels("too_large").inc()
        message = f"request body exceeds {config.max_body} bytes"
        return error(413, message, "invalid_request_error")
    except BadRequest as exc:
        metrics.rejected.labels("bad_request").inc()
        return error(exc.status, exc.message, "invalid_request_error", exc.param)


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        policy: Policy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        unreachable: Callable[[Worker], None] = lambda w: None,
        breakers: Breakers | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.unreachable = unreachable  # a worker refused a connection: take it out
        self.breakers = breakers or Breakers(registry)
        self.aborter = Aborter(session)  # SGLang: a client that leaves aborts its request
        self.jitter = random.Random(config.seed)
        # the answer must start within --first-byte-timeout; off: no timer per request
        fb = config.first_byte_timeout
        self.first_byte = (lambda: asyncio.timeout(fb)) if fb else (lambda: NO_TIMER)

    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        admitted = await admit(request, kind, self.config, self.metrics)
        if not isinstance(admitted, tuple):  # an error answer (tuple: no ABC check)
            return admitted
        raw, incoming, headers, pinned, changed = admitted
        pool = self._pool(kind, incoming, pinned)
        if isinstance(pool, web.Response):
            return pool
        tried: list[Target] = []
        unopened: list[Target] = []  # tried, but no connection opened: the request never left
        last = "no attempt was made"
        refused = 0  # attempts whose worker refused the connection
        info = RequestInfo(
            incoming.key,
            incoming.text,
            incoming.tokens,
            started,
            (kind == "generate", incoming.model, pinned),
        )
        for attempt in range(self.config.attempts):
            candidates = untried(pool, tried, unopened)
            if not candidates:
                break
            if attempt:
                await back_off(attempt, self.config.retry_backoff, self.jitter)
                info = replace(info, attempt=attempt)
            target = self.policy.select(candidates, info)
            tried.append(target)
            series = self.metrics.series(target)
            last_chance = attempt + 1 == self.config.attempts or len(candidates) == 1
            dialect = target.worker.dialect or "vllm"
            # each attempt writes its own rank (vLLM's in a header, SGLang's in the body)
            sent = headers.copy()
            body = dict(incoming.body) if dialect == "sglang" else incoming.body
            rid, named = ensure_rid(body) if dialect == "sglang" else (None, False)
            if dialects.write_rank(dialect, target.rank, sent, body) or changed or named:
                data = orjson.dumps(body)
            else:
                data = raw  # untouched: forward the client's bytes as they came
            with Outstanding(target, incoming.tokens), self.aborter.on_cancel(target.worker, rid):
                try:
                    async with self.first_byte():
                        upstream = await self.session.post(
                            target.worker.url + request.path_qs, data=data, headers=sent
                        )
                except aiohttp.ClientConnectorError as exc:
                    series.failed("connect")
                    self.unreachable(target.worker)
                    last = f"{target.label}: cannot connect ({exc.os_error})"
                    refused += 1
                    continue
                except aiohttp.ConnectionTimeoutError:
                    series.failed("connect_timeout")
                    self.breakers.failed(target)
                    unopened.append(target)
                    last = f"{target.label}: no connection within {self.config.connect_timeout:g} s"
                    continue
                except (aiohttp.ClientError, TimeoutError) as exc:
                    series.failed("no_answer")
                    self.breakers.failed(target)
                    last = f"{target.label}: {type(exc).__name__} {exc}".strip()
                    continue
                status = upstream.status
                if status >= 500:  # 408 and 429 say busy, not broken: no breaker count
                    self.breakers.failed(target)
                rest = retry_after(upstream.headers.get("Retry-After"))
                if rest and status in (429, 503):  # the engine asked for a pause: give it one
                    self.breakers.rest(target, rest)
                if status in RETRY_STATUS and not last_chance:
                    series.failed(f"status_{status}")
                    last = f"{target.label}: HTTP {status}"
                    upstream.close()
                    continue
                try:
                    answer = await relay(request, upstream, target, series, started)
                except UpstreamBroke as exc:
                    series.failed("broken_body")
                    self.breakers.failed(target)
                    last = f"{target.label}: answer broke off ({exc})"
                    continue
                if answer.get(CUT):
                    self.breakers.failed(target)
                elif status < 500:
                    self.breakers.succeeded(target)
                return answer
        self.metrics.rejected.labels("upstream_failed").inc()
        if refused == len(tried):  # nothing is up: unavailable, not a bad answer
            message = f"no worker could be reached ({len(tried)} tried); last: {last}"
            return error(503, message, "ServiceUnavailableError")
        return error(502, f"every attempt failed; last: {last}", "upstream_error")

    def _pool(
        self, kind: Kind, incoming: Incoming, pinned: int | None
    ) -> Sequence[Target] | web.Response:
        snapshot = self.registry.snapshot
        dialect: DialectName | None = "sglang" if kind == "generate" else None  # SGLang's own
        pool = snapshot.pool("regular", incoming.model, dialect)
        if pool and pinned is not None:
            # a rankless target (DP-aware off) passes the client's rank to its engine
            pool = tuple(t for t in pool if t.rank is None or t.rank == pinned)
            if not pool:
                return error(400, f"no target has dp_rank {pinned}", "invalid_request_error")
        if pool:
            return pool
        if incoming.model is not None and snapshot.pool("regular", None, dialect):
            self.metrics.rejected.labels("unknown_model").inc()
            message = f"The model `{incoming.model}` does not exist."
            return error(404, message, "NotFoundError", "model")
        self.metrics.rejected.labels("no_target").inc()
        what = "SGLang worker for /generate" if dialect else "worker"
        return error(503, f"no ready {what} to route to", "ServiceUnavailableError")
