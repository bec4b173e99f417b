"""What the real-engine groups ask of engines and routers."""

from __future__ import annotations

import itertools
from collections import Counter
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


async def served_by(
    http: aiohttp.ClientSession, url: str, sent: dict[str, Any], n: int
) -> Counter[str]:
    """``n`` completions of ``sent`` through the router at ``url``, one after another:
    how many each target served (its ``x-dprouter-target``); every one a 200."""
    served: Counter[str] = Counter()
    for _ in range(n):
        async with http.post(url + "/v1/completions", json=sent) as r:
            assert r.status == 200, await r.text()
            served[r.headers["x-dprouter-target"]] += 1
    return served


async def loads(http: aiohttp.ClientSession, url: str) -> dict[int, dict[str, Any]]:
    """An SGLang engine's ``/v1/loads``, by DP rank."""
    async with http.get(url + "/v1/loads") as r:
        return {x["dp_rank"]: x for x in (await r.json())["loads"]}
