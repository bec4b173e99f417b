"""Part of the overhead scenario: every core, ``--processes 1`` against ``--processes 2``.

Nothing is pinned: routers, the trivial backend and this load generator share
the machine's cores, as they would on a real host (here two). Each router is
measured in turn, in interleaved rounds, at 64 and 512 connections. Scaling
efficiency of ``--processes 2`` = its req/s over the ideal req/s, the ideal
being the CPU the backend and the load generator leave over, spent at the
``--processes 1`` router's CPU per request. The cost of sharing = CPU per
request with 2 processes over CPU per request with 1. Preempted per request: times the
router's processes were switched out while runnable. On two cores, two serving processes
beside the backend and the load generator are preempted 0.4-0.65 times a request (one
process: 0.05-0.1), and each switch costs a cold cache: what the 64-connection ratio above
1 then mostly is (pinning each process to a core, SCHED_BATCH, or no multiprocess
metrics measured no change).
"""

from __future__ import annotations

import os
import sys
import time

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.load import Outcome, closed_loop
from dprouter.bench.harness.procs import DPROUTER, Proc, cpu_seconds, preemptions, url_in
from dprouter.bench.report.results import Cell, Table
from dprouter.bench.scenarios.overhead import merge

LOADS = (("plain, 64 connections", 64), ("plain, 512 connections", 512))
ONE, TWO = "dprouter --processes 1", "dprouter --processes 2"


async def start(kind: str, backend: str) -> tuple[Proc, str]:
    if kind in (ONE, TWO):
        argv = [*DPROUTER, "serve", "--worker", f"{backend},dialect=vllm,dp_size=1"]
        n = "2" if kind == TWO else "1"
        proc = Proc([*argv, "--port", "0", "--load-interval", "0", "--processes", n])
        url = url_in(await proc.start(r"dprouter on http://"))
        await peer_routers.until_serving(url, proc=proc)
        return proc, url
    return await peer_routers.start_on_free_port(
        lambda port: peer_routers.router(kind, [backend], port)
    )


async def measure(seconds: float, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    kinds = [ONE, TWO, *peer_routers.available()]
    backend = Proc([sys.executable, "-m", "dprouter.bench.harness.backend", "--port", "0"])
    backend_url = url_in(await backend.start("ready"))
    routers: dict[str, tuple[Proc, str]] = {}
    pooled = {(k, name): Outcome() for k in kinds for name, _ in LOADS}
    # router, backend, client CPU; wall; the router's preemptions
    used = {key: [0.0, 0.0, 0.0, 0.0, 0.0] for key in pooled}
    try:
        for kind in kinds:
            routers[kind] = await start(kind, backend_url)
        for _, url in routers.values():
            await closed_loop(url, 16, min(seconds, 2.0))  # warm up
        for _ in range(rounds):
            for kind, (proc, url) in routers.items():
                for name, conns in LOADS:
                    before = (cpu_seconds(proc.pid), cpu_seconds(backend.pid), time.process_time())
                    wall, preempted = time.perf_counter(), preemptions(proc.pid)
                    merge(pooled[kind, name], await closed_loop(url, conns, seconds / rounds))
                    after = (cpu_seconds(proc.pid), cpu_seconds(backend.pid), time.process_time())
                    cells = used[kind, name]
                    for i in range(3):
                        cells[i] += after[i] - before[i]
                    cells[3] += time.perf_counter() - wall
                    cells[4] += preemptions(proc.pid) - preempted
    finally:
        for proc, _ in routers.values():
            await proc.stop()
        await backend.stop()
    found: dict[str, dict[str, dict[str, float]]] = {}
    cores = len(os.sched_getaffinity(0))
    for kind in kinds:
        found[kind] = {}
        for name, _ in LOADS:
            o = pooled[kind, name]
            router, back, client, wall, switched = used[kind, name]
            n = max(o.answered, 1)
            found[kind][name] = {
                "rps": o.rate,
                "p50_ms": o.latency.p50 * 1e3,
                "p99_ms": o.latency.p99 * 1e3,
                "cpu_ms_per_req": router / n * 1e3,
                "left_cores": max(cores - (back + client) / wall, 0.0) if wall else 0.0,
                "preempted_per_req": switched / n,
                "errors": float(sum(o.errors.values())),
            }
    for name, _ in LOADS:
        one, two = found[ONE][name], found[TWO][name]
        ideal = two["left_cores"] / (one["cpu_ms_per_req"] / 1e3) if one["cpu_ms_per_req"] else 0
        two["efficiency"] = two["rps"] / ideal if ideal else 0.0
        two["sharing_cost"] = two["cpu_ms_per_req"] / one["cpu_ms_per_req"]
    return found


def table(found: dict[str, dict[str, dict[str, float]]]) -> Table:
    rows: list[list[Cell]] = []
    for kind, loads in found.items():
        for name, _ in LOADS:
            m = loads[name]
            rows.append(
                [
                    kind,
                    name,
                    m["rps"],
                    m["p50_ms"],
                    m["p99_ms"],
                    m["cpu_ms_per_req"],
                    m["preempted_per_req"],
                    m.get("efficiency"),
                    m.get("sharing_cost"),
                    int(m["errors"]),
                ]
            )
    return Table(
        [
            "router (every core)",
            "load",
            "req/s",
            "p50 ms",
            "p99 ms",
            "CPU ms/req",
            "preempted/req",
            "scaling efficiency",
            "CPU/req vs 1 process",
            "errors",
        ],
        rows,
        "every core, nothing pinned",
    )


def checks(found: dict[str, dict[str, dict[str, float]]]) -> dict[str, bool]:
    two = found[TWO]
    return {
        f"--processes 2 scaling efficiency >= 0.85 ({name})": two[name]["efficiency"] >= 0.85
        for name, _ in LOADS
    } | {
        f"--processes 2 CPU per request <= 1.1x --processes 1 ({name})": two[name]["sharing_cost"]
        <= 1.1
        for name, _ in LOADS
    }
