"""One rank's stream against a real ZMQ PUB + ROUTER started here: join, live, gap ->
replay, restart -> emptied, lost -> emptied."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import zmq.asyncio

from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.keys import prompt_keys
from dprouter.engines.kvevents.subscriber import RankStream
from tests.kv_publisher import Publisher, removed, stored

NAME = ("w0", 0)
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def held(index: KvIndex, tokens: list[int]) -> int:
    rank = index.ranks.get(NAME)
    if rank is None:
        return 0
    return index.match(prompt_keys(np.array(tokens), 4), 1 << rank.bit).get(rank.bit, 0)


RUNNING: list[asyncio.Task[None]] = []


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    for task in RUNNING:  # a failed test's streams too: a context with open sockets hangs
        task.cancel()
    await asyncio.gather(*RUNNING, return_exceptions=True)
    RUNNING.clear()
    context.term()


async def follow(
    ctx: zmq.asyncio.Context, index: KvIndex, pub: Publisher, probe: float = 10.0
) -> tuple[RankStream, asyncio.Task[None]]:
    stream = RankStream(ctx, index, NAME, pub.endpoint, pub.replay_endpoint, probe, timeout=0.5)
    task = asyncio.create_task(stream.run())
    RUNNING.append(task)
    return stream, task


async def live(stream: RankStream, pub: Publisher) -> None:
    """Joined, and the subscription is through (ZMQ's slow joiner drops what is published
    before): empty batches until one arrives."""
    await asyncio.wait_for(stream.joined.wait(), 5)
    for _ in range(500):
        await pub.publish([])
        await asyncio.sleep(0.01)
        if stream.live >= 0:
            return
    raise AssertionError("the subscription never went through")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_join_replays_what_was_stored_before_then_follows_live(
    ctx: zmq.asyncio.Context,
) -> None:
    index = KvIndex()
    async with Publisher() as pub:
        await pub.publish([stored([11], None, A)])
        await pub.publish([stored([12], 11, B)])
        stream, task = await follow(ctx, index, pub)
        await until(lambda: held(index, A + B) == 2)
        assert stream.counts.replays == 1
        # live: keep publishing until the subscription is through (ZMQ's slow joiner)
        await live(stream, pub)
        await pub.publish([stored([13], 12, C), removed([11])])
        await until(lambda: held(index, A + B + C) == 0 and index.size == 2)
        await stop(task)
    assert NAME not in index.ranks and index.size == 0  # a stopped stream is emptied


async def test_a_gap_is_replayed(ctx: zmq.asyncio.Context) -> None:
    index = KvIndex()
    async with Publisher() as pub:
        stream, task = await follow(ctx, index, pub)
        await live(stream, pub)
        await pub.publish([stored([11], None, A)], send=False)  # lost on the wire
        await pub.publish([stored([12], 11, B)])
        await until(lambda: held(index, A + B) == 2)
        assert stream.counts.gaps == 1 and stream.counts.replays == 2
        await stop(task)


async def test_a_gap_without_replay_empties_the_rank(ctx: zmq.asyncio.Context) -> None:
    index = KvIndex()
    async with Publisher(replay=False) as pub:
        stream, task = await follow(ctx, index, pub)
        await live(stream, pub)
        await pub.publish([stored([11], None, A)])
        await until(lambda: held(index, A) == 1)
        await pub.publish([removed([11])], send=False)  # lost: the rank no longer holds A
        await pub.publish([stored([21], None, C)])
        await until(lambda: held(index, C) == 1)
        assert held(index, A) == 0 and stream.counts.gaps == 1
        await stop(task)


async def test_a_restart_empties_the_rank(ctx: zmq.asyncio.Context) -> None:
    index = KvIndex()
    async with Publisher() as pub:
        stream, task = await follow(ctx, index, pub)
        await live(stream, pub)
        await pub.publish([stored([11], None, A), stored([12], 11, B)])
        await until(lambda: held(index, A + B) == 2)
        pub.restart()
        await pub.publish([stored([31], None, C)])
        await until(lambda: held(index, C) == 1)
        assert held(index, A) == 0 and stream.counts.restarts == 1
        await stop(task)


async def test_a_silent_stream_that_stops_answering_is_emptied(ctx: zmq.asyncio.Context) -> None:
    index = KvIndex()
    async with Publisher() as pub:
        stream, task = await follow(ctx, index, pub, probe=0.2)
        await pub.publish([stored([11], None, A)])
        await until(lambda: held(index, A) == 1)
        pub.answering = False
        await until(lambda: stream.counts.lost == 1)
        assert held(index, A) == 0
        pub.answering = True  # back: rebuilt from its replay
        await until(lambda: held(index, A) == 1)
        await stop(task)


async def test_a_stream_stops_when_cancelled_in_the_middle_of_a_replay(
    ctx: zmq.asyncio.Context,
) -> None:
    """A removed worker's stream is cancelled whenever it happens to be: here while it
    probes (replays) every millisecond. On 3.11 ``asyncio.wait_for`` swallowed a cancel
    that landed as the replay's frames did, and the stream ran on forever."""
    async with Publisher() as pub:
        for i in range(50):
            await pub.publish([stored([100 + i], None, [i, 2, 3, 4])])
        for trial in range(40):
            stream = RankStream(ctx, KvIndex(), NAME, pub.endpoint, pub.replay_endpoint, 0.001, 0.5)
            task = asyncio.create_task(stream.run())
            RUNNING.append(task)
            await asyncio.sleep(0.001 + trial * 0.0005)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2)
            assert done, f"trial {trial}: the stream ignored its cancel"
