"""A bounded, closed-loop HTTP load: ``connections`` clients, each sending its next
request when the last one is answered, for ``seconds`` or ``requests`` at most."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from dprouter.sim.offline.report import Percentiles, percentiles


@dataclass
class Outcome:
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    chunks: int = 0  # SSE events received
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    @property
    def latency(self) -> Percentiles:
        return percentiles(self.latencies)


async def closed_loop(
    url: str,
    connections: int,
    seconds: float,
    stream: bool = False,
    requests: int | None = None,
    model: str = "bench",
    headers: Mapping[str, str] | None = None,
) -> Outcome:
    out = Outcome()
    body = {"model": model, "prompt": "measure me", "max_tokens": 16, "stream": stream}
    left = requests if requests is not None else 1 << 60
    stop_at = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < stop_at:
            left -= 1
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        out.errors[f"http_{r.status}"] += 1
                        continue
                    out.chunks += raw.count(b"data: ") if stream else 0
            except aiohttp.ClientConnectionError as exc:
                out.errors["reset" if "reset" in str(exc).lower() else "connection"] += 1
                continue
            except TimeoutError:
                out.errors["timeout"] += 1
                continue
            out.answered += 1
            out.latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(connections)))
        out.seconds = time.perf_counter() - t0
    return out
