"""A burst of simultaneous P/D requests through dprouter: nothing reset, nothing lost.

    .venv/bin/python bench/pd_burst.py [--requests 4096] [--pd sglang|vllm-nixl]

Starts, each in its own process on loopback: 2 prefill engines x DP8 and 1
decode engine x DP8 (simulated, ``dprouter sim``) and the router
(``dprouter serve --pd ...``). Then opens every connection at once (one
request each, non-stream, 8 output tokens) and counts what came back: 200s,
HTTP errors, connection resets, timeouts, and requests that got no answer.
Every process is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import statistics
import sys
import time
from collections import Counter

import aiohttp

PY = [sys.executable, "-m", "dprouter"]


async def spawn(*args: str, ready: str) -> tuple[asyncio.subprocess.Process, list[str]]:
    """Start a dprouter process; returns it and its output lines up to ``ready``."""
    proc = await asyncio.create_subprocess_exec(
        *PY,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    while not any(ready in line for line in lines):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            raise RuntimeError(f"{args[0]} exited: {''.join(lines)}")
        lines.append(line)
    asyncio.get_running_loop().create_task(_drain(proc))
    return proc, lines


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def burst(url: str, n: int) -> tuple[Counter[str], list[float], float]:
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    start = asyncio.Event()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        await start.wait()
        t0 = time.perf_counter()
        try:
            body = {"prompt": f"burst request {i}", "max_tokens": 8}
            async with session.post(url + "/v1/completions", json=body) as r:
                data = await r.json()
                ok = r.status == 200 and data["usage"]["completion_tokens"] == 8
                outcomes["ok" if ok else f"http_{r.status}"] += 1
        except aiohttp.ClientConnectionError as exc:
            outcomes["reset" if "reset" in str(exc).lower() else "connection_error"] += 1
        except TimeoutError:
            outcomes["timeout"] += 1
        latencies.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(n)]
        await asyncio.sleep(0.5)  # every task is parked at the gate
        t0 = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
        drained = time.perf_counter() - t0
    return outcomes, latencies, drained


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--pd", choices=["sglang", "vllm-nixl"], default="sglang")
    args = ap.parse_args()
    procs: list[asyncio.subprocess.Process] = []
    try:
        sim = ["sim", "--pd", args.pd, "--dp-size", "8", "--port", "0"]
        prefill, p_lines = await spawn(
            *sim, "--role", "prefill", "--engines", "2", "--bootstrap-port", "0", ready="ready"
        )
        procs.append(prefill)
        decode, d_lines = await spawn(*sim, "--role", "decode", ready="ready")
        procs.append(decode)
        serve = ["serve", "--pd", args.pd, "--port", "0", "--log-level", "info"]
        for line in p_lines:
            if line.startswith("prefill-"):
                url = line.split()[3]
                port = re.search(r"bootstrap_port=(\d+)", line)
                serve += ["--prefill", url + (f",bootstrap_port={port[1]}" if port else "")]
        serve += ["--decode", next(ln.split()[3] for ln in d_lines if ln.startswith("decode-"))]
        router, r_lines = await spawn(*serve, ready="dprouter on")
        procs.append(router)
        found = re.search(r"dprouter on (http://\S+): policy", "".join(r_lines))
        assert found is not None
        outcomes, latencies, drained = await burst(found[1], args.requests)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(asyncio.wait_for(p.wait(), 30) for p in procs))
    answered = sum(outcomes.values())
    lost = args.requests - answered
    q = statistics.quantiles(latencies, n=100)
    print(
        f"{args.requests} simultaneous {args.pd} P/D requests through dprouter "
        f"(2 prefill x DP8, 1 decode x DP8, simulated)"
    )
    print(
        f"{'ok':>6} {'http err':>9} {'resets':>7} {'conn err':>9} {'timeouts':>9} {'lost':>5} "
        f"{'drain s':>8} {'p50 s':>6} {'p99 s':>6}"
    )
    http_errors = sum(v for k, v in outcomes.items() if k.startswith("http_"))
    print(
        f"{outcomes['ok']:>6} {http_errors:>9} {outcomes['reset']:>7} "
        f"{outcomes['connection_error']:>9} {outcomes['timeout']:>9} {lost:>5} "
        f"{drained:>8.1f} {q[49]:>6.2f} {q[98]:>6.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
