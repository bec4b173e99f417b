"""One ZMQ publisher per DP rank, as vLLM and SGLang run them: PUB at base port + rank,
an optional ROUTER replay socket at replay base + rank, a sequence from 0 per start.

Frames (both engines): ``(topic, sequence as 8-byte big-endian, msgpack payload)``.
Replay: a client sends ``(b"", start sequence as 8 bytes big-endian)`` (a REQ or
DEALER socket); it gets ``(topic, seq, payload)`` for each buffered batch from there,
then ``(b"", -1 as 8 signed bytes, b"")`` (vLLM 0.32.0 and SGLang 0.5.23 ``_service_replay``).

Sending never blocks the engine: a PUB socket drops at its high-water mark, and the
send is non-blocking besides. A wildcard host (``*``) binds the simulator's own host,
so tests stay on loopback; a concrete host is connected to, as the engines do. Port 0
picks a free base where base + rank is free for every rank (retrying on a conflict),
and a restart binds the same ports again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable

import zmq
import zmq.asyncio

from dprouter.sim.model.kvevents import KvEventsConfig, encode_batch
from dprouter.sim.model.rank import Rank

END_SEQ = (-1).to_bytes(8, "big", signed=True)
WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
ATTEMPTS = 50  # free-base searches before giving up


def split(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


class RankPublisher:
    """A rank's PUB socket, its sequence and the replay buffer of its last batches."""

    def __init__(
        self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None, config: KvEventsConfig
    ) -> None:
        self.pub = pub
        self._router = replay
        self.replay = zmq.asyncio.Socket.from_socket(replay) if replay is not None else None
        self.topic = config.topic.encode()
        self.seq = 0
        self.dropped = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._task: asyncio.Task[None] | None = None
        if self.replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # a slow subscriber loses batches; the replay buffer keeps them
        self.buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue  # as the engines: a malformed request gets no answer
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.replay.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.replay is not None:
            self.replay.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self.pub.close(linger=0)


class KvPublishers:
    """Every rank's publisher of one engine; lives across restarts to keep its ports."""

    def __init__(self, config: KvEventsConfig, persona: str, dp_size: int, host: str) -> None:
        self.config = config
        self.persona = persona
        self.dp_size = dp_size
        self.host = host
        self.base = split(config.endpoint)[1]  # resolved on the first start when 0
        self.replay_base = split(config.replay_endpoint)[1] if config.replay_endpoint else None
        self.ranks: list[RankPublisher] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None

    def _binds(self, endpoint: str) -> bool:
        return split(endpoint)[0] in WILDCARDS

    @property
    def endpoints(self) -> list[str]:
        """Where a subscriber connects, per rank."""
        if self._binds(self.config.endpoint):
            return [self._address(self.base + r) for r in range(self.dp_size)]
        host = self.config.endpoint.rpartition(":")[0]
        return [f"{host}:{self.base + r}" for r in range(self.dp_size)]

    @property
    def replay_endpoints(self) -> list[str | None]:
        if self.replay_base is None:
            return [None] * self.dp_size
        return [self._address(self.replay_base + r) for r in range(self.dp_size)]

    def _offset(self, endpoint: str | None, base: int | None, rank: int) -> str | None:
        """The endpoint an engine reports for a rank (its configured host, port + rank)."""
        if endpoint is None or base is None:
            return None
        return f"{endpoint.rpartition(':')[0]}:{base + rank}"

    def given(self) -> dict[str, object]:
        """The engine's ``--kv-events-config`` as it was given, with the base ports it
        bound (a port 0 resolved): what SGLang's ``/server_info`` says as
        ``kv_events_config``; rank r adds r to each port."""
        wire = self.config.wire()
        wire["endpoint"] = self._offset(self.config.endpoint, self.base, 0)
        wire["replay_endpoint"] = self._offset(self.config.replay_endpoint, self.replay_base, 0)
        return wire

    def sources(self) -> dict[str, dict[str, object]]:
        """vLLM's ``GET /kv_event_sources``: each rank's resolved publisher config."""
        out: dict[str, dict[str, object]] = {}
        for r in range(self.dp_size):
            wire = self.config.wire()
            wire["endpoint"] = self._offset(self.config.endpoint, self.base, r)
            wire["replay_endpoint"] = self._offset(self.config.replay_endpoint, self.replay_base, r)
            out[str(r)] = wire
        return out

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.set_hwm(self.config.hwm)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    def _address(self, port: int | str) -> str:
        host = self.host.strip("[]")
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def _bind_range(self, kind: int, base: int) -> tuple[int, list[zmq.Socket[bytes]]]:
        """Bind ``base + rank`` for every rank; with base 0, a free base found by trying."""
        for _ in range(ATTEMPTS):
            socks: list[zmq.Socket[bytes]] = []
            try:
                first = self._socket(kind)
                socks.append(first)
                first.bind(self._address(base or "*"))
                start = split(first.getsockopt_string(zmq.LAST_ENDPOINT))[1]
                for r in range(1, self.dp_size):
                    sock = self._socket(kind)
                    socks.append(sock)
                    sock.bind(self._address(start + r))
                return start, socks
            except zmq.ZMQError:
                for sock in socks:
                    sock.close(linger=0)
                if base != 0:
                    raise
        raise OSError(f"no {self.dp_size} consecutive free ports for KV events on {self.host}")

    async def start(self) -> None:
        """Fresh publishers (sequences from 0, empty buffers), as a restarted engine has."""
        self._ctx = zmq.Context()
        config = self.config
        if self._binds(config.endpoint):
            self.base, pubs = self._bind_range(zmq.PUB, self.base)
        else:
            pubs = []
            for r in range(self.dp_size):
                sock = self._socket(zmq.PUB)
                sock.connect(self.endpoints[r])
                pubs.append(sock)
        replays: list[zmq.Socket[bytes] | None] = [None] * self.dp_size
        if self.replay_base is not None:
            self.replay_base, bound = self._bind_range(zmq.ROUTER, self.replay_base)
            replays = list(bound)
        self.ranks = [RankPublisher(p, q, config) for p, q in zip(pubs, replays, strict=True)]

    def flush(self, ranks: Iterable[Rank]) -> None:
        """Publish what each rank's cache recorded since the last flush: one batch per
        rank per engine step, none for a rank with nothing to say (as the engines)."""
        if not self.ranks:
            return
        for rank in ranks:
            events = rank.cache.take_events()
            if events:
                payload = encode_batch(
                    time.time(), events, rank.index, self.persona, self.config.encoding
                )
                self.ranks[rank.index].publish(payload)

    async def stop(self) -> None:
        for publisher in self.ranks:
            await publisher.close()
        self.ranks = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes every socket: the ports are free at once
            self._ctx = None
