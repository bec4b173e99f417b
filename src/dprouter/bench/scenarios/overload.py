"""Scenario: the front door under overload -- two tenants, two priority classes, 2x the
fleet's capacity offered for a bounded time, dprouter beside smg 1.13.0's priority scheduler.

The simulated engines (SGLang persona, plain DP, few running slots per rank, so that
the router, not the engines, holds what cannot run) run in this process on the wall
clock; each router runs in its own process. The fleet's capacity is measured first,
directly on the engines, with the same mix of requests (closed loop, twice the slots
busy). Then, through each router on a fresh cluster: the interactive tenant's requests
alone at their own rate (the unloaded reference), and the same seeded open-loop
arrivals at 2x the capacity, interactive and batch mixed. Every figure is the client's:
TTFT from the send to the first streamed token, goodput from the answers that ran to
their end, and every request accounted for as completed, shed (429, 503 and 408, each
counted apart: smg's docs name a 408 for its queue timeout, 1.13.0 answers a 503) or an
error (anything else, a stream cut short included: must be none).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.procs import DPROUTER, Proc, free_port, url_in
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits

# 2 engines x DP2, 4 running slots a rank: 16 slots. 20 ms a decode step, so a batch
# answer (128 tokens) holds its slot ~2.7 s and an interactive one (32) ~0.7 s
ENGINE = EngineConfig(
    persona="sglang",
    dp_size=2,
    cost=CostModel(step_base=0.02, decode_per_seq=2e-4, prefill_per_token=2e-5),
    limits=RankLimits(max_running=4),
)
ENGINES = 2
SLOTS = ENGINES * ENGINE.dp_size * ENGINE.limits.max_running
OVERLOAD = 2.0  # offered load over the measured capacity
SHARE = 0.35  # of the requests offered, the interactive tenant's
SHED = (429, 503, 408)  # a router's answers that shed a request


@dataclass(frozen=True)
class Kind:
    """One tenant's requests: its key, its class (dprouter's, smg's), their sizes."""

    tenant: str
    key: str
    cls: str  # dprouter --classes
    smg_class: str  # x-smg-priority, and the tenant's max_class
    prompt: int  # words, a token each by the simulator's built-in rule
    output: int


INTERACTIVE = Kind("interactive", "sk-int", "high", "interactive", 200, 32)
BATCH = Kind("batch", "sk-batch", "low", "bulk", 600, 128)
KINDS = (INTERACTIVE, BATCH)


@dataclass(frozen=True)
class Shape:
    """A run's durations (s) and the bounds both routers hold requests within."""

    measure: float  # the capacity measurement's window
    unloaded: float  # the interactive tenant alone
    loaded: float  # both tenants at OVERLOAD x the capacity
    queue: int  # requests held at most (dprouter --dispatch-queue; smg's per-class queue)
    wait: int  # seconds held at most (dprouter --dispatch-wait; smg queue_timeout_secs)


SHAPES = {
    "full": Shape(measure=12, unloaded=12, loaded=35, queue=48, wait=8),
    "quick": Shape(measure=8, unloaded=8, loaded=20, queue=48, wait=8),
    "tiny": Shape(measure=3, unloaded=3, loaded=6, queue=16, wait=3),
}


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # dprouter or smg
    tenants: bool = True  # dprouter: given --tenants
    args: tuple[str, ...] = ()  # dprouter: more of its options


ROWS = (
    # a running slot a rank kept for the high class: 4 of 16, as smg's reservation below
    Row("dprouter, classes (high, low), --reserve 1", "dprouter", args=("--reserve", "1")),
    Row("dprouter, classes (high, low)", "dprouter"),
    Row("dprouter, one class (no --tenants)", "dprouter", tenants=False),
    Row("smg 1.13.0, priority scheduler", "smg"),
)
RESERVED, CLASSES, ONE_CLASS, SMG = (r.name for r in ROWS)


