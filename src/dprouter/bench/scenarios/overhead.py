"""Scenario 5, overhead: what a router costs in front of a trivial, fast backend.

Each router runs in its own process pinned to core 0; the backend and this
load generator share core 1. Closed-loop load at 64 and 512 connections
(plain requests) and 64 connections (16-chunk streams), one measurement
after another, in interleaved rounds: on a shared, noisy machine a slow
spell then falls on every router alike, so the ratios hold. A bare aiohttp proxy
(``bench/harness/bare.py``) runs too: the floor of the stack dprouter is built on.
Router CPU is read from /proc (the whole process tree), peak memory is VmHWM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import yaml

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.load import Outcome, closed_loop
from dprouter.bench.harness.procs import DPROUTER, Proc, cpu_seconds, peak_rss_mb, url_in
from dprouter.bench.report.plots import bars
from dprouter.bench.report.results import Cell, Result, Table

LOADS = (
    ("plain, 64 connections", 64, False),
    ("plain, 512 connections", 512, False),
    ("stream, 64 connections", 64, True),
)
ROUTER_CORE, CLIENT_CORE = "0", {1}
BARE = "bare aiohttp proxy"  # dprouter's HTTP stack with none of its logic: the floor
# dprouter as started for the comparison with its peers, and with its dispatcher set apart
# (the backend reports no running cap, so by default nothing is held): off; on with
# slots never all taken (the look at the board each request pays); on with 16 slots,
# so that at 64 connections most requests wait in the router (what holding costs)
DISPATCH = {
    "dprouter": (),
    "dprouter, dispatch off": ("--dispatch", "off"),
    "dprouter, dispatch on": ("--dispatch-slots", "100000"),
    "dprouter, dispatch holding": ("--dispatch-slots", "16"),
}
# the front door on: an API key checked and a tenant's three limits kept per request
# (never reached); tracing: every request's spans made and exported (to the backend,
# which drops them), or one request's in ten (the standard sampler variables, as a
# fleet would trace). Off, as in "dprouter", the door costs what the tests of
# bench overhead's checks say.
KEY = "bench-key"
TENANTS = {
    "tenants": {
        "bench": {
            "keys": [KEY],
            "limits": {
                "requests_per_second": 1e7,
                "tokens_per_second": 1e10,
                "in_flight": 1_000_000,
            },
        }
    }
}
DOOR = {
    "dprouter, key and limits": ("--tenants",),
    "dprouter, tracing": ("--tracing",),
    "dprouter, tracing 1 in 10": ("--tracing",),
}
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
ENV = {"dprouter, tracing 1 in 10": SAMPLED}
HEADERS = {"dprouter, key and limits": {"Authorization": f"Bearer {KEY}"}}
BARE_SCRIPT = Path(__file__).parents[1] / "harness" / "bare.py"
ROUNDS = 4  # interleaved rounds per full run: the machine's noise falls on every router alike


@contextlib.contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """This process (the load generator) on ``cpus`` for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


Command = Callable[[int, str], list[str]]  # (port, backend URL) -> a proxy's command line


async def start_router(
    kind: str, backend: str, commands: Mapping[str, Command] | None = None
) -> tuple[Proc | None, str]:
    """A router of ``kind`` in front of ``backend``; (process, URL). Direct: no router.
    ``commands`` adds kinds of its own (the stacks scenario's bare proxies)."""
    if kind == "direct":
        return None, backend
    if commands and kind in commands:
        command = commands[kind]
        return await peer_routers.start_on_free_port(
            lambda port: Proc(command(port, backend), cpus=ROUTER_CORE)
        )
    if kind not in (*DISPATCH, *DOOR, BARE):
        return await peer_routers.start_on_free_port(
            lambda port: peer_routers.router(kind, [backend], port, cpus=ROUTER_CORE)
        )
    if kind in DISPATCH or kind in DOOR:
        options = list(DISPATCH.get(kind, ()))
        env: dict[str, str] = {}
        if kind in DOOR:
            options = [*DOOR[kind]]
            if "--tenants" in options:
                options.append(str(tenants_file()))
            if "--tracing" in options:
                env["OTEL_EXPORTER_OTLP_ENDPOINT"] = backend
            env.update(ENV.get(kind, {}))
        argv = [*DPROUTER, "serve", "--worker", f"{backend},dialect=vllm,dp_size=1", *options]
        proc = Proc([*argv, "--port", "0", "--load-interval", "0"], cpus=ROUTER_CORE, env=env)
        url = url_in(await proc.start(r"dprouter on http://"))
    else:  # a file, not -m dprouter...: the floor imports aiohttp alone, not the package
        argv = [sys.executable, str(BARE_SCRIPT), "--port", "0", "--upstream", backend]
        proc = Proc(argv, cpus=ROUTER_CORE)
        url = url_in(await proc.start("ready"))
    await peer_routers.until_serving(url, proc=proc, headers=HEADERS.get(kind))
    return proc, url


