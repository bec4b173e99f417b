"""Scenario 6, burst: thousands of connections opened at once; nothing reset, nothing lost.

Every request of a burst waits at a gate until all are created, then all go
at once, each on its own connection. Plain bursts hit a trivial backend
through each router; P/D bursts (SGLang's flow by default; ``--pd vllm-nixl``
too) hit simulated prefill (2 x DP8) and decode (1 x DP8) engines through
dprouter. ``--requests N`` sets the burst sizes. Every process is separate and
stopped by its PID.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in, urls_in
from dprouter.bench.report.plots import bars
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.overhead import start_router
from dprouter.sim.offline.report import percentiles


async def burst(url: str, n: int, model: str = "bench") -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    said: Counter[str] = Counter()  # what the failed answers said, to say why in the report
    latencies: list[float] = []
    gate = asyncio.Event()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        await gate.wait()
        t0 = time.perf_counter()
        try:
            body = {"model": model, "prompt": f"burst {i}", "max_tokens": 8}
            async with session.post(url + "/v1/completions", json=body) as r:
                answer = await r.read()
                outcomes["ok" if r.status == 200 else f"http_{r.status}"] += 1
                if r.status != 200:
                    said[f"HTTP {r.status}: {answer[:200].decode(errors='replace')}"] += 1
        except aiohttp.ClientConnectionError as exc:
            outcomes["reset" if "reset" in str(exc).lower() else "connection_error"] += 1
        except TimeoutError:
            outcomes["timeout"] += 1
        latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(n)]
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        gate.set()
        await asyncio.gather(*tasks)
        drained = time.perf_counter() - t0
    p = percentiles(latencies)
    answered = sum(outcomes.values())
    return {
        "ok": outcomes["ok"],
        "http_errors": sum(v for k, v in outcomes.items() if k.startswith("http_")),
        "resets": outcomes["reset"],
        "connection_errors": outcomes["connection_error"],
        "timeouts": outcomes["timeout"],
        "lost": n - answered,
        "drain_s": drained,
        "p50_s": p.p50,
        "p99_s": p.p99,
        "errors_said": dict(said.most_common(3)),
    }


async def plain(kind: str, n: int) -> dict[str, Any]:
    backend = Proc([sys.executable, "-m", "dprouter.bench.harness.backend", "--port", "0"])
    try:
        proc, url = await start_router(kind, url_in(await backend.start("ready")))
        try:
            return await burst(url, n)
        finally:
            if proc is not None:
                await proc.stop()
    finally:
        await backend.stop()


async def pd(n: int, mode: str = "sglang") -> dict[str, Any]:
    """A burst through ``dprouter serve --pd MODE`` in front of simulated engines."""
    sim = [*DPROUTER, "sim", "--pd", mode, "--dp-size", "8", "--max-running", "1024"]
    sim += ["--port", "0"]  # every engine on a port of its own, listed in its output
    prefill = Proc([*sim, "--role", "prefill", "--engines", "2", "--bootstrap-port", "0"])
    decode = Proc([*sim, "--role", "decode", "--kv-wait", "120"])
    procs = [prefill, decode]
    try:
        await prefill.start("ready")
        await decode.start("ready")
        args = [*DPROUTER, "serve", "--pd", mode, "--port", "0", "--load-interval", "0"]
        for line in prefill.lines:
            if line.startswith("prefill-"):
                port = re.search(r"bootstrap_port=(\d+)", line)  # SGLang, Mooncake
                args += ["--prefill", url_in(line) + (f",bootstrap_port={port[1]}" if port else "")]
        args += [a for u in urls_in(decode.lines, "decode-") for a in ("--decode", u)]
        router = Proc(args)
        procs.append(router)
        url = url_in(await router.start(r"dprouter on http://"))
        await peer_routers.until_serving(url, model="sim-model", proc=router)
        return await burst(url, n, model="sim-model")
    finally:
        for proc in reversed(procs):
            await proc.stop()


async def measure(sizes: Sequence[int], pd_modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for n in sizes:
        for kind in ("dprouter", *peer_routers.available()):
            found[f"{kind}, plain, {n}"] = await plain(kind, n)
        for mode in pd_modes:
            found[f"dprouter, P/D {mode}, {n}"] = await pd(n, mode)
    return found


def run(
    quick: bool, out: Path, sizes: Sequence[int] = (), pd_modes: Sequence[str] = ("sglang",)
) -> Result:
    """Bursts of each size (default: 1024 quick, else 4096 and 10,000): plain through
    dprouter and the peers, and through dprouter in each P/D mode of ``pd_modes``."""
    sizes = sizes or ((1024,) if quick else (4096, 10_000))
    found = asyncio.run(measure(sizes, pd_modes))
    rows: list[list[Cell]] = [
        [
            name,
            int(m["ok"]),
            int(m["http_errors"]),
            int(m["resets"]),
            int(m["connection_errors"]),
            int(m["timeouts"]),
            int(m["lost"]),
            m["drain_s"],
            m["p50_s"],
            m["p99_s"],
        ]
        for name, m in found.items()
    ]
    bars(
        out / "burst.png",
        list(found),
        {"seconds to drain": [m["drain_s"] for m in found.values()]},
        "bursts: time until every request was answered",
        "s",
    )
    ours = {k: m for k, m in found.items() if k.startswith("dprouter")}
    failures = ("http_errors", "resets", "connection_errors", "timeouts", "lost")
    clean = all(m[f] == 0 for m in ours.values() for f in failures)
    why = [
        f"{name}: {text} ({count}x)"
        for name, m in found.items()
        for text, count in m["errors_said"].items()
    ]
    return Result(
        scenario="burst",
        title="6. Burst: every connection at once",
        method=(
            "All requests created first, then released together, each on its own "
            "connection (closed after its answer); 8 output tokens each; client timeout "
            f"300 s. Plain: trivial backend. P/D ({', '.join(pd_modes)}): simulated prefill "
            "2 x DP8 and decode 1 x DP8, each process separate. Drain: from release to the "
            "last answer."
        ),
        tables=[
            Table(
                [
                    "burst",
                    "200",
                    "HTTP errors",
                    "resets",
                    "connection errors",
                    "timeouts",
                    "lost",
                    "drain s",
                    "p50 s",
                    "p99 s",
                ],
                rows,
            )
        ],
        verdict=(
            "dprouter answered every request of every burst: "
            + ("no reset, no lost request." if clean else "SOMETHING WAS LOST (see table).")
            + "".join(f" {line}." for line in why)
        ),
        checks={"dprouter: zero resets and zero lost requests": clean},
        plots=["burst.png"],
        data=found,
    )
