"""What the P/D groups ask of engines and routers, and how they read the engines' counts."""

from __future__ import annotations

import itertools
import re
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


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


def series(text: str, name: str) -> float:
    """The sum of a Prometheus series' samples (0 when absent); ``name`` may carry labels."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


def per_rank(text: str, name: str, label: str = "dp_rank") -> dict[int, float]:
    """A series summed per DP rank (SGLang's ``dp_rank`` label, vLLM's ``engine``)."""
    out: dict[int, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        rank = re.search(rf'{label}="(\d+)"', labels)
        if rank is not None:
            out[int(rank[1])] = out.get(int(rank[1]), 0.0) + float(value)
    return out