@dataclass
class Outcome:
    kind: Kind
    status: int  # HTTP status; 0: no answer (a connection error or a cut stream)
    sent: float
    ttft: float | None = None
    end: float = 0.0
    tokens: int = 0
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.tokens > 0


def arrivals(rate: float, seconds: float, share: float, seed: int) -> list[tuple[float, Kind]]:
    """Poisson arrivals at ``rate`` for ``seconds``, each interactive with chance ``share``."""
    rng = random.Random(seed)
    out: list[tuple[float, Kind]] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append((t, INTERACTIVE if rng.random() < share else BATCH))
        t += rng.expovariate(rate)
    return out


async def send(session: aiohttp.ClientSession, url: str, kind: Kind, seed: int) -> Outcome:
    """One streamed completion as ``kind``'s tenant, read to its end."""
    rng = random.Random(seed)
    prompt = " ".join(f"w{rng.getrandbits(20)}" for _ in range(kind.prompt))
    body = {
        "model": ENGINE.model,
        "prompt": prompt,
        "max_tokens": kind.output,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {kind.key}", "x-smg-priority": kind.smg_class}
    loop = asyncio.get_running_loop()
    out = Outcome(kind, 0, loop.time())
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                out.detail = (await r.text())[:200]
                return out
            done = False
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if out.ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                    out.ttft = loop.time() - out.sent
                usage = chunk.get("usage")
                if usage:
                    out.tokens = int(usage.get("completion_tokens", 0))
            if not done or out.tokens != kind.output:
                out.status, out.detail = 0, f"stream cut after {out.tokens} tokens"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.status, out.detail = 0, repr(exc)[:200]
    finally:
        out.end = loop.time()
    return out


async def offer(url: str, plan: Sequence[tuple[float, Kind]], limit: float) -> list[Outcome]:
    """Send each planned request at its time (open loop) and wait for every answer."""
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=limit)
    ) as session:
        t0, tasks = loop.time(), []
        for i, (t, kind) in enumerate(plan):
            await asyncio.sleep(max(0.0, t0 + t - loop.time()))
            tasks.append(asyncio.create_task(send(session, url, kind, seed=i)))
        return list(await asyncio.gather(*tasks))


async def capacity(urls: Sequence[str], seconds: float) -> float:
    """Requests per second the fleet completes of the mix, straight from the engines:
    closed loop with twice the slots busy, the clients' starts spread over a batch answer,
    counted over ``seconds`` after a warm-up (every client starting at once, answers end
    in waves: a 3 s window read 6.3 req/s where 12 s read 7.8; spread, 7.7 and 7.8)."""
    loop = asyncio.get_running_loop()
    done: list[float] = []
    start = loop.time() + 4.0
    stop = start + seconds

    async def client(session: aiohttp.ClientSession, url: str, i: int) -> None:
        rng = random.Random(i)
        await asyncio.sleep(rng.uniform(0, 3.0))
        while loop.time() < stop:
            kind = INTERACTIVE if rng.random() < SHARE else BATCH
            found = await send(session, url, kind, seed=rng.getrandbits(30))
            if not found.completed:
                raise RuntimeError(f"the engines alone failed a request: {found.detail}")
            done.append(found.end)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, urls[i % len(urls)], i) for i in range(2 * SLOTS)))
    return sum(start <= t < start + seconds for t in done) / seconds


def tenants_yaml() -> str:
    """Each tenant's key and class (the key decides it: no X-Priority is sent)."""
    lines = ["tenants:"]
    for k in KINDS:
        lines += [f"  {k.tenant}:", f"    keys: [{k.key}]", f"    class: {k.cls}"]
    return "\n".join([*lines, "default: {class: low}", ""])


