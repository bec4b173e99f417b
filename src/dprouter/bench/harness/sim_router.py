"""The router's own policies driving the offline simulator.

Targets are built from the simulated engines exactly as the router builds them
from live workers (one per rank when DP-aware, one per engine when not), and a
request's outstanding count is held from routing until the engine finishes it
-- the same load signal the router keeps -- so routing quality measured here is
the policies' own. A request weighs what the router would count: its prompt
plus its output budget, ``min(max_tokens sent, typical output)`` as the
router's ``OutputEstimate`` learns it (``Arrival.limit`` is what the client
sent); an ``oracle`` router weighs it by the output it will really run to,
which no router knows at admission. With ``scrape`` the engines' per-rank
reports (running + waiting, tokens held) reach the board every ``scrape``
virtual seconds, as the router's monitor reads them. A policy that reads the
engines' KV-cache events (``prefix``) gets them through ``SimKvFeed``: the ranks'
caches journal what they store and evict, and the index sees it a little later.

A request sent to a rank that is computing its prompt's prefix right now (pending
there), on an engine that caches a prefix only once computed (SGLang: requests
batched with the one computing it compute it again), is held until the rank's events
store it, as the router's request path holds it (``kvevents/computing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dprouter.bench.harness.kvfeed import SimKvFeed
from dprouter.engines.kvevents.computing import WAIT, being_computed, pending_on
from dprouter.fleet.engine_load import assign
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Outstanding, Target, Worker
from dprouter.policies import Policy, PolicyOptions, RequestInfo, make_policy, needs_tokens
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.rank import Rank
from dprouter.sim.model.request import SimRequest
from dprouter.sim.offline.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.offline.report import SimReport

OPENING = 256  # routing decisions kept in order: where a burst's opening went


@dataclass
class Held:
    arrival: Arrival
    target: Target
    keys: list[int]  # the prompt's block keys pending on the target
    until: float


class SimRouter:
    """Routes offline arrivals with a policy over (engine, rank) targets."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        policy: str | Policy,
        dp_aware: bool = True,
        options: PolicyOptions | None = None,
        oracle: bool = False,
        scrape: float = 0.0,
    ) -> None:
        self.oracle = oracle
        self.scrape = scrape
        self._scraped = -float("inf")
        self.output = OutputEstimate()  # as the router learns it from its answers
        self.registry = Registry(dp_aware=dp_aware)
        for i, c in enumerate(configs):
            worker = Worker(id=f"e{i}", url=f"http://sim-{i}:1", dialect=c.persona)
            worker.ranks = c.dp_size
            self.registry.add(worker)
            self.registry.mark_ready(worker)
        self.pool = self.registry.snapshot.pool()
        self.index = {w.id: i for i, w in enumerate(self.registry.workers.values())}
        self.policy = make_policy(policy, options) if isinstance(policy, str) else policy
        self.feed = SimKvFeed(list(self.index)) if needs_tokens(self.policy) else None
        self.held: dict[int, Outstanding] = {}
        self.waiting: list[Held] = []
        self.sim: OfflineSim | None = None  # set by ``run_sessions``: sends held requests
        self.decisions = 0
        self.opening: list[str] = []  # the first OPENING targets chosen, in order
        self.last: Target | None = None  # the target of the last decision (sent or held)

    def route(self, cluster: Cluster, arrival: Arrival) -> tuple[int, int | None] | None:
        if self.scrape and cluster.now - self._scraped >= self.scrape:
            self._report(cluster)
        text = " ".join(map(str, arrival.prompt_ids[:512]))  # affinity sees the prompt's start
        known = arrival.limit is None or self.oracle
        output = arrival.max_tokens if known else self.output.budget(arrival.limit)
        tokens = len(arrival.prompt_ids) + output
        found = None
        if self.feed is not None:
            found = self.feed.prefix(self.pool, arrival.prompt_ids, cluster.now)
        prefix = found.prefix if found is not None else None
        info = RequestInfo(
            key=arrival.key, text=text, tokens=tokens, now=cluster.now, prefix=prefix
        )
        target: Target = self.policy.select(self.pool, info)
        keys: list[int] = []
        if found is not None and self.feed is not None:
            keys = being_computed(self.feed.index, found, target)
            self.feed.sent(found, target, cluster.now)  # as the router's request path
        guard = Outstanding(target, tokens, output)
        guard.__enter__()
        self.held[id(arrival)] = guard
        self.decisions += 1
        if len(self.opening) < OPENING:
            self.opening.append(target.label)
        self.last = target
        if keys and self.sim is not None:
            self.waiting.append(Held(arrival, target, keys, cluster.now + WAIT))
            return None
        return self.index[target.worker.id], target.rank

    def release(self, now: float) -> None:
        """Send the held requests whose prefix their target has stored (or at their
        time limit)."""
        if not self.waiting or self.feed is None or self.sim is None:
            return
        self.feed.deliver(now)
        keep = []
        for held in self.waiting:
            if now < held.until and pending_on(self.feed.index, held.target, held.keys):
                keep.append(held)
                continue
            self.sim.send(held.arrival, self.index[held.target.worker.id], held.target.rank)
        self.waiting = keep

    def finished(self, arrival: Arrival, req: SimRequest) -> None:
        self.held.pop(id(arrival)).__exit__(None, None, None)
        self.output.observe(req.generated)

    def _report(self, cluster: Cluster) -> None:
        """What each rank's engine would answer a scrape now (SGLang's fields: KV tokens
        used + prompt tokens queued)."""
        self._scraped = cluster.now
        for worker, engine in zip(self.registry.workers.values(), cluster.engines, strict=True):
            per_rank = {
                r.index: (
                    r.num_running + r.num_waiting,
                    r.kv_used + sum(q.prompt_len for q in r.waiting),
                )
                for r in engine.ranks
            }
            assign(worker, per_rank)


class Sessions(Protocol):
    """A closed-loop workload: a session sends its next turn when the last one is done."""

    def first_turns(self) -> list[Arrival]: ...

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None: ...


def run_sessions(
    configs: Sequence[EngineConfig],
    router: SimRouter,
    sessions: Sessions,
    flushes: Sequence[tuple[float, Sequence[int]]] = (),
) -> tuple[SimReport, OfflineSim]:
    """``flushes``: at each virtual time (taken at the first arrival from then on), these
    engines reset their prefix caches, as ``/reset_prefix_cache`` does; the router is not
    told, only their KV events say so."""
    feed = router.feed
    on_step = None
    if feed is not None:

        def on_step(engine: int, ranks: Sequence[Rank], now: float) -> None:
            feed.collect(engine, ranks, now)
            router.release(now)

    sim = OfflineSim(list(configs), router.route, on_step=on_step, kv_events=feed is not None)
    router.sim = sim
    due = sorted(flushes, key=lambda f: f[0], reverse=True)
    if due:

        def route(cluster: Cluster, arrival: Arrival) -> tuple[int, int | None] | None:
            while due and due[-1][0] <= cluster.now:
                for e in due.pop()[1]:
                    engine = cluster.engines[e]
                    engine.reset_prefix_cache()
                    if feed is not None:
                        feed.collect(e, engine.ranks, cluster.now)
            return router.route(cluster, arrival)

        sim.route = route

    def finished(arrival: Arrival, req: SimRequest) -> None:
        router.finished(arrival, req)
        following = sessions.next_turn(arrival, req, sim.cluster.now)
        if following is not None:
            sim.inject(following)

    sim.on_finish = finished
    return sim.run(sessions.first_turns()), sim
