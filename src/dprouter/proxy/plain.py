"""Plain requests: read, pick a target, write its rank, forward, relay the answer.

Read as a sequence of steps in ``Proxy.handle``; what a failed attempt leads to is
stated once, in ``retry``, for this path, the P/D one and the rankless one alike. The target's
outstanding count is held for exactly as long as its attempt runs, client
disconnects included, and a disconnect closes the upstream connection so the
engine stops generating (an SGLang engine is also told to abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

import orjson
from aiohttp import web

from dprouter.core.errors import Failed, UpstreamBroke, error
from dprouter.core.headers import REQUEST_ID_HEADER, TARGET_HEADER
from dprouter.core.tracing import request_id
from dprouter.core.types import DialectName, Incoming, Kind
from dprouter.engines import dialects
from dprouter.engines.kvevents.computing import being_computed, wait_computed
from dprouter.engines.kvevents.lookup import Found, Lookup
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.targets import Outstanding, Target
from dprouter.policies import Policy, RequestInfo
from dprouter.proxy.abort import ensure_rid
from dprouter.proxy.dispatch import HeldTooLong
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.output_budget import learn
from dprouter.proxy.parts import ProxyParts
from dprouter.proxy.pools import Pools, wait_pools
from dprouter.proxy.read import ClientRequest, read_request
from dprouter.proxy.relay import relay
from dprouter.proxy.retry import Attempts
from dprouter.proxy.routing_keys import Places, placeable
from dprouter.proxy.samples import merge, one_sample, part, shares, splittable
from dprouter.proxy.upload import Upload, several_models


class Proxy:
    """Plain requests: one target of the policy's choosing per attempt."""

    def __init__(
        self,
        parts: ProxyParts,
        policy: Policy,
        placer: Places | None = None,
        lock: BoardLock | None = None,
    ) -> None:
        self.parts = parts
        self.policy = policy
        self.placer = placer  # several processes or replicas: manual's keys are placed once
        self.lock = lock  # several serving processes: one decision at a time
        self.lookup: Lookup | None = None  # a policy that needs tokens: what targets hold
        self.splits = parts.config.samples == "split"  # a request's n samples over targets

    async def handle(
        self, request: web.Request, kind: Kind, dialect: DialectName | None = None
    ) -> web.StreamResponse:
        """``dialect``: only workers of that dialect serve this path (None: any)."""
        return await self.parts.tracing.serve(request, kind, self._handle(request, kind, dialect))

    async def _handle(
        self, request: web.Request, kind: Kind, dialect: DialectName | None
    ) -> web.StreamResponse:
        if kind == "generate":
            dialect = "sglang"  # SGLang's own
        p = self.parts
        started = asyncio.get_running_loop().time()
        several = kind == "audio" and several_models(p.registry.snapshot, dialect)
        client = await read_request(request, kind, p.config, p.metrics, several)
        if isinstance(client, web.Response):
            return client
        p.output.apply(client.incoming)  # counted by its likely output, not its cap
        pools = await wait_pools(
            request,
            p.registry,
            p.metrics,
            ("regular",),
            p.registry.snapshot.named(client.incoming.model, client.incoming.body.get("lora_path")),
            p.config.hold_wait,
            dialect,
            None if client.pinned is None else {"regular": client.pinned},
            p.monitor.read_versions,
        )
        if isinstance(pools, web.Response):
            return pools
        pool = pools[0]
        if self.splits and splittable(client.incoming, kind, pool, client.pinned):
            return await self.split(request, client, kind, pool, started)
        return await self.forward(request, client, kind, pool, started)

    async def split(
        self,
        request: web.Request,
        client: ClientRequest,
        kind: Kind,
        pool: Sequence[Target],
        started: float,
    ) -> web.StreamResponse:
        """A request's n samples routed as n requests would be, answered as one
        (``proxy/samples.py``): the policy picks each sample's target in turn, each counted
        there meanwhile and its prompt pending there; then one request per target reached."""
        incoming = client.incoming
        one = one_sample(incoming)
        info = RequestInfo(
            key=None,
            text=incoming.text,
            adapter=self.parts.registry.snapshot.adapter(
                self.parts.registry.snapshot.named(incoming.model, incoming.body.get("lora_path"))
            ),
            tokens=one.tokens,
            now=started,
            pool=(kind == "generate", incoming.model, None),
        )
        found = None
        if self.lookup is not None:
            found = await self.lookup.find(kind, incoming, pool, started)
        chosen: list[Target] = []
        counted: list[Outstanding] = []
        try:
            for _ in range(incoming.samples):
                if found is not None:
                    info = replace(info, prefix=found.prefix)
                sample = self._choose(pool, info, one)
                counted.append(sample if sample.claimed else sample.claim())
                chosen.append(sample.target)
                if found is not None and self.lookup is not None:
                    self.lookup.sent(found, sample.target, started)
                    found = self.lookup.again(found, started)  # its pending blocks count now
        finally:
            for sample in counted:  # each part is counted again as it goes
                sample.__exit__()
        parts = shares(chosen)
        answers = await asyncio.gather(
            *(
                self._part(request, client, kind, pool, target, n, k, started, found)
                for k, (target, n) in enumerate(parts)
            )
        )
        failed = next((a for a in answers if a.status != 200), None)
        if failed is not None:
            return failed
        bodies = [a.body for a in answers if isinstance(a, web.Response)]
        whole = [b for b in bodies if isinstance(b, bytes)]  # a 200 not streamed: whole
        if len(whole) != len(answers):
            return error(502, "a part of the samples came back in pieces")
        headers = {TARGET_HEADER: ",".join(t.label for t, _ in parts)}
        merged = merge(kind, whole)
        return web.Response(body=merged, content_type="application/json", headers=headers)

    async def _part(
        self,
        request: web.Request,
        client: ClientRequest,
        kind: Kind,
        pool: Sequence[Target],
        target: Target,
        n: int,
        k: int,
        started: float,
        found: Found | None,
    ) -> web.StreamResponse:
        """Part ``k`` of a split request: ``n`` samples on ``target``, or, if it fails
        there, wherever the policy says; its prompt as the split ``found`` it."""
        asked = part(client.incoming, kind, n, k)
        mine = replace(client, incoming=asked, raw=orjson.dumps(asked.body), changed=True)
        answer = await self.forward(request, mine, kind, [target], started, plan=found)
        if answer.status >= 500:
            answer = await self.forward(request, mine, kind, pool, started, plan=found)
        return answer

    async def forward(
        self,
        request: web.Request,
        client: ClientRequest,
        kind: Kind,
        pool: Sequence[Target],
        started: float,
        watch: Callable[[bytes], None] | None = None,
        plan: Found | None = None,
    ) -> web.StreamResponse:
        """Pick a target of ``pool`` by the policy, write its rank, forward, retry; a
        stream's bytes pass ``watch`` on their way to the client. ``plan``: a part of a
        split request, its prompt as the split looked it up and marked it pending on the
        part's target (not looked up again; nothing to wait for)."""
        incoming = client.incoming
        info = RequestInfo(
            key=incoming.key,
            text=incoming.text,
            # affinity per adapter: the engine caches each adapter apart
            adapter=self.parts.registry.snapshot.adapter(
                self.parts.registry.snapshot.named(incoming.model, incoming.body.get("lora_path"))
            ),
            tokens=incoming.tokens,
            now=started,
            pool=(kind == "generate", incoming.model, client.pinned),
        )
        found = plan
        if plan is None and self.lookup is not None:
            found = await self.lookup.find(kind, incoming, pool, started)
        if found is not None:
            info = replace(info, prefix=found.prefix)
        attempts = self.parts.retry.start()

        async def attempt(left: Pools) -> web.StreamResponse:
            (candidates,) = left
            chosen = attempts.numbered(info)
            if self.placer is not None and placeable(chosen):
                await self.placer.place(candidates, chosen)
            tracing = self.parts.tracing
            started_ns = tracing.clock()
            try:
                counted = await self._count(candidates, chosen, incoming)
            except HeldTooLong as exc:
                self.parts.metrics.rejected.labels("held_too_long").inc()
                return error(503, str(exc))
            tried = len(attempts.tried)
            policy = self.policy.name
            tracing.decision(
                request, started_ns, policy, counted.target, len(candidates), tried, counted=counted
            )
            computing: list[int] = []
            if found is not None and self.lookup is not None:
                if plan is None:
                    computing = being_computed(self.lookup.index, found, counted.target)
                self.lookup.sent(found, counted.target, started)  # its blocks are pending there
            try:
                with counted:  # counted on every exit, a claimed one too
                    if computing and self.lookup is not None:  # another computes its prompt there
                        await wait_computed(self.lookup.index, counted.target, computing)
                    return await self._attempt(
                        request, client, counted, attempts, candidates, started, watch
                    )
            except Failed as failure:
                if client.upload is not None and client.upload.begun:  # its bytes are gone
                    return broke(client.upload, failure, attempts, self.parts.metrics)
                raise
            finally:
                self.parts.dispatch.freed()  # its slot may go to a held request

        return await attempts.run((pool,), attempt)

    async def _count(
        self, candidates: Sequence[Target], info: RequestInfo, incoming: Incoming
    ) -> Outstanding:
        """The target, and what counts the request there: the policy's pick now, or,
        under the dispatcher, among the targets with a free slot once one has."""
        dispatch = self.parts.dispatch
        if not dispatch.active:
            return self._choose(candidates, info, incoming)

        def pick(free: Sequence[Target]) -> Outstanding:
            target = self.policy.select(free, info)  # under the lock, when there is one
            return Outstanding(target, incoming.tokens, incoming.output, incoming.samples)

        return await dispatch.admit(candidates, incoming, (info.pool, info.attempt), pick)

    def _choose(
        self, candidates: Sequence[Target], info: RequestInfo, incoming: Incoming
    ) -> Outstanding:
        """The policy's pick, and what counts the request there while it runs."""
        if self.lock is None:
            target = self.policy.select(candidates, info)
            return Outstanding(target, incoming.tokens, incoming.output, incoming.samples)
        with self.lock:  # the pick and its count, in one step for all processes
            target = self.policy.select(candidates, info)
            return Outstanding(target, incoming.tokens, incoming.output, incoming.samples).claim()

    async def _attempt(
        self,
        request: web.Request,
        client: ClientRequest,
        counted: Outstanding,
        attempts: Attempts,
        candidates: Sequence[Target],
        started: float,
        watch: Callable[[bytes], None] | None,
    ) -> web.StreamResponse:
        p = self.parts
        incoming, target = client.incoming, counted.target
        dialect = target.worker.dialect or "vllm"
        # each attempt writes its own rank (vLLM's in a header, SGLang's in the body)
        sent = client.headers.copy()
        sent[REQUEST_ID_HEADER] = request_id(request)
        body = dict(incoming.body) if dialect == "sglang" else incoming.body
        rid, named = ensure_rid(body) if dialect == "sglang" and not client.form else (None, False)
        if client.form:  # a form is not re-encoded: the rank goes in a header, for both
            dialects.write_rank_header(target.rank, sent)
            data: bytes | Upload = client.raw if client.upload is None else client.upload
        elif dialects.write_rank(dialect, target.rank, sent, body) or client.changed or named:
            data = orjson.dumps(body)
        else:
            data = client.raw  # untouched: forward the client's bytes as they came
        span = p.tracing.attempt(request, target.label, len(attempts.tried))
        with span, p.aborter.on_cancel(target.worker, rid):
            span.inject(sent)
            upstream = await p.upstream.post(target, request.path_qs, data, sent)
            span.set("http.response.status_code", upstream.status)
            # an upload the engine began taking cannot go elsewhere: its answer stands
            spent = client.upload is not None and client.upload.begun
            p.retry.judge(target, upstream, spent or attempts.last_chance(candidates))
            await attempts.served(target, upstream, () if spent else candidates)
            try:
                series = p.metrics.series(target)
                answer = await relay(
                    request,
                    upstream,
                    target,
                    series,
                    started,
                    counted,
                    watch,
                    span=span,
                    stated=p.monitor.stated,
                )
            except UpstreamBroke as exc:
                raise Failed(target, "broken_body", f"answer broke off ({exc})") from exc
            attempts.answered(answer, target)
            learn(p.output, answer, counted, incoming)
            return answer


def broke(
    upload: Upload, failure: Failed[Target], attempts: Attempts, metrics: RouterMetrics
) -> web.Response:
    """The answer to an upload whose attempt failed after the engine began taking it.
    Past ``--max-body``, or the client gone, is not the engine's fault: no breaker counts it."""
    if upload.too_large:
        metrics.rejected.labels("too_large").inc()
        return error(413, f"request body exceeds {upload.limit} bytes")
    if upload.client_gone:  # nobody reads this answer; said for the log's sake
        return error(400, "the client stopped sending the upload before its end")
    attempts.failed(failure)
    metrics.rejected.labels("upstream_failed").inc()
    return error(502, f"the upload broke off after the engine began taking it: {failure}")