def smg_yaml(shape: Shape) -> str:
    """smg's classes for this fleet. Its built-in defaults reserve 32 slots for system
    and 128 for interactive, more than 16 slots: clamped to the capacity, system would
    hold every slot back from the others; so all four are given. Interactive reserves
    a quarter of the slots (its share of the slot time offered is ~0.24); bulk is never
    promoted for starving before it times out; no preemption (it would cancel bulk
    requests before their first token: in 1.13.0 the victim's stream is cut, an empty
    200 -- 19 of 406 batch requests in one run -- and, its docs say, its upstream
    work is not stopped)."""

    def cls(name: str, per_slot: float) -> list[str]:
        return [
            f"  {name}:",
            "    reserved_floor: 0",
            f"    reserved_per_slot: {per_slot}",
            f"    queue_size: {shape.queue}",
            f"    queue_timeout_secs: {shape.wait}",
            f"    starvation_threshold_secs: {shape.wait + 60}",
            "    can_preempt: false",
        ]

    lines = ["classes:", *cls("system", 0.0), *cls("interactive", 0.25)]
    lines += [*cls("default", 0.0), *cls("bulk", 0.0), "tenant_policies:"]
    for k in KINDS:
        lines += [f'  "auth:{k.tenant}":', f"    max_class: {k.smg_class}"]
    return "\n".join([*lines, ""])


async def start(
    row: Row, urls: Sequence[str], shape: Shape, files: Path
) -> tuple[Proc, str, str | None]:
    """``row``'s router over ``urls``, serving: it, its URL and (smg) its metrics' URL."""
    metrics = None
    if row.kind == "smg":
        config = files / "smg-priority.yaml"
        config.write_text(smg_yaml(shape))
        keys = [a for k in KINDS for a in ("--tenant-api-key", f"{k.tenant}:{k.key}")]
        port, metrics_port = free_port(), free_port()
        proc = Proc(
            [
                str(peer_routers.binary("smg")),
                *("launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls"),
                *urls,
                *("--policy", "least_load", "--dp-aware", "--prometheus-host", "127.0.0.1"),
                *("--prometheus-port", str(metrics_port), *keys),
                *("--priority-scheduler-enabled", "--priority-scheduler-config", str(config)),
                *("--priority-scheduler-default-max-class", "bulk"),
            ]
        )
        await proc.start()
        url = f"http://127.0.0.1:{port}"
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    else:
        tenants: list[str] = []
        if row.tenants:
            path = files / "tenants.yaml"
            path.write_text(tenants_yaml())
            tenants = ["--tenants", str(path), "--classes", "high,normal,low"]
        workers = (a for u in urls for a in ("--worker", u))
        bounds = f"--engine-queue 0 --dispatch-queue {shape.queue} --dispatch-wait {shape.wait}"
        proc = Proc(
            [
                *(*DPROUTER, "serve", *workers, *tenants, *row.args),
                *f"--port 0 --load-interval 0.5 {bounds}".split(),
            ]
        )
        url = url_in(await proc.start(r"dprouter on http://"))
    try:
        await ready(url, proc)
    except BaseException:
        await proc.stop()
        raise
    return proc, url, metrics


async def smg_slots(metrics: str, after: float) -> str:
    """The slots smg's scheduler admits against, read off its gauges ``after`` seconds
    into the loaded phase: requests in flight over utilisation (in flight / capacity)."""
    await asyncio.sleep(after)
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(metrics) as r:
        text = await r.text()
    inflight = utilisation = 0.0
    for line in text.splitlines():
        if line.startswith("smg_scheduler_inflight{"):
            inflight += float(line.rsplit(" ", 1)[1])
        elif line.startswith("smg_scheduler_utilization "):
            utilisation = float(line.rsplit(" ", 1)[1])
    if not utilisation:
        return f"smg's scheduler gauges: in flight {inflight:g}, utilisation 0"
    return f"smg's scheduler admitted against {inflight / utilisation:.0f} slots"