def tenants_file() -> Path:
    """The tenants of "dprouter, key and limits", in a file of their own."""
    path = Path(tempfile.mkdtemp(prefix="dprouter-overhead-")) / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    return path


async def measure(
    kinds: list[str],
    seconds: float,
    rounds: int = 1,
    commands: Mapping[str, Command] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Every router up at once; ``rounds`` rounds, each measuring every router's loads
    in turn for ``seconds`` / ``rounds``, pooled. Interleaved so that a noisy spell of a
    shared machine falls on all of them alike, not on whichever ran then."""
    backend = Proc(
        [sys.executable, "-m", "dprouter.bench.harness.backend", "--port", "0"], cpus="1"
    )
    backend_url = url_in(await backend.start("ready"))
    routers: dict[str, tuple[Proc | None, str]] = {}
    pooled = {(k, name): Outcome() for k in kinds for name, _, _ in LOADS}
    cpu: dict[tuple[str, str], float] = dict.fromkeys(pooled, 0.0)  # seconds, pooled too
    try:
        for kind in kinds:
            routers[kind] = await start_router(kind, backend_url, commands)
        with pinned(CLIENT_CORE):
            for kind, (_, url) in routers.items():
                headers = HEADERS.get(kind)
                await closed_loop(url, 16, min(seconds, 2.0), headers=headers)  # warm up
            for _ in range(rounds):
                for kind, (proc, url) in routers.items():
                    headers = HEADERS.get(kind)
                    for name, conns, stream in LOADS:
                        cpu0 = cpu_seconds(proc.pid) if proc else 0.0
                        o = await closed_loop(url, conns, seconds / rounds, stream, headers=headers)
                        used = (cpu_seconds(proc.pid) - cpu0) if proc else 0.0
                        cpu[kind, name] += used
                        merge(pooled[kind, name], o)
        found: dict[str, dict[str, dict[str, float]]] = {}
        for kind, (proc, _) in routers.items():
            found[kind] = {
                name: summary(pooled[kind, name], cpu[kind, name]) for name, _, _ in LOADS
            }
            found[kind]["peak_rss_mb"] = {"value": peak_rss_mb(proc.pid) if proc else 0.0}
        return found
    finally:
        for proc, _ in routers.values():
            if proc is not None:
                await proc.stop()
        await backend.stop()


def added(
    on: Mapping[str, Mapping[str, float]], off: Mapping[str, Mapping[str, float]], load: str
) -> float:
    """CPU per request ``on`` adds to ``off`` under ``load``, in ms."""
    return on[load]["cpu_ms_per_req"] - off[load]["cpu_ms_per_req"]


def merge(into: Outcome, o: Outcome) -> None:
    """Add one round's measurement to the pooled one."""
    into.answered += o.answered
    into.errors.update(o.errors)
    into.latencies += o.latencies
    into.chunks += o.chunks
    into.seconds += o.seconds


def summary(o: Outcome, cpu: float) -> dict[str, float]:
    return {
        "rps": o.rate,
        "p50_ms": o.latency.p50 * 1e3,
        "p99_ms": o.latency.p99 * 1e3,
        "chunks_s": o.chunks / o.seconds if o.seconds else 0.0,
        "cpu_ms_per_req": cpu / o.answered * 1e3 if o.answered else 0.0,
        "errors": float(sum(o.errors.values())),
        "answered": float(o.answered),
    }


def run(quick: bool, out: Path) -> Result:
    from dprouter.bench.scenarios import cores  # it imports this module's helpers

    kinds = ["direct", *DISPATCH, *DOOR, BARE, *peer_routers.available()]
    found = asyncio.run(measure(kinds, 1.0 if quick else 12.0, 1 if quick else ROUNDS))
    every = asyncio.run(cores.measure(2.0 if quick else 12.0, 1 if quick else ROUNDS))
    rows: list[list[Cell]] = []
    for kind, loads in found.items():
        for name, _, _ in LOADS:
            m, d = loads[name], found["direct"][name]
            rows.append(
                [
                    kind,
                    name,
                    m["rps"],
                    m["p50_ms"],
                    m["p99_ms"],
                    m["p50_ms"] - d["p50_ms"] if kind != "direct" else None,
                    m["p99_ms"] - d["p99_ms"] if kind != "direct" else None,
                    m["chunks_s"] if "stream" in name else None,
                    m["cpu_ms_per_req"] if kind != "direct" else None,
                    int(m["errors"]),
                    loads["peak_rss_mb"]["value"] if kind != "direct" else None,
                ]
            )
    routers = [k for k in found if k != "direct"]
    bars(
        out / "overhead.png",
        [name for name, _, _ in LOADS],
        {k: [found[k][name]["cpu_ms_per_req"] for name, _, _ in LOADS] for k in routers},
        "router CPU per request (one core, trivial backend)",
        "ms CPU / request",
    )
    checks: dict[str, bool] = {}
    gateway = found.get("sglang-gateway")
    ours = found["dprouter"]
    if gateway is not None:
        stream, plain = LOADS[2][0], LOADS[0][0]
        checks["dprouter CPU per stream <= 1.0x the SGLang gateway's"] = (
            ours[stream]["cpu_ms_per_req"] <= gateway[stream]["cpu_ms_per_req"]
        )
        checks["dprouter CPU per plain request <= 1.5x the SGLang gateway's"] = (
            ours[plain]["cpu_ms_per_req"] <= 1.5 * gateway[plain]["cpu_ms_per_req"]
        )
        wide = LOADS[1][0]
        checks["dprouter p99 at 512 connections no worse than the gateway's"] = (
            ours[wide]["p99_ms"] <= gateway[wide]["p99_ms"]
        )
    checks |= cores.checks(every)
    off, on = found["dprouter, dispatch off"], found["dprouter, dispatch on"]
    for name in (LOADS[0][0], LOADS[2][0]):
        cost = on[name]["cpu_ms_per_req"] - off[name]["cpu_ms_per_req"]
        checks[f"the dispatcher's look per request <= 0.02 ms of CPU ({name}: {cost:.3f} ms)"] = (
            cost <= 0.02
        )
    door = "; ".join(  # what each costs when on: reported (the table), not bounded
        f"{kind.removeprefix('dprouter, ')} {added(found[kind], ours, LOADS[0][0]):+.3f} ms "
        f"(a stream {added(found[kind], ours, LOADS[2][0]):+.3f} ms)"
        for kind in DOOR
    )
    plain_cpu = ours[LOADS[0][0]]["cpu_ms_per_req"]
    bare_cpu = found[BARE][LOADS[0][0]]["cpu_ms_per_req"]
    for name in (LOADS[0][0], LOADS[2][0]):  # the aim: per plain request, per stream
        own = ours[name]["cpu_ms_per_req"] - found[BARE][name]["cpu_ms_per_req"]
        checks[f"dprouter's own logic <= 0.1 ms of CPU ({name}: {own:.3f} ms)"] = own <= 0.1
    return Result(
        scenario="overhead",
        title="5. Overhead: a trivial backend, direct and through each router",
        method=(
            "Every router up at once on core 0 (taskset; the others idle meanwhile), trivial "
            "aiohttp backend and this closed-loop load generator on core 1; per router and "
            f"load {1 if quick else 12} s in all after a warm-up, in "
            f"{1 if quick else ROUNDS} interleaved round(s) (router after router, then again), "
            "pooled; added p50 (p99) = router p50 (p99) - direct p50 (p99); CPU from /proc "
            "(process tree) per answered request (ms per request = CPU seconds per 1k "
            "requests); peak RSS = VmHWM. Every request checked for status 200. "
            + (cores.__doc__ or "").split("\n\n", 1)[1].replace("\n", " ")
        ),
        tables=[
            Table(
                [
                    "router",
                    "load",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "added p50 ms",
                    "added p99 ms",
                    "SSE chunks/s",
                    "CPU ms/req",
                    "errors",
                    "peak RSS MB",
                ],
                rows,
                "one core for the router (pinned)",
            ),
            cores.table(every),
        ],
        verdict=(
            f"dprouter spends {plain_cpu:.2f} ms of CPU per plain request on one core"
            + (
                ""
                if gateway is None
                else f", {plain_cpu / gateway[LOADS[0][0]]['cpu_ms_per_req']:.1f}x the SGLang "
                "gateway's"
            )
            + f"; a bare aiohttp proxy spends {bare_cpu:.2f} ms, so dprouter's own logic "
            f"costs {plain_cpu - bare_cpu:.2f} ms and the rest is the aiohttp stack. "
            f"The front door, on, adds per plain request: {door}."
        ),
        checks=checks,
        plots=["overhead.png"],
        data={**found, "every_core": every},
    )
