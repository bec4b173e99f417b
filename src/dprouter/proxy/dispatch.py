"""The dispatcher: requests wait in the router until a rank has a free running slot,
and the longest predicted decode goes first.

Why: an engine runs at most ``max_running_requests`` per rank (SGLang reports it per
rank in ``/v1/loads``); what it cannot run yet queues on the rank it was sent to,
first come first served. Under DP attention the engine steps until its busiest rank
is done, so a burst costs the busiest rank's decode steps. Sending the whole burst at
once fixes each request's rank before anyone knows which ranks free up first: a rank
that drew long decodes runs on alone. Held in the router, a request goes to the first
rank that frees a slot, and the longest decodes start first, so the short ones fill
the ends (list scheduling, longest first). On a model of each rank as first-come
slots the two together reached the lower bound, max(longest decode, all decode over
all slots), within 1 % in every round of the RL burst where round robin needed ~1.2x.

A request is held only where every target of its pool has a known running cap (the
engine's report, or ``--dispatch-slots``): vLLM does not report its ``max_num_seqs``,
and an engine with no cap below its KV limit gains nothing from holding. Holding is
bounded (``--dispatch-wait``: then a 503); a client that leaves is dropped from the
queue; a request with a routing key (a session) is not held (it keeps its target; the
engine queues it there). A request sampling ``n`` sequences waits for ``n`` free slots on
one rank (a whole cap at most: the engine runs the rest as slots free). Priority is the
predicted output (``output_budget.predict``)
plus ``--dispatch-aging`` tokens per second waited, so nothing starves: requests that
arrive together keep their order by length.

Who goes first among the held, when a slot frees: the highest priority class (a
request's caller's, ``server/door.py``); within a class the tenant served least for its
weight (``Line``: weighted fair queuing); within a tenant the order above. With
``--dispatch-queue`` the queue is bounded: a request arriving to a full queue sheds the
newest held request of the lowest class below its own (a 503), or is shed itself.
``--engine-queue`` lets each rank queue that many requests beyond its running slots
before the router holds more (the engine's own queue, bounded); ``--engine-kv F`` holds
requests from a rank whose token load (the KV-cache tokens its engine last reported,
plus the prompt and output budget of what the router sent it since) is F of its KV
capacity or more (where no running cap is known, as with vLLM, that bound alone holds);
``--reserve`` keeps that
many running slots of each rank for the highest class, so that its requests find one
free at once while the others are held (their time to first token stays near an idle
fleet's).

Under ``--processes`` every process keeps its own queue, and a slot is taken under
the board lock after looking at the shared board: the caps hold exactly across
processes. A process learns of a slot another process freed by looking again every
few milliseconds while it holds requests. The order holds across processes (``heads.py``):
each puts on the board, per target, the key of its first in line (class, then place in
line), and no process takes a slot there for a request behind another's first (else the
process a slot freed in would hand it to its own first in line, whatever another held).
Tenants' shares hold within each process, and across them as far as each tenant's
requests spread over the processes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dprouter.config import RouterConfig
from dprouter.core.types import Caller, DispatchMode, Incoming
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.targets import Outstanding, Target
from dprouter.policies.base import readers
from dprouter.proxy.heads import Heads, Shown, key
from dprouter.proxy.output_budget import OutputEstimate

Pick = Callable[[Sequence[Target]], Outstanding]  # the policy's pick among free targets
POLL = 0.05  # seconds between looks at the board while requests are held (one process)
POLL_SHARED = 0.005  # ... under --processes: another process may have freed a slot


@dataclass(frozen=True)
class DispatchOptions:
    """As ``RouterConfig`` says (``--dispatch``, ``--dispatch-slots``, ...)."""

    mode: DispatchMode = "auto"  # auto: hold where running caps are known; off: never
    slots: int = 0  # running slots per target; 0: as the engine reports
    wait: float = 600.0  # seconds a request may be held before a 503
    aging: float = 100.0  # tokens of priority a second of waiting is worth
    queue: int = 0  # requests held at most (the lowest class is shed beyond); 0: no bound
    engine_queue: int = 0  # requests a rank may queue beyond its running slots
    reserve: int = 0  # running slots per rank only the highest class may take
    kv: int = 0  # thousandths of its KV capacity a rank's token load may reach; 0: no bound

    @classmethod
    def of(cls, config: RouterConfig) -> DispatchOptions:
        return cls(
            config.dispatch,
            config.dispatch_slots,
            config.dispatch_wait,
            config.dispatch_aging,
            config.dispatch_queue,
            config.engine_queue,
            config.reserve,
            round(config.engine_kv * 1000),
        )


class HeldTooLong(Exception):
    """No target of the request's pool freed a slot within ``--dispatch-wait``."""


