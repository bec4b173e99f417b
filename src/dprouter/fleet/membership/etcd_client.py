"""A small etcd v3 client over the JSON gateway that every etcd server serves itself.

The router already speaks HTTP through aiohttp, so membership needs no gRPC stack:
``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange``, ``/v3/lease/*`` and a
streamed ``/v3/watch``. Keys and values travel base64-encoded; int64 fields come
back as strings (and are left out when zero). Several endpoints: each call tries
them in turn, starting with the last one that answered.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from dprouter.core.errors import Compacted, EtcdError

WATCH_BUFFER = 1 << 23  # bytes: a watch message may be as large as etcd's 1.5 MiB request cap


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True)
class Change:
    key: str
    value: bytes | None  # None: the key was deleted
    revision: int


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b64(b"\0")  # every key
    raw[-1] += 1
    return b64(bytes(raw))


class Etcd:
    def __init__(
        self, endpoints: Sequence[str], session: aiohttp.ClientSession, timeout: float = 2.0
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._first = 0  # the endpoint that answered last

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One unary call, on the first endpoint that answers."""
        failures = []
        n = len(self.endpoints)
        for i in range(n):
            at = (self._first + i) % n
            url = self.endpoints[at] + path
            try:
                async with self.session.post(url, json=body, timeout=self.timeout) as r:
                    raw = await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures.append(f"{url}: {type(exc).__name__} {exc}".strip())
                continue
            self._first = at
            answer = orjson.loads(raw) if raw else {}
            if r.status != 200 or "error" in answer:
                raise EtcdError(f"{url}: HTTP {r.status} {answer.get('message') or raw[:200]!r}")
            return dict(answer.get("result", answer))
        raise EtcdError("no etcd endpoint answered: " + "; ".join(failures))

    async def read(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key under ``prefix``, and the revision they were read at."""
        answer = await self.call(
            "/v3/kv/range", {"key": b64(prefix), "range_end": prefix_end(prefix)}
        )
        entries = [
            Entry(unb64(kv["key"]).decode(), unb64(kv.get("value")), int(kv.get("mod_revision", 0)))
            for kv in answer.get("kvs", ())
        ]
        return entries, int(answer["header"]["revision"])

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, key: str) -> int:
        """Delete ``key``; how many keys went (0 or 1)."""
        answer = await self.call("/v3/kv/deleterange", {"key": b64(key)})
        return int(answer.get("deleted", 0))

    async def write(self, changes: Sequence[tuple[str, bytes | None]], lease: int = 0) -> int:
        """Put each ``(key, value)`` (on ``lease``), or delete it (value None), all in one
        transaction; the revision they were written at. etcd takes 128 operations per
        transaction by default (``--max-txn-ops``)."""
        ops: list[dict[str, Any]] = []
        for key, value in changes:
            if value is None:
                ops.append({"request_delete_range": {"key": b64(key)}})
                continue
            put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
            if lease:
                put["lease"] = str(lease)
            ops.append({"request_put": put})
        answer = await self.call("/v3/kv/txn", {"success": ops})
        return int(answer["header"]["revision"])

    async def claim(
        self, key: str, value: bytes, lease: int, expect: bytes | None
    ) -> tuple[bool, bytes | None]:
        """Write ``value`` if the key is absent (``expect`` None) or holds ``expect``, in one
        transaction: (written, the value it holds otherwise; None if it is absent)."""
        if expect is None:
            compare = {"key": b64(key), "target": "CREATE", "create_revision": "0"}
        else:
            compare = {"key": b64(key), "target": "VALUE", "value": b64(expect)}
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = await self.call(
            "/v3/kv/txn",
            {
                "compare": [{**compare, "result": "EQUAL"}],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": b64(key)}}],
            },
        )
        if answer.get("succeeded"):
            return True, None
        found = answer["responses"][0].get("response_range", {}).get("kvs", ())
        return False, (unb64(found[0].get("value")) if found else None)

    async def grant(self, ttl: int) -> int:
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its remaining TTL (0: it expired, and its keys are gone)."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):  # expired already: what revoking was for
                raise

    async def compact(self, revision: int) -> None:
        await self.call("/v3/kv/compaction", {"revision": str(revision)})

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Change]]:
        """The changes under ``prefix`` from revision ``start`` on, a batch at a time, for as
        long as the stream lasts; ``Compacted`` if etcd no longer has ``start``."""
        body = {
            "create_request": {
                "key": b64(prefix),
                "range_end": prefix_end(prefix),
                "start_revision": str(start),
            }
        }
        url = self.endpoints[self._first] + "/v3/watch"
        endless = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.total)
        try:
            # a line is one message: a transaction's events come in one (aiohttp's default
            # line limit is 512 KiB)
            async with self.session.post(
                url, json=body, timeout=endless, read_bufsize=WATCH_BUFFER
            ) as r:
                if r.status != 200:
                    raise EtcdError(f"{url}: HTTP {r.status}")
                async for line in r.content:  # one JSON message per line
                    if not line.strip():
                        continue
                    message = orjson.loads(line)
                    if "error" in message:
                        raise EtcdError(f"{url}: {message['error']}")
                    result = message.get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise Compacted(f"revision {start} is compacted")
                    if result.get("canceled"):
                        raise EtcdError(f"{url}: watch canceled: {result.get('cancel_reason')}")
                    events = result.get("events")
                    if events:
                        yield [_change(e) for e in events]
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._first = (self._first + 1) % len(self.endpoints)  # try the next one next
            raise EtcdError(f"{url}: watch broke: {type(exc).__name__} {exc}") from exc
        self._first = (self._first + 1) % len(self.endpoints)
        raise EtcdError(f"{url}: watch stream ended")


def _change(event: dict[str, Any]) -> Change:
    kv = event["kv"]
    deleted = event.get("type") == "DELETE"
    value = None if deleted else unb64(kv.get("value"))
    return Change(unb64(kv["key"]).decode(), value, int(kv.get("mod_revision", 0)))
