"""A stand-in KV-event publisher speaking the engines' wire format (vLLM's
``ZmqEventPublisher``): PUB frames ``(topic, seq as 8-byte big-endian, msgpack batch)``
and a ROUTER replay socket answering ``[id, b"", start]`` with ``[id, b"", seq, payload]``
frames and an end marker of seq -1. Tests control the sequence to make gaps and restarts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END = (-1).to_bytes(8, "big", signed=True)


def bind_free(sock: zmq.asyncio.Socket, port: int = 0) -> str:
    if port:
        sock.bind(f"tcp://127.0.0.1:{port}")
    else:
        sock.bind("tcp://127.0.0.1:*")
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class Publisher:
    def __init__(self, rank: int = 0, port: int = 0, replay: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.rank = rank
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = bind_free(self.pub, port)
        except zmq.ZMQError:
            self.pub.close(0)
            self.ctx.term()
            raise
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = bind_free(self.router)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.answering = True
        self._serve: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Publisher:
        if self.router is not None:
            self._serve = asyncio.create_task(self._replays())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._serve is not None:
            self._serve.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serve
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()

    def batch(self, events: list[Any]) -> bytes:
        return bytes(msgpack.packb([1.0, events, self.rank]))

    async def publish(self, events: list[Any], *, send: bool = True) -> int:
        """The next batch, buffered for replay; ``send=False`` loses it on the wire."""
        seq, payload = self.seq, self.batch(events)
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """A new engine: the sequence starts again, the buffer is empty."""
        self.seq = 0
        self.buffer = []

    async def _replays(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            if not self.answering:
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", END, b""])


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = 4) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, size, None, "GPU"]


def removed(hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]
