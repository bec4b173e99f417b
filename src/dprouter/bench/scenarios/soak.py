"""Soak: minutes of mixed streaming load through dprouter, a fault injected every minute.

Not part of ``bench all`` -- it runs for minutes by design:
``dprouter bench soak --out bench/results/soak`` (10 minutes; ``--quick``: 2).
Three simulated vLLM engines x DP2 run in this process, so faults can be
injected into them; dprouter runs in its own process, its memory read from
/proc. 20 s into each minute one fault, in turn: an engine crashes and
restarts 10 s later; an engine hangs for 10 s (the router's read timeout is
5 s); an engine fails 10 % of requests for 20 s. Clients check every answer:
a 200 with the whole body, or a stream ending in ``[DONE]`` with no error event.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dprouter.bench.harness.peer_routers import until_serving
from dprouter.bench.harness.procs import DPROUTER, Proc, rss_mb, url_in
from dprouter.bench.report.plots import lines
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig, Faults

CLIENTS = 24  # half stream, half not
ENGINE = EngineConfig(dp_size=2, time_scale=0.05, model="bench")
FAULTS = ("crash, restart after 10 s", "hang for 10 s", "10 % failures for 20 s")


async def inject(cluster: SimCluster, minute: int) -> None:
    server = cluster[minute % len(cluster)]
    kind = minute % len(FAULTS)
    if kind == 0:
        await server.crash()
        await asyncio.sleep(10)
        await server.start()
        return
    calm = server.config
    server.config = replace(calm, faults=Faults(hang=True) if kind == 1 else Faults(fail_rate=0.1))
    await asyncio.sleep(10 if kind == 1 else 20)
    server.config = calm


async def client(url: str, stream: bool, stop_at: float, seen: list[Counter[str]]) -> None:
    body = {"model": "bench", "prompt": "soak", "max_tokens": 16, "stream": stream}
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while (now := time.monotonic()) < stop_at:
            minute = seen[min(int((now - t0) // 60), len(seen) - 1)]
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    raw = await r.read()
            except aiohttp.ClientConnectionError as exc:
                minute["reset" if "reset" in str(exc).lower() else "connection error"] += 1
                continue
            except TimeoutError:
                minute["timeout"] += 1
                continue
            if r.status != 200:
                minute[f"HTTP {r.status}"] += 1
            elif stream and b'data: {"error"' in raw:
                minute["stream error event"] += 1
            elif stream and not raw.endswith(b"data: [DONE]\n\n"):
                minute["stream unfinished"] += 1
            else:
                minute["ok"] += 1


async def outstanding(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dprouter_outstanding"
    )


async def soak(minutes: int) -> dict[str, object]:
    async with SimCluster([ENGINE] * 3) as cluster:
        options = ["--read-timeout", "5", "--health-interval", "1", "--breaker-cooldown", "5"]
        argv = [*DPROUTER, "serve", "--port", "0", *options]
        router = Proc([*argv, *(a for u in cluster.urls for a in ("--worker", u))])
        url = url_in(await router.start(r"dprouter on http://"))
        try:
            await until_serving(url)
            rss = [rss_mb(router.pid)]
            seen: list[Counter[str]] = [Counter() for _ in range(minutes)]
            stop_at = time.monotonic() + minutes * 60
            load = [
                asyncio.create_task(client(url, i % 2 == 0, stop_at, seen)) for i in range(CLIENTS)
            ]
            for minute in range(minutes):
                await asyncio.sleep(20)
                await inject(cluster, minute)
                await asyncio.sleep(
                    max(0.0, stop_at - (minutes - minute - 1) * 60 - time.monotonic())
                )
                rss.append(rss_mb(router.pid))
            await asyncio.gather(*load)
            await asyncio.sleep(1)
            left = await outstanding(url)
        finally:
            await router.stop()
    return {"minutes": [dict(c) for c in seen], "rss_mb": rss, "outstanding_after": left}


def run(quick: bool, out: Path) -> Result:
    minutes = 2 if quick else 10
    found = asyncio.run(soak(minutes))
    per_minute: list[dict[str, int]] = found["minutes"]  # type: ignore[assignment]
    rss: list[float] = found["rss_mb"]  # type: ignore[assignment]
    causes = sorted({k for m in per_minute for k in m} - {"ok"})
    rows: list[list[Cell]] = [
        [i + 1, FAULTS[i % len(FAULTS)], m.get("ok", 0), *(m.get(c, 0) for c in causes), rss[i + 1]]
        for i, m in enumerate(per_minute)
    ]
    total = Counter[str]()
    for m in per_minute:
        total.update(m)
    lines(out / "soak.png", list(range(len(rss))), {"router RSS MB": rss}, "soak", "minute", "MB")
    failed = sum(v for k, v in total.items() if k != "ok")
    lost = sum(total[k] for k in ("reset", "connection error", "timeout", "stream unfinished"))
    checks = {
        "no request lost: every one answered, or told of its failure": lost == 0,
        "outstanding counts back to zero at the end": found["outstanding_after"] == 0,
        "memory: router RSS grew by less than 10 % over the run": rss[-1] < rss[0] * 1.10,
    }
    return Result(
        scenario="soak",
        title=f"Soak: {minutes} minutes of mixed streaming load, a fault every minute",
        method=(
            f"{CLIENTS} closed-loop clients (half streaming, 16 tokens each) through dprouter "
            "(its own process: --read-timeout 5 --health-interval 1 --breaker-cooldown 5) in "
            "front of 3 simulated vLLM engines x DP2 at 0.05 wall s per simulated s; 20 s into "
            "each minute one fault, in turn, on engine (minute mod 3). RSS: VmRSS of the "
            "router, after warm-up and at each minute's end."
        ),
        tables=[Table(["minute", "fault", "ok", *causes, "router RSS MB"], rows)],
        verdict=(
            f"{total['ok']:,} requests answered in full, {failed:,} told of a failure "
            f"({', '.join(f'{k}: {total[k]}' for k in causes) or 'none'}), {lost} lost; "
            f"router RSS {rss[0]:.0f} -> {rss[-1]:.0f} MB; outstanding after: "
            f"{found['outstanding_after']:.0f}."
        ),
        checks=checks,
        plots=["soak.png"],
        data=found,
    )