class Shed(HeldTooLong):
    """The router's queue was full (``--dispatch-queue``) and this request's class the
    lowest held: it made room for a higher one, or found none."""


class Held:
    """A request waiting for a slot; ``order`` sorts the queue (the least first)."""

    __slots__ = ("arrival", "cancelled", "candidates", "done", "incoming", "order", "pick")

    def __init__(
        self, incoming: Incoming, candidates: Sequence[Target], pick: Pick, arrival: float
    ) -> None:
        self.incoming = incoming
        self.candidates = candidates
        self.pick = pick
        self.arrival = arrival
        self.cancelled = False
        self.done: asyncio.Future[Outstanding] = asyncio.get_running_loop().create_future()
        self.order = (0.0, 0)

    def __lt__(self, other: Held) -> bool:
        return self.order < other.order

    @property
    def gone(self) -> bool:
        """Left its queue (the client left, it timed out or was shed) or was handed a slot."""
        return self.cancelled or self.done.done()


class Line:
    """One pool's held requests: the highest class first; within a class the tenant
    served least for its weight (weighted fair queuing, counted in requests); within a
    tenant the dispatcher's order. A tenant that was idle joins at its class's virtual
    time, so a burst after a pause does not crowd the others out."""

    def __init__(self) -> None:
        self.classes: dict[int, dict[str, list[Held]]] = {}  # class -> tenant -> its heap
        self.served: dict[int, dict[str, float]] = {}  # class -> tenant -> requests / weight
        self.clock: dict[int, float] = {}  # class -> the virtual time of its last one out

    def __bool__(self) -> bool:
        return bool(self.classes)

    def push(self, held: Held) -> None:
        caller = held.incoming.caller
        tenants = self.classes.setdefault(caller.priority, {})
        heap = tenants.get(caller.tenant)
        if heap is None:
            heap = tenants[caller.tenant] = []
            served = self.served.setdefault(caller.priority, {})
            clock = self.clock.get(caller.priority, 0.0)
            served[caller.tenant] = max(served.get(caller.tenant, 0.0), clock)
        heapq.heappush(heap, held)

    def first(self) -> Held | None:
        """The next to get a slot (left in place: ``pop`` takes it once it has one)."""
        for priority in sorted(self.classes):
            tenants = self.classes[priority]
            served = self.served[priority]
            best: Held | None = None
            least = 0.0
            for tenant in list(tenants):
                heap = tenants[tenant]
                while heap and heap[0].gone:
                    heapq.heappop(heap)
                if not heap:
                    del tenants[tenant]
                    del served[tenant]
                    continue
                if best is None or served[tenant] < least:
                    best, least = heap[0], served[tenant]
            if best is not None:
                return best
            del self.classes[priority]
        return None

    def pop(self, held: Held) -> None:
        """``held``, returned by ``first``, got its slot."""
        caller = held.incoming.caller
        heapq.heappop(self.classes[caller.priority][caller.tenant])
        served = self.served[caller.priority]
        self.clock[caller.priority] = served[caller.tenant]
        served[caller.tenant] += 1.0 / caller.weight

    def lowest(self) -> int:
        """The lowest class with a request held here (-1: none)."""
        return max(
            (
                c
                for c, tenants in self.classes.items()
                if any(not h.gone for q in tenants.values() for h in q)
            ),
            default=-1,
        )

    def last(self, priority: int) -> Held | None:
        """The newest request held in class ``priority``: the first to shed."""
        held = [h for q in self.classes.get(priority, {}).values() for h in q if not h.gone]
        return max(held, key=lambda h: h.arrival, default=None)

    def each(self) -> list[list[Held]]:
        return [heap for tenants in self.classes.values() for heap in tenants.values()]