async def admitted(url: str) -> str:
    """What dprouter admitted by tenant and class (its metrics): the classes its keys gave."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url + "/metrics") as r,
    ):
        text = await r.text()
    found = [
        f"{line.split('{', 1)[1].split('}', 1)[0]} {float(line.rsplit(' ', 1)[1]):g}"
        for line in text.splitlines()
        if line.startswith("dprouter_tenant_admitted_total{")
    ]
    return "admitted by " + ("; ".join(found) or "no tenant (no dprouter_tenant_admitted_total)")


async def ready(url: str, proc: Proc, seconds: float = 90) -> None:
    """Until a request of each tenant completes (a router may answer /health too early)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with asyncio.timeout(seconds):
            for i, kind in enumerate(KINDS):
                while not (await send(session, url, replace(kind, output=1), i)).completed:
                    if proc.exited:
                        raise RuntimeError(f"{proc.argv[0]} exited:\n{''.join(proc.lines[-20:])}")
                    await asyncio.sleep(0.3)


@dataclass
class Measured:
    unloaded: list[Outcome]
    loaded: list[Outcome]
    seconds: float  # the loaded phase, first send to last answer
    notes: list[str] = field(default_factory=list)


async def once(row: Row, rate: float, shape: Shape, files: Path) -> Measured:
    """``row``'s router on a fresh cluster: the interactive tenant alone at its share of
    the offered rate, then both tenants at the offered rate; the same seeded arrivals
    for every row."""
    timeout = shape.wait + 120.0
    notes: list[str] = []
    async with SimCluster([ENGINE] * ENGINES) as cluster:
        proc, url, metrics = await start(row, cluster.urls, shape, files)
        try:
            alone = [
                (t, k) for t, k in arrivals(rate, shape.unloaded, SHARE, seed=7) if k is INTERACTIVE
            ]
            unloaded = await offer(url, alone, timeout)
            t0 = time.monotonic()
            probe = asyncio.create_task(smg_slots(metrics, shape.loaded / 2)) if metrics else None
            loaded = await offer(url, arrivals(rate, shape.loaded, SHARE, seed=11), timeout)
            seconds = time.monotonic() - t0
            if probe is not None:
                notes.append(await probe)
            elif row.tenants:
                notes.append(await admitted(url))
        finally:
            await proc.stop()
    return Measured(unloaded, loaded, seconds, notes)


def pct(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def summary(found: Measured, kind: Kind) -> dict[str, float]:
    """One class's figures of a row: counts, goodput over the loaded phase, TTFT (s)."""
    mine = [o for o in found.loaded if o.kind is kind]
    done = [o for o in mine if o.completed]
    shed = {s: sum(o.status == s for o in mine) for s in SHED}
    ttft = [o.ttft for o in done if o.ttft is not None]
    alone = [o.ttft for o in found.unloaded if o.completed and o.ttft is not None]
    out = {
        "offered": float(len(mine)),
        "completed": float(len(done)),
        "req_s": len(done) / found.seconds,
        "tokens_s": sum(o.tokens for o in done) / found.seconds,
        **{f"shed_{s}": float(n) for s, n in shed.items()},
        "errors": float(len(mine) - len(done) - sum(shed.values())),
        "ttft_p50": pct(ttft, 0.5) or 0.0,
        "ttft_p99": pct(ttft, 0.99) or 0.0,
    }
    if kind is INTERACTIVE:
        unloaded_errors = sum(not o.completed for o in found.unloaded)
        out["unloaded_p99"] = pct(alone, 0.99) or 0.0
        out["unloaded_failed"] = float(unloaded_errors)
    return out


def errors_seen(found: Measured) -> list[str]:
    """The first few answers that were neither completed nor shed, as the client saw them."""
    bad = [o for o in [*found.unloaded, *found.loaded] if not o.completed]
    bad = [o for o in bad if o.status not in SHED or o in found.unloaded]
    said = Counter(f"HTTP {o.status} {o.detail[:100]}" for o in found.loaded if o.status in SHED)
    return [
        *(f"{o.kind.tenant}: HTTP {o.status} {o.detail}" for o in bad[:3]),
        *(f"shed {n} x {what}" for what, n in said.most_common(3)),
    ]


async def measure(
    shape: Shape, rows: Sequence[Row]
) -> tuple[float, dict[str, dict[str, dict[str, float]]], list[str]]:
    """The fleet's capacity (req/s), then every row: figures by row and class, and notes
    (rows not run, errors seen)."""
    notes: list[str] = []
    if any(r.kind == "smg" for r in rows):
        missing = peer_routers.ensure()
        if missing is not None and not peer_routers.binary("smg").exists():
            notes.append(f"smg not run ({missing})")
            rows = [r for r in rows if r.kind != "smg"]
    async with SimCluster([ENGINE] * ENGINES) as cluster:
        cap = await capacity(cluster.urls, shape.measure)
    rate = OVERLOAD * cap
    data: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="dprouter-overload-") as files:
        for row in rows:
            found = await once(row, rate, shape, Path(files))
            data[row.name] = {k.cls: summary(found, k) for k in KINDS}
            data[row.name]["all"] = {"seconds": found.seconds}
            notes += [f"{row.name}: {e}" for e in [*found.notes, *errors_seen(found)]]
    return cap, data, notes


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def rows_of(data: dict[str, dict[str, dict[str, float]]]) -> list[list[Cell]]:
    out: list[list[Cell]] = []
    for name, by_class in data.items():
        for k in KINDS:
            m = by_class[k.cls]
            alone = m.get("unloaded_p99")
            out.append(
                [
                    name,
                    f"{k.cls} ({k.tenant})",
                    int(m["offered"]),
                    int(m["completed"]),
                    round(m["req_s"], 2),
                    round(m["tokens_s"], 1),
                    _ms(m["ttft_p50"]),
                    _ms(m["ttft_p99"]),
                    int(m["shed_429"]),
                    int(m["shed_503"]),
                    int(m["shed_408"]),
                    int(m["errors"]),
                    _ms(alone) if alone else "-",
                    f"{m['ttft_p99'] / alone:.1f}x" if alone else "-",
                ]
            )
    return out


