"""One rank's KV-event stream, followed into the index.

A ZMQ SUB socket on the rank's publisher; batches apply in sequence order. Where the
sequence says something was missed, the engine's replay socket (a ROUTER: send
``[b"", start as 8-byte big-endian]`` from a DEALER, receive ``[b"", seq, payload]``
until seq -1; vLLM's ``ZmqEventPublisher._service_replay``) fills it in:

- on joining, everything the engine still buffers, so blocks stored before the router
  started are known (an index that only listens never learns them);
- a sequence ahead of the next one expected: a gap, replayed;
- a live sequence at or below the last live one: the engine restarted, its cache is
  empty, so is its rank here;
- a reconnection to the publisher (the engine may have restarted, with nothing to say
  since): the replay socket is asked from the last batch applied, which a running
  engine still buffers, byte for byte; one that no longer has it restarted, and its
  rank is emptied at once, not at its next batch (an engine with ``buffer_steps`` 0
  cannot tell, and is emptied);
- a gap the replay cannot fill (no replay socket, or the buffer moved on): the rank is
  emptied and rebuilt from what the replay still has -- under-reporting costs a cache
  miss, holding what the rank no longer holds costs a misroute.

Engines publish nothing while idle, so silence alone proves nothing; with a replay
socket, a silent stream is asked every ``probe`` seconds (as on a reconnection), and
one that does not answer is emptied until it answers again. A batch is applied in
slices, yielding to the event loop between them (SGLang with page size 1 sends one
event per token).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from dprouter.engines.kvevents import wire
from dprouter.engines.kvevents.index import KvIndex

log = logging.getLogger("dprouter.kvevents")
SLICE = 128  # events applied between two yields to the event loop (~4 ms of SGLang pages)
END = -1


@dataclass
class StreamCounts:
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    restarts: int = 0
    bad: int = 0
    lost: int = 0  # the stream went silent and did not answer: emptied


class RankStream:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        index: KvIndex,
        name: tuple[str, int],
        endpoint: str,
        replay: str | None = None,
        probe: float = 10.0,
        timeout: float = 5.0,
    ) -> None:
        self.ctx, self.index, self.name = ctx, index, name
        self.endpoint, self.replay_endpoint = endpoint, replay
        self.probe, self.timeout = probe, timeout
        self.counts = StreamCounts()
        self.expected = 0  # the next sequence to apply
        self.live = -1  # the last sequence the SUB socket delivered
        self.last = b""  # the payload of batch expected - 1: a running engine still has it
        self.on_batch: Callable[[], None] | None = None  # tests and metrics: one more applied
        self.joined = asyncio.Event()  # the join's replay is done (or there is none)
        self._vouched = False  # a replay sent the last batch applied, unchanged

    @property
    def rank(self) -> int:
        return self.name[1]

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # every handshake after the first is a reconnection: the engine may have restarted
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        handshakes = 0
        try:  # every socket closed whatever ends the stream: a context with one left never ends
            sub.connect(self.endpoint)
            await self._replay(0)  # what the engine holds from before we joined
            self.joined.set()
            while True:
                ready = dict(await poller.poll(self.probe * 1000))
                if not ready:
                    await self._probe()
                if monitor in ready:
                    await monitor.recv_multipart()
                    handshakes += 1
                    if handshakes > 1:
                        await self._check()
                if sub in ready:
                    await self._frame(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            self.index.drop(*self.name)

    async def _frame(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise wire.BadFrame(f"{len(frames)} frames, not (topic, seq, payload)")
            seq = wire.sequence(frames[1])
            batch = wire.batch(frames[2])
        except wire.BadFrame as exc:
            self.counts.bad += 1
            log.warning("KV events of %s/%d: %s", *self.name, exc)
            return
        if seq <= self.live:  # the live stream went back: a new engine, an empty cache
            self._restarted()
            if seq > 0:
                await self._replay(0)
        if self.live < 0 and self.replay_endpoint is None:
            self.expected = seq  # joined mid-stream with no replay: what came before is unknown
        self.live = seq
        if seq < self.expected:
            return  # a replay brought it already
        if seq > self.expected:
            self.counts.gaps += 1
            await self._replay(self.expected)
            if seq < self.expected:
                return
            if seq > self.expected:  # the replay could not fill it
                self._restart_from(seq)
        await self._apply(seq, batch, frames[2])

    def _restarted(self) -> None:
        self.counts.restarts += 1
        log.info("KV events of %s/%d: the engine restarted: emptied", *self.name)
        self.index.drop(*self.name)
        self.expected, self.live, self.last = 0, -1, b""

    def _restart_from(self, seq: int) -> None:
        log.info("KV events of %s/%d: %d..%d missed: emptied", *self.name, self.expected, seq - 1)
        self.index.drop(*self.name)
        self.expected = seq

    async def _apply(self, seq: int, batch: wire.Batch, payload: bytes) -> None:
        events = batch.events
        for start in range(0, len(events), SLICE):
            if start:
                await asyncio.sleep(0)
            self.index.apply(self.index.rank(*self.name), events[start : start + SLICE])
        self.expected, self.last = seq + 1, payload
        self.counts.batches += 1
        if self.on_batch is not None:
            self.on_batch()

    async def _probe(self) -> None:
        """A silent stream: still there? (Only a replay socket can say.)"""
        if self.replay_endpoint is None or await self._check():
            return
        if self.name in self.index.ranks:
            self.counts.lost += 1
            log.warning("KV events of %s/%d: no answer: emptied", *self.name)
            self.index.drop(*self.name)
            self.expected, self.live = 0, -1  # rebuilt from the replay when it answers

    async def _check(self) -> bool:
        """Is the engine behind the stream still the one followed? Asked from the last
        batch applied: unless it restarted, the engine still buffers it, byte for byte,
        and what follows fills any gap. False: no answer."""
        if self.replay_endpoint is None or not self.expected:
            return await self._replay(self.expected)
        self._vouched = False
        if not await self._replay(self.expected - 1):
            return False
        if not self._vouched:
            log.info("KV events of %s/%d: the replay lacks batch %d", *self.name, self.expected - 1)
            self._restarted()
            return await self._replay(0)
        return True

    async def _replay(self, start: int) -> bool:
        """Apply the batches the engine still buffers from ``start`` on (the live ones
        the replay also brought are skipped when they arrive). False: no answer."""
        if self.replay_endpoint is None:
            return False
        self.counts.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # not wait_for: on 3.11 it swallows a cancel that lands as the frames do,
                # and the stream would outlive its worker (and hang whoever awaits it)
                async with asyncio.timeout(self.timeout):
                    frames = await dealer.recv_multipart()
                seq = wire.sequence(frames[-2])
                if seq == END:
                    return True
                if seq < self.expected:
                    if seq == self.expected - 1 and frames[-1] == self.last:
                        self._vouched = True  # the engine still has the last batch applied
                    continue
                if seq > self.expected:  # the buffer no longer reaches back to it
                    self._restart_from(seq)
                await self._apply(seq, wire.batch(frames[-1]), frames[-1])
        except TimeoutError:
            return False
        except (wire.BadFrame, IndexError) as exc:
            self.counts.bad += 1
            log.warning("KV event replay of %s/%d: %s", *self.name, exc)
            return False
        finally:
            dealer.close(0)