class Dispatcher:
    def __init__(
        self,
        options: DispatchOptions,
        output: OutputEstimate,
        lock: BoardLock | None = None,
        shown: Callable[[int, int], None] | None = None,
        on_queued: Callable[[Caller, float], None] | None = None,
        on_shed: Callable[[Caller, str], None] | None = None,
    ) -> None:
        self.options = options
        self.shown = shown  # told of each change in those held: (class, change), a gauge
        self.on_queued = on_queued  # told how long a held request waited for its slot
        self.on_shed = on_shed  # told of a held request answered 503, and why
        self.output = output
        self.lock = lock  # several serving processes: a slot is taken under it
        self.queues: dict[Hashable, Line] = {}  # by pool
        self.held = 0  # requests waiting now, in this process
        self._groups: Counter[int] = Counter()  # groups of the requests held
        self._seq = itertools.count()
        self.readers = readers(
            scans=False
        )  # each pool's slots on the board, as the policies read it
        self._poller: asyncio.Task[None] | None = None
        self._pumping = False
        self.heads = Heads() if lock is not None else None  # what the processes show
        if options.mode != "off":
            output.listeners.append(self._regroup)

    @property
    def active(self) -> bool:
        return self.options.mode != "off"

    # -- which targets have a free slot ----------------------------------------------

    def free(
        self, candidates: Sequence[Target], incoming: Incoming, order: float | None = None
    ) -> Sequence[Target] | None:
        """The candidates with a running slot free for each of ``incoming``'s samples (at
        most a whole cap's: more than a rank runs at once wait in its engine) to a request
        of its class, by the board (the engines' reports and what the router sent since),
        that no other serving process holds a request before it for (``order``: its place
        in line, held; None: arriving now); None: not dispatching for them (a target's cap
        is unknown)."""
        samples, priority = incoming.samples, incoming.caller.priority
        reader = self.readers.of(candidates)
        board, index = reader.board, reader.index
        kv = self.options.kv
        caps = self.options.slots or board.cap[index]
        if np.all(caps):
            bound = caps + self.options.engine_queue
            if priority:  # the highest class's reserve is not for the others
                bound = bound - self.options.reserve
            room = board.load[index] + np.minimum(samples, caps) <= bound
            if kv:
                room &= self._kv_room(board.token_load[index], board.kv[index], kv)
        elif kv:  # no running caps (vLLM): the KV caches alone say who is full
            room = self._kv_room(board.token_load[index], board.kv[index], kv)
        else:
            return None
        if self.heads is not None and (rows := self.heads.others(board)) is not None:
            if order is None:  # not held: its place in line as if held from now
                order = self._place(incoming, asyncio.get_running_loop().time())
            room &= self.heads.clear(board, rows, index, key(priority, order))
        if room.all():
            return candidates
        return [candidates[int(i)] for i in np.flatnonzero(room)]

    @staticmethod
    def _kv_room(tokens: npt.NDArray[np.int64], kv: npt.NDArray[np.int64], bound: int) -> Any:
        """Targets whose token load (the engine's KV-cache tokens as it reported them, plus
        what the router sent since: fresh between reports) is below ``bound`` thousandths
        of their KV capacity; a target whose capacity is not known has room."""
        return (kv == 0) | (tokens * 1000 < kv * bound)

    def _show(self) -> None:
        """Under ``--processes``: show the other processes each pool's first in line."""
        if self.heads is None:
            return
        heads: list[Shown] = []
        for line in self.queues.values():
            first = line.first()
            if first is not None:
                reader = self.readers.of(first.candidates)
                best = key(first.incoming.caller.priority, first.order[0])
                heads.append((reader.board, reader.index, best))
        self.heads.show(heads)

    def _take(
        self,
        candidates: Sequence[Target],
        pick: Pick,
        incoming: Incoming,
        order: float | None = None,
    ) -> Outstanding | None:
        """A free target's slots for ``incoming``'s samples, counted at once (under the
        lock: exact across processes), or None while no target has them (``free``)."""
        step: AbstractContextManager[object] = self.lock if self.lock is not None else nullcontext()
        with step:
            free = self.free(candidates, incoming, order)
            if free is not None and not free:
                return None
            return pick(candidates if free is None else free).claim()

    # -- holding ---------------------------------------------------------------------

    async def admit(
        self, candidates: Sequence[Target], incoming: Incoming, pool: Hashable, pick: Pick
    ) -> Outstanding:
        """A slot for ``incoming`` on one of ``candidates``, counted: at once when one is
        free and nobody waits before it, else when one frees and its turn comes."""
        queue = self.queues.get(pool)
        if not queue or incoming.key is not None:
            counted = self._take(candidates, pick, incoming)
            if counted is not None:
                return counted
            if incoming.key is not None:  # a session keeps its target: the engine queues it
                return pick(candidates).claim()
        loop = asyncio.get_running_loop()
        held = Held(incoming, candidates, pick, loop.time())
        self._order(held)
        if self.options.queue and self.held >= self.options.queue:
            self._shed(held)  # room made by shedding a lower class, or Shed raised
        self.queues.setdefault(pool, Line()).push(held)
        priority = incoming.caller.priority
        self._count(priority, 1)
        if not self._pumping:
            self.pump()  # a slot may be free now: it goes to the first in line, maybe this one
        done = held.done
        if done.done() and not done.cancelled() and done.exception() is None:
            # a slot was free for it (one those waiting may not take: a --reserve): it
            # went in the step it came, so it was never held
            self._count(priority, -1)
            return done.result()
        self._groups[incoming.group] += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="dispatch")
        try:
            async with asyncio.timeout(self.options.wait):
                counted = await asyncio.shield(held.done)
            if self.on_queued is not None:
                self.on_queued(incoming.caller, loop.time() - held.arrival)
            return counted
        except BaseException as exc:
            done = held.done
            held.cancelled = True  # dropped from its queue when it comes up
            if done.done() and not done.cancelled() and done.exception() is None:
                done.result().__exit__()  # given a slot as it left: the slot goes on
                self.freed()
            if isinstance(exc, TimeoutError):
                if self.on_shed is not None:
                    self.on_shed(incoming.caller, "held_too_long")
                raise HeldTooLong(
                    f"no rank had a free running slot within {self.options.wait:g} s "
                    f"({self.held} requests held)"
                ) from None
            raise
        finally:
            self._count(priority, -1)
            self._groups[incoming.group] -= 1
            if not self._groups[incoming.group]:
                del self._groups[incoming.group]

    def _shed(self, newcomer: Held) -> None:
        """The queue is full: the newest request of the lowest class held goes, with a 503,
        if that class is below ``newcomer``'s; else ``newcomer`` does (``Shed``)."""
        lines = [line for line in self.queues.values() if line]
        lowest = max((line.lowest() for line in lines), default=-1)
        mine = newcomer.incoming.caller.priority
        victim = None
        if lowest > mine:
            found = [h for line in lines if (h := line.last(lowest)) is not None]
            victim = max(found, key=lambda h: h.arrival, default=None)
        reason = (
            f"the router holds {self.held} requests, its bound (--dispatch-queue), while every "
            "rank's running slots are taken"
        )
        if victim is None:
            if self.on_shed is not None:
                self.on_shed(newcomer.incoming.caller, "queue_full")
            raise Shed(f"{reason}, and none of a lower class than this one; retry later")
        if self.on_shed is not None:
            self.on_shed(victim.incoming.caller, "shed")
        victim.done.set_exception(
            Shed(f"{reason}: this request of a lower class made room for a higher one")
        )

    def _count(self, priority: int, change: int) -> None:
        self.held += change
        if self.shown is not None:
            self.shown(priority, change)

    def _order(self, held: Held) -> None:
        """Longest predicted output first, ``aging`` tokens per second waited ahead."""
        held.order = (self._place(held.incoming, held.arrival), next(self._seq))

    def _place(self, incoming: Incoming, arrival: float) -> float:
        """A place in line, the less first: ``aging`` x ``arrival`` - the predicted output
        (the event loop's clock, ``time.monotonic``: every process's, so the processes'
        places compare)."""
        return self.options.aging * arrival - incoming.output

    def _regroup(self, group: int) -> None:
        """A request of ``group`` finished: the held ones of that group are predicted
        again (the first sample of a prompt to finish predicts its siblings)."""
        if group not in self._groups:
            return
        for line in self.queues.values():
            for queue in line.each():
                changed = False
                for held in queue:
                    incoming = held.incoming
                    if incoming.group == group and not incoming.exact and not held.cancelled:
                        self.output.apply(incoming)
                        self._order(held)
                        changed = True
                if changed:
                    heapq.heapify(queue)

    def freed(self) -> None:
        """A request ended here: its slot may go to the first in line."""
        if self.held and not self._pumping:
            self.pump()

    def pump(self) -> None:
        """Hand every free slot to the first in line of its pool."""
        self._pumping = True
        try:
            for pool in list(self.queues):
                line = self.queues[pool]
                while (first := line.first()) is not None:
                    counted = self._take(
                        first.candidates, first.pick, first.incoming, first.order[0]
                    )
                    if counted is None:
                        break
                    line.pop(first)
                    first.done.set_result(counted)
                if not line:
                    del self.queues[pool]
            self._show()
        finally:
            self._pumping = False

    async def _poll(self) -> None:
        """While requests are held: look again now and then (a slot another process or
        client freed, a report from the engine, a worker that joined)."""
        every = POLL if self.lock is None else POLL_SHARED
        while self.queues:
            await asyncio.sleep(every)
            self.pump()
