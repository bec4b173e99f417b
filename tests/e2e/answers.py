"""What the real-engine groups ask of engines and routers."""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp

NONCE = itertools.count()


def prompt() -> str:
    """Words in an order the engines have not seen: no prefix cache hides them."""
    n = next(NONCE)
    return f"pair {n} carries the cache {n % 5} ways from prefill {n % 3} to decode"


async def ask(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    sent: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    async with http.post(url + path, json=sent, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.text()


async def loads(http: aiohttp.ClientSession, url: str) -> dict[int, dict[str, Any]]:
    """An SGLang engine's ``/v1/loads``, by DP rank."""
    async with http.get(url + "/v1/loads") as r:
        return {x["dp_rank"]: x for x in (await r.json())["loads"]}
