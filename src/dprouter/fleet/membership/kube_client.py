"""A small Kubernetes API client: list and watch the pods of one namespace, over aiohttp.

Membership needs two calls of ``GET /api/v1/namespaces/NS/pods?labelSelector=...``:
a list, whose ``metadata.resourceVersion`` says where it was read, then a watch
from that version (``watch=1``, ``allowWatchBookmarks=true``): newline-delimited
JSON events that end, cleanly, after ``timeoutSeconds``. A version the server no
longer keeps is ``Gone`` -- HTTP 410, or (the usual form) an ``ERROR`` event
whose ``Status`` has code 410 -- and the caller lists again.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from yarl import URL

from dprouter.core.errors import Gone, KubeError
from dprouter.fleet.membership.kubeconfig import Access

WATCH_BUFFER = 1 << 23  # bytes: one event is one pod, which can be large (many annotations)


@dataclass(frozen=True)
class Event:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class Kube:
    def __init__(self, access: Access, session: aiohttp.ClientSession, timeout: float = 5.0):
        self.access = access
        self.session = session
        self.timeout = timeout

    def _url(self, namespace: str, query: dict[str, str]) -> URL:
        base = URL(self.access.server) / "api/v1/namespaces" / namespace / "pods"
        return base.with_query(query)

    def _headers(self) -> dict[str, str]:
        token = self.access.token.get() if self.access.token is not None else ""
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _refused(self, url: URL, status: int, body: bytes) -> KubeError:
        if status == 401 and self.access.token is not None:
            self.access.token.expire()  # a rotated token: read it again before the next call
        message = body[:300].decode(errors="replace")
        if status == 410:
            return Gone(f"{url.path}: HTTP 410 {message}")
        return KubeError(f"{url.path}: HTTP {status} {message}")

    async def list_pods(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """The pods (as the API writes them) and the version they were read at."""
        url = self._url(namespace, {"labelSelector": selector} if selector else {})
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with self.session.get(
                url, headers=self._headers(), ssl=self._ssl, timeout=timeout
            ) as r:
                body = await r.read()
                if r.status != 200:
                    raise self._refused(url, r.status, body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"{self.access.server}: {type(exc).__name__} {exc}".strip()) from exc
        try:
            answer = orjson.loads(body)
            items = [p for p in answer.get("items") or () if isinstance(p, dict)]
            return items, str(answer["metadata"]["resourceVersion"])
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
            raise KubeError(f"{url.path}: not a pod list: {body[:200]!r}") from exc

    @property
    def _ssl(self) -> ssl.SSLContext | bool:
        return self.access.ssl if self.access.ssl is not None else True

    async def watch_pods(
        self, namespace: str, selector: str, version: str, seconds: int
    ) -> AsyncIterator[Event]:
        """The changes after ``version``, until the server ends the stream (after
        ``seconds``). ``Gone``: list again; ``KubeError``: the stream broke."""
        query = {
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        if selector:
            query["labelSelector"] = selector
        url = self._url(namespace, query)
        endless = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)
        try:
            async with self.session.get(
                url,
                headers=self._headers(),
                ssl=self._ssl,
                timeout=endless,
                read_bufsize=WATCH_BUFFER,
            ) as r:
                if r.status != 200:
                    raise self._refused(url, r.status, await r.read())
                async for line in r.content:  # one event per line
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    kind, obj = event.get("type"), event.get("object")
                    if not isinstance(obj, dict):
                        raise KubeError(f"{url.path}: not a watch event: {line[:200]!r}")
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone(f"{url.path}: {obj.get('message', 'expired')}")
                        raise KubeError(f"{url.path}: watch error {obj.get('message', obj)}")
                    yield Event(str(kind), obj)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
            raise KubeError(f"{url.path}: watch broke: {type(exc).__name__} {exc}") from exc
