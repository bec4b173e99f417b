"""One set of retry rules and one retry loop for every attempt: a plain request's, a
rankless one's, or a leg of a P/D pair.

Before any byte reaches the client, a failed attempt is tried again elsewhere:

- no connection, a reset, or no answer in time: every rank of that worker is out of
  the request's remaining attempts (one engine behind them all); a refused
  connection also takes the worker out of the snapshot until it answers again,
  and counts against no breaker (the worker is down, not a rank broken);
- 408 and 429 say busy, not broken: retried, no breaker count;
- a 5xx counts against the rank's breaker, retried or passed through;
- ``Retry-After`` on 429/503 rests the target for that long;
- an engine that says it does not serve the request's model or LoRA adapter (its list
  changed behind the router's back: vLLM's 404 "does not exist", SGLang's 400 "never
  been loaded") has its list read again (``relist``), and the request goes once to
  another worker of its pool, counting against no breaker (``Attempts.served``);
- the last chance passes the engine's own answer through;
- when every attempt was refused, the client hears 503 (nothing is up), else 502.

Each flow says what one attempt is (``Attempts.run``); sending it is ``upstream``'s.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import aiohttp
from aiohttp import web

from dprouter.core.errors import Failed, error
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import RequestInfo
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.pools import Pools
from dprouter.proxy.relay import was_cut

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
BUSY = frozenset({408, 429})
RETRY_BACKOFF_MAX = 1.0  # seconds, the longest wait between two attempts
REST_MAX = 60.0  # seconds, the longest pause a Retry-After can ask of a target
WORKER_DOWN = frozenset({"connect", "connect_timeout", "no_answer"})  # all its ranks are out
NOT_SERVED = "not_served"  # the worker's engine does not serve the model: all its ranks are out
# what the engines answer for a model or adapter they do not serve: vLLM 0.32's 404
# (``_check_model``), SGLang 0.5.23's 400 (``_resolve_lora_path``, ``LoRARegistry.acquire``,
# LoRA not enabled); the body is read only for these statuses, and only when short
NOT_SERVED_STATUS = frozenset({400, 404})
NOT_SERVED_WORDS = (
    b"` does not exist",  # vLLM: "The model `X` does not exist" (not SGLang's session ids)
    b"has never been loaded",
    b"adapters are not loaded",
    b"but LoRA is not enabled",
)
NOT_SERVED_BODY = 1 << 16
# one attempt over the targets left of each pool; ``Failed``: to be tried elsewhere
Attempt = Callable[[Pools], Awaitable[web.StreamResponse]]


def retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds form; dates are ignored)."""
    if value is None or not value.strip().isdigit():
        return 0.0
    return min(float(value), REST_MAX)


class Retry:
    """The retry rules a router applies to every attempt: how many, how far apart, what an
    answer's status leads to. ``suspect``: a worker refused a connection, out until it
    answers again."""

    def __init__(
        self,
        breakers: Breakers,
        metrics: RouterMetrics,
        suspect: Callable[[Worker], None],
        limit: int,
        backoff: float,
        seed: int = 0,
        relist: Callable[[Worker], None] | None = None,
    ) -> None:
        self.breakers = breakers
        self.metrics = metrics
        self.suspect = suspect
        self.relist = relist  # read a worker's model list again (``fleet/model_lists``)
        self.limit = limit
        self.backoff = backoff
        self.jitter = random.Random(seed)

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

    __slots__ = ("last", "refused", "relisted", "rules", "shunned", "tried", "unopened")

    def __init__(self, rules: Retry) -> None:
        self.rules = rules
        self.tried: list[Target] = []  # one per failed attempt (of a pair: the side that failed)
        self.unopened: list[Target] = []  # tried, but no connection opened: the request never left
        self.shunned: set[Worker] = set()  # refused, reset or silent: all its ranks are out
        self.refused = 0
        self.relisted = False  # an engine said it does not serve the model (once a request)
        self.last = "no attempt was made"

    async def run(self, pools: Pools, one: Attempt, what: str = "attempt") -> web.StreamResponse:
        """The retry loop of every flow: ``one`` attempt over the targets left of each pool,
        again after a pause while it fails (``Failed``) and targets and attempts are left;
        then the client hears why (``give_up``)."""
        candidates = pools  # before a failure, every target of each pool is left
        while all(candidates):
            try:
                return await one(candidates)
            except Failed as failure:
                self.failed(failure)
            candidates = tuple(map(self.candidates, pools))
            if all(candidates):
                await self.pause()
        return self.give_up(what)

    def numbered(self, info: RequestInfo) -> RequestInfo:
        """``info`` as a policy is to see it on this attempt: a retry says which it is."""
        return replace(info, attempt=len(self.tried)) if self.tried else info

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

    async def served(
        self, target: Target, upstream: aiohttp.ClientResponse, candidates: Sequence[Target]
    ) -> None:
        """The rule for an engine that does not serve the request's model or adapter (the
        answer's body, read here, is relayed as read): its list is read again, and
        ``Failed`` sends the request once to another worker among ``candidates``; with none
        left, or a second time, the engine's answer passes."""
        if upstream.status not in NOT_SERVED_STATUS or self.relisted:
            return
        length = upstream.content_length
        if length is None or length > NOT_SERVED_BODY:
            return  # not the engines' short JSON refusal
        try:
            body = await upstream.read()  # kept by the response: ``relay`` sends it
        except (aiohttp.ClientError, TimeoutError):
            return  # the relay finds it broken too, and says so
        if not any(words in body for words in NOT_SERVED_WORDS):
            return
        self.relisted = True
        if self.rules.relist is not None:
            self.rules.relist(target.worker)
        more = len(self.tried) + 1 < self.rules.limit  # within the retry rules' attempts
        if more and any(t.worker is not target.worker for t in candidates):
            upstream.release()
            why = f"HTTP {upstream.status}: {target.worker.id} does not serve the model asked for"
            raise Failed(target, NOT_SERVED, why)

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
        elif not cause.startswith("status_") and cause != NOT_SERVED:  # judged as it came
            self.rules.breakers.failed(target)
        if cause == "connect_timeout":
            self.unopened.append(target)
        if cause in WORKER_DOWN or cause == NOT_SERVED:
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
