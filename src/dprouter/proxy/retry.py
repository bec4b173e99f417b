"""One set of rules for every attempt, a plain request's or a leg of a P/D pair.

Before any byte reaches the client, a failed attempt is tried again elsewhere:

- no connection, a reset, or no answer in time: every rank of that worker is out of
  the request's remaining attempts (one engine behind them all); a refused
  connection also takes the worker out of the snapshot until it answers again,
  and counts against no breaker (the worker is down, not a rank broken);
- 408 and 429 say busy, not broken: retried, no breaker count;
- a 5xx counts against the rank's breaker, retried or passed through;
- ``Retry-After`` on 429/503 rests the target for that long;
- the last chance passes the engine's own answer through;
- when every attempt was refused, the client hears 503 (nothing is up), else 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from collections.abc import Callable, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from dprouter.core.errors import Failed, error
from dprouter.core.types import Side
from dprouter.fleet.board import Board
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.targets import Target, Worker
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.proxy.relay import was_cut
from dprouter.proxy.upload import Upload

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
BUSY = frozenset({408, 429})
NO_TIMER = contextlib.nullcontext()
RETRY_BACKOFF_MAX = 1.0  # seconds, the longest wait between two attempts
REST_MAX = 60.0  # seconds, the longest pause a Retry-After can ask of a target
LARGE = 1 << 20  # bytes: aiohttp warns of a body this large sent as one piece
WORKER_DOWN = frozenset({"connect", "connect_timeout", "no_answer"})  # all its ranks are out


def retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds form; dates are ignored)."""
    if value is None or not value.strip().isdigit():
        return 0.0
    return min(float(value), REST_MAX)


class Rules:
    """What the router shares across requests: the session, breakers, metrics, timers."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        breakers: Breakers,
        metrics: RouterMetrics,
        suspect: Callable[[Worker], None],
        limit: int,
        backoff: float,
        connect_timeout: float,
        first_byte_timeout: float,
        seed: int = 0,
        output_budget: str = "typical",
        board: Board | None = None,
    ) -> None:
        self.session = session
        self.breakers = breakers
        self.metrics = metrics
        self.suspect = suspect  # a worker refused a connection: out until it answers
        self.limit = limit
        self.backoff = backoff
        self.connect_timeout = connect_timeout
        self.jitter = random.Random(seed)
        # typical output lengths, learned from the answers (``cap``: max_tokens as sent)
        self.output = OutputEstimate(learned=output_budget == "typical", board=board)
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

    def judge(self, target: Target, upstream: aiohttp.ClientResponse, last_chance: bool) -> None:
        """The rules for an answer's status; ``Failed`` when it is to be tried elsewhere."""
        status = upstream.status
        if status >= 500:
            self.breakers.failed(target)
        rest = retry_after(upstream.headers.get("Retry-After"))
        if rest and status in (429, 503):  # the engine asked for a pause: give it one
            self.breakers.rest(target, rest)
        if status in RETRY_STATUS and not last_chance:
            upstream.close()
            raise Failed(target, f"status_{status}", f"HTTP {status}")

    def start(self) -> Attempts:
        return Attempts(self)


class Attempts:
    """One request's attempts: which targets are left, and what the client hears at the end.
    A failed attempt is tried again elsewhere until ``limit`` attempts have failed."""

    __slots__ = ("last", "refused", "rules", "shunned", "tried", "unopened")

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.tried: list[Target] = []  # one per failed attempt (of a pair: the side that failed)
        self.unopened: list[Target] = []  # tried, but no connection opened: the request never left
        self.shunned: set[Worker] = set()  # refused, reset or silent: all its ranks are out
        self.refused = 0
        self.last = "no attempt was made"

    def candidates(self, pool: Sequence[Target]) -> Sequence[Target]:
        """The targets of ``pool`` left to try; none once ``limit`` attempts have failed.
        When none is left, those whose connection never opened in time go again (once): the
        request never reached them, and in a burst the router's own backlog can outlast the
        connect timer while the engine is fine."""
        if not self.tried:
            return pool
        if len(self.tried) >= self.rules.limit:
            return ()
        left = tuple(t for t in pool if t not in self.tried and t.worker not in self.shunned)
        if left:
            return left
        again = tuple(t for t in dict.fromkeys(self.unopened) if t in pool)
        self.unopened = [t for t in self.unopened if t not in again]
        return again

    def last_chance(self, candidates: Sequence[Target]) -> bool:
        """No other target would be tried after this one: its answer reaches the client."""
        return len(self.tried) + 1 >= self.rules.limit or len(candidates) == 1

    async def pause(self) -> None:
        """Capped exponential backoff with jitter before a retry: a struggling fleet
        breathes, and retries do not arrive in lock-step."""
        wait = min(self.rules.backoff * 2 ** (len(self.tried) - 1), RETRY_BACKOFF_MAX)
        await asyncio.sleep(wait * self.rules.jitter.uniform(0.5, 1.0))

    def failed(self, failure: Failed[Target]) -> None:
        target, cause = failure.target, failure.cause
        self.rules.metrics.series(target).failed(cause)
        self.tried.append(target)
        self.last = str(failure)
        if cause == "connect":  # the worker is down, not one rank broken: no breaker count
            self.refused += 1
            self.rules.suspect(target.worker)
        elif not cause.startswith("status_"):  # a status was judged as it arrived
            self.rules.breakers.failed(target)
        if cause == "connect_timeout":
            self.unopened.append(target)
        if cause in WORKER_DOWN:
            self.shunned.add(target.worker)

    def answered(self, answer: web.StreamResponse, *targets: Target) -> None:
        """The answer reached the client: a stream cut after it began counts against the
        target that sent it (the last one); a good answer closes every breaker involved."""
        breakers = self.rules.breakers
        if was_cut(answer):
            for t in targets[:-1]:
                breakers.succeeded(t)
            breakers.failed(targets[-1])
        elif answer.status < 500:
            for t in targets:
                breakers.succeeded(t)

    def give_up(self, what: str = "attempt") -> web.Response:
        self.rules.metrics.rejected.labels("upstream_failed").inc()
        tries = len(self.tried)
        if tries and self.refused == tries:  # nothing is up: unavailable, not a bad answer
            message = f"no worker could be reached ({tries} tried); last: {self.last}"
            return error(503, message)
        return error(502, f"every {what} failed; last: {self.last}")
