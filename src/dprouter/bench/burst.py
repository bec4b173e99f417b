"""Scenario 6, burst: thousands of connections opened at once; nothing reset, nothing lost.

Every request of a burst waits at a gate until all are created, then all go
at once, each on its own connection. Plain bursts hit a trivial backend
through each router; P/D bursts hit simulated SGLang prefill (2 x DP8) and
decode (1 x DP8) engines through dprouter. Every process is separate and
stopped by its PID.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.bench import peers
from dprouter.bench.overhead import start_router
from dprouter.bench.plots import bars
from dprouter.bench.procs import DPROUTER, Proc, free_port
from dprouter.bench.results import Cell, Result, Table
from dprouter.sim.report import percentiles


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
    port = free_port()
    backend = Proc([sys.executable, "-m", "dprouter.bench.backend", "--port", str(port)])
    await backend.start("ready")
    try:
        proc, url = await start_router(kind, f"http://127.0.0.1:{port}")
        try:
            return await burst(url, n)
        finally:
            if proc is not None:
                await proc.stop()
    finally:
        await backend.stop()


async def pd(n: int) -> dict[str, Any]:
    sim = [*DPROUTER, "sim", "--pd", "sglang", "--dp-size", "8", "--max-running", "1024"]
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    prefill = Proc(
        [
            *sim,
            "--role",
            "prefill",
            "--engines",
            "2",
            "--port",
            str(p_port),
            "--bootstrap-port",
            "0",
        ]
    )
    decode = Proc([*sim, "--role", "decode", "--port", str(d_port), "--kv-wait", "120"])
    procs = [prefill, decode]
    try:
        await prefill.start("ready")
        await decode.start("ready")
        lines = [ln for ln in prefill.lines if ln.startswith("prefill-")]
        args = [*DPROUTER, "serve", "--pd", "sglang", "--port", str(r_port), "--load-interval", "0"]
        for ln in lines:
            url, port = ln.split()[3], ln.split("bootstrap_port=")[1].strip()
            args += ["--prefill", f"{url},bootstrap_port={port}"]
        args += ["--decode", f"http://127.0.0.1:{d_port}"]
        router = Proc(args)
        procs.append(router)
        await router.start(r"dprouter on http://")
        url = f"http://127.0.0.1:{r_port}"
        await peers.until_serving(url, model="sim-model")
        return await burst(url, n, model="sim-model")
    finally:
        for proc in reversed(procs):
            await proc.stop()


async def measure(quick: bool) -> dict[str, dict[str, Any]]:
    sizes = (1024,) if quick else (4096, 10_000)
    found: dict[str, dict[str, Any]] = {}
    for n in sizes:
        for kind in ("dprouter", *peers.available()):
            found[f"{kind}, plain, {n}"] = await plain(kind, n)
        found[f"dprouter, P/D sglang, {n}"] = await pd(n)
    return found


def run(quick: bool, out: Path) -> Result:
    found = asyncio.run(measure(quick))
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
            "300 s. Plain: trivial backend. P/D: simulated SGLang prefill 2 x DP8 and decode "
            "1 x DP8, each process separate. Drain: from release to the last answer."
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