def checks(data: dict[str, dict[str, dict[str, float]]]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for name, by_class in data.items():
        ok = all(
            m["completed"] + m["shed_429"] + m["shed_503"] + m["shed_408"] + m["errors"]
            == m["offered"]
            and m["errors"] == 0
            for m in (by_class[k.cls] for k in KINDS)
        )
        out[f"{name}: every request completed or shed, no other errors"] = ok and not by_class[
            INTERACTIVE.cls
        ].get("unloaded_failed")
    base = data.get(ONE_CLASS)
    for name in (RESERVED, CLASSES):
        if name not in data:
            continue
        high, low = (data[name][k.cls] for k in KINDS)
        shed_high, shed_low = (sum(m[f"shed_{s}"] for s in SHED) for m in (high, low))
        out[f"{name}: the high class sheds none, or less than the low"] = (
            shed_high == 0 or shed_high < shed_low
        )
        if base is not None:
            out[f"{name}: high p99 TTFT below the one-class run's"] = (
                high["ttft_p99"] < base[INTERACTIVE.cls]["ttft_p99"]
            )
    ours, smg = data.get(RESERVED), data.get(SMG)
    if ours is not None and smg is not None:  # both keep 4 of the 16 slots for the high class
        mine, theirs = ours[INTERACTIVE.cls], smg[INTERACTIVE.cls]
        out[f"{RESERVED}: high p99 TTFT, loaded over unloaded, at most smg's"] = (
            mine["ttft_p99"] / mine["unloaded_p99"] <= theirs["ttft_p99"] / theirs["unloaded_p99"]
        )
        out[f"{RESERVED}: goodput (tokens/s, both classes) at least 95 % of smg's"] = sum(
            ours[k.cls]["tokens_s"] for k in KINDS
        ) >= 0.95 * sum(smg[k.cls]["tokens_s"] for k in KINDS)
    return out


def verdict(cap: float, data: dict[str, dict[str, dict[str, float]]]) -> str:
    parts = []
    for name, by_class in data.items():
        high, low = by_class[INTERACTIVE.cls], by_class[BATCH.cls]
        ratio = high["ttft_p99"] / high["unloaded_p99"] if high.get("unloaded_p99") else 0.0
        parts.append(
            f"{name}: high p99 TTFT {_ms(high['ttft_p99']):.0f} ms ({ratio:.1f}x unloaded), "
            f"shed high {int(high['shed_429'] + high['shed_503'] + high['shed_408'])} / "
            f"low {int(low['shed_429'] + low['shed_503'] + low['shed_408'])}, goodput "
            f"{high['tokens_s'] + low['tokens_s']:.0f} tokens/s"
        )
    return f"Capacity {cap:.1f} req/s, {OVERLOAD:g}x offered. " + "; ".join(parts)


def method(shape: Shape) -> str:
    return (
        f"Simulated SGLang engines ({ENGINES} x DP{ENGINE.dp_size}, plain DP, "
        f"{ENGINE.limits.max_running} running slots a rank: {SLOTS} slots; 20 ms decode "
        "steps) in the bench process on the wall clock; each router in its own process, on "
        "a fresh cluster. The fleet's capacity is measured first on the engines alone: the "
        f"same mix, closed loop with {2 * SLOTS} clients, {shape.measure:g} s. Tenant "
        f"interactive ({SHARE:.0%} of the requests, class high, smg class interactive): "
        f"{INTERACTIVE.prompt}-token prompts, {INTERACTIVE.output}-token answers; tenant "
        f"batch (class low, smg bulk): {BATCH.prompt}-token prompts, {BATCH.output}-token "
        "answers; every request streamed, with its tenant's API key (dprouter: the key "
        "decides the class) and x-smg-priority (smg clamps it to the tenant's max_class). "
        "Each row: the "
        "interactive tenant's arrivals alone (Poisson at its share of the offered rate, "
        f"{shape.unloaded:g} s: the unloaded reference), then both tenants' at "
        f"{OVERLOAD:g}x the capacity for {shape.loaded:g} s, the same seeded arrivals for "
        f"every row. dprouter: --engine-queue 0, --dispatch-queue {shape.queue}, "
        f"--dispatch-wait {shape.wait}; with --tenants (interactive high, batch low), with "
        "and without --reserve 1 (a running slot a rank kept for the high class), or with "
        "no --tenants (one class, the dispatcher's longest-first order). smg 1.13.0: "
        "--dp-aware --policy least_load, --tenant-api-key per tenant, --priority-scheduler-"
        f"enabled with every class given (the defaults reserve more than {SLOTS} slots for "
        "system and interactive): interactive reserves 25 % of the slots, each class queues "
        f"{shape.queue} for {shape.wait} s at most (then 429, and a 503 "
        "scheduler_queue_timeout), no preemption, each tenant's max_class its own. Goodput: "
        "answers that ran to their end, per second of the loaded phase (first send to last "
        "answer); TTFT from the send to the first token, completed answers only."
    )


def run(quick: bool, out: Path, size: str | None = None, rows: Sequence[str] = ()) -> Result:
    """``size``: ``tiny`` for tests (else by ``quick``); ``rows``: by name (all by default)."""
    shape = SHAPES[size or ("quick" if quick else "full")]
    chosen = [r for r in ROWS if r.name in rows] if rows else list(ROWS)
    cap, data, notes = asyncio.run(measure(shape, chosen))
    columns = ["router", "class (tenant)", "offered", "completed", "goodput req/s"]
    columns += ["goodput tokens/s", "TTFT p50 ms", "TTFT p99 ms", "shed 429", "shed 503"]
    columns += ["shed 408", "errors", "unloaded p99 ms", "p99 loaded / unloaded"]
    return Result(
        scenario="overload",
        title="Overload: two tenants, two classes, 2x the fleet's capacity",
        method=method(shape),
        tables=[
            Table(columns, rows_of(data), f"capacity {cap:.1f} req/s, offered {OVERLOAD * cap:.1f}")
        ],
        verdict=verdict(cap, data) + (f" ({'; '.join(notes)})" if notes else "") + ".",
        checks=checks(data),
        data={"capacity_req_s": cap, "rows": data, "notes": notes, "shape": shape.__dict__},
    )
