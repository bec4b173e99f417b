"""Real-engine scenario, makespan: an RL rollout burst on a real SGLang engine, by route.

Issue 38. Under attention DP the engine steps at the pace of its busiest rank, so what a
routing costs a burst is the busiest rank's decode steps, which SGLang logs per rank
(``--decode-log-interval 1``; see ``harness/engine_log.py``). Those counts are the same
from run to run; wall time on 2 cores moves by +-30 %, so it is reported as a ratio to
the engine alone in the same round, beside the steps.

One engine (tiny Qwen3, ``--tp-size 2 --attn-dp-size 2``, ``--max-running-requests 8``:
4 running per rank, so a 48-request burst queues) serves every system of the run; each
system starts once and is reused, and the rounds interleave them: round r sends the same
burst (``rollout(r)``, ``grpo(r)``) to each in turn, all of it at once to ``/generate``.
Every answer is checked (HTTP 200, ``completion_tokens`` as asked). Only one real engine
runs on the machine at a time: its life is spent under a lock on ``LOCK``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import aiohttp

from dprouter.bench.harness import engine_log, peer_routers, rollout_burst
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in
from dprouter.bench.report.results import Cell, Result, Table

if TYPE_CHECKING:
    from e2e.sglang.server import SglangServer

LOCK = Path("/tmp/dprouter-real-engine.lock")
LOCK_WAIT = 3600.0  # seconds to wait for another real engine's run to end
ENGINE_ARGS = ("--max-running-requests", "8", "--decode-log-interval", "1")
SLOTS = 8  # running requests over both ranks: the slot model's lower bound
CONTROLLER = "sglang::data_pa"  # the DP controller's process title, as /proc cuts it
ENGINE = "engine"  # the kind of the reference row: requests straight to the engine
BURST_TIMEOUT = 900.0  # seconds one request of a burst may take


@dataclass(frozen=True, slots=True)
class System:
    """A row: ``kind`` is ENGINE, ``dprouter`` (``args`` to ``dprouter serve``) or a peer
    kind of ``peer_routers`` (``args``: its policy, then flags of its own)."""

    name: str
    kind: str
    args: tuple[str, ...] = ()


ALONE = System("engine alone", ENGINE)
DEFAULT = System("dprouter default", "dprouter")
SYSTEMS = (
    ALONE,
    System(
        "dprouter round_robin --dispatch off",
        "dprouter",
        ("--policy", "round_robin", "--dispatch", "off"),
    ),
    System(
        "dprouter least_load --dispatch off",
        "dprouter",
        ("--policy", "least_load", "--dispatch", "off"),
    ),
    System(
        "dprouter min_tokens --dispatch off",
        "dprouter",
        ("--policy", "min_tokens", "--dispatch", "off"),
    ),
    DEFAULT,
    System("smg 1.13 --dp-aware round_robin", "smg", ("round_robin",)),
    System(
        "smg 1.13 --dp-aware least_load, min tokens",
        "smg",
        ("least_load", "--dp-minimum-tokens-scheduler"),
    ),
    # reads only /server_info's dp_size, which is 1 under --attn-dp-size 2 (attn_dp_size
    # says 2): it registers rank 0 alone and sends it the whole burst
    System("sglang-router 0.3.2 --dp-aware round_robin", "sglang-gateway", ("round_robin",)),
)
QUICK = (ALONE, DEFAULT)
BURSTS: dict[str, tuple[Callable[[int], rollout_burst.Burst], str]] = {
    "rollout": (rollout_burst.rollout, "rollout: 48 independent prompts"),
    "grpo": (rollout_burst.grpo, "GRPO: 12 prompts x 8 samples, groups interleaved"),
}
VARIANTS = {"rollout": ("rollout",), "grpo": ("grpo",), "both": ("rollout", "grpo")}
# a router's health check is a generation on the engine, which would land in another
# system's burst: none while measuring
NO_HEALTH = {
    "dprouter": ("--health-interval", "0"),
    "peer": ("--health-check-interval-secs", "86400"),
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One burst through one system."""

    steps: dict[int, int]  # decode steps per rank
    makespan: float  # seconds, first send to last answer
    p90: float  # seconds, of the requests' latencies
    failed: list[str]  # one line per request lost, failed or short

    @property
    def busiest(self) -> int:
        return max(self.steps.values(), default=0)


@dataclass
class Measured:
    bursts: dict[str, list[rollout_burst.Burst]]  # variant -> one per round
    runs: dict[str, dict[str, list[Outcome]]]  # variant -> system -> one per round
    unavailable: dict[str, str] = field(default_factory=dict)  # system -> why it did not run
    notes: list[str] = field(default_factory=list)


def sglang() -> ModuleType | str:
    """``e2e.sglang.server``, or why a real SGLang engine cannot run. ``e2e`` lives in the
    source checkout beside ``src/``, not in the installed package."""
    root = Path(__file__).resolve().parents[4]
    if (root / "e2e" / "sglang" / "server.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        from e2e.sglang import server
    except ImportError as exc:
        return f"the real-engine helpers (e2e/) are not importable: run from the repo ({exc})"
    reason = server.available()
    return server if reason is None else f"{reason} (then dprouter bench makespan again)"


class Holds:
    """This process's holds of ``LOCK``. An flock belongs to an open file, so a second
    flock from the same process would wait on the first forever: a nested hold (a test
    group holding it while a scenario it runs asks again) only counts."""

    def __init__(self) -> None:
        self.count = 0


HOLDS = Holds()  # one per process, as the flock it counts


@contextlib.contextmanager
def engine_lock(seconds: float = LOCK_WAIT) -> Iterator[None]:
    """Hold ``LOCK`` (flock, exclusive): one real engine on the machine at a time."""
    if HOLDS.count:
        HOLDS.count += 1
        try:
            yield
        finally:
            HOLDS.count -= 1
        return
    with LOCK.open("a") as f:
        deadline = time.monotonic() + seconds
        told = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another real engine held {LOCK} for {seconds:.0f} s"
                    ) from None
                if not told:
                    print(f"waiting for {LOCK}: another real engine runs", file=sys.stderr)
                    told = True
                time.sleep(2)
        HOLDS.count = 1
        try:
            yield
        finally:
            HOLDS.count = 0
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def engine(server: ModuleType) -> Iterator[SglangServer]:
    """The engine of a run, under the lock, stopped (its process group) on the way out."""
    with engine_lock():
        args = {"attn_dp_size": 2, "model": "qwen3", "extra_args": ENGINE_ARGS}
        with server.SglangServer(server.free_port(), **args) as srv:
            srv.wait_ready(300)
            renice_controller(srv.pids())
            yield srv


def renice_controller(pids: Sequence[int]) -> None:
    """The DP controller busy-polls its sockets and holds most of a core; at nice 19 the
    ranks get the cores. Routing and counts do not change, only how long a run takes."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith(CONTROLLER):
                os.setpriority(os.PRIO_PROCESS, pid, 19)


def serve_knows(flag: str) -> bool:
    done = subprocess.run(
        [*DPROUTER, "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    return flag in done.stdout


def dprouter_argv(system: System, engine_url: str, dispatch: bool) -> list[str]:
    """``dprouter serve`` for a row; without ``--dispatch VALUE`` when this dprouter lacks
    the flag (it holds nothing then: the same as ``off``)."""
    args = list(system.args)
    if not dispatch and "--dispatch" in args:
        i = args.index("--dispatch")
        del args[i : i + 2]
    return [
        *DPROUTER,
        "serve",
        "--worker",
        engine_url,
        "--port",
        "0",
        *NO_HEALTH["dprouter"],
        *args,
    ]


async def start(system: System, engine_url: str, dispatch: bool) -> tuple[Proc | None, str]:
    """The system's process (None for the engine alone) and the URL to send to."""
    if system.kind == ENGINE:
        return None, engine_url
    if system.kind == "dprouter":
        proc = Proc(dprouter_argv(system, engine_url, dispatch))
        try:
            url = url_in(await proc.start(r"dprouter on http://", 60))
            await peer_routers.until_serving(url, 120, model="tiny", proc=proc)
        except BaseException:
            await proc.stop()
            raise
        return proc, url
    reason = await asyncio.to_thread(peer_routers.ensure)
    if reason is not None:
        raise RuntimeError(reason)
    policy, *extra = system.args
    return await peer_routers.start_on_free_port(
        lambda port: peer_routers.router(
            system.kind,
            [engine_url],
            port,
            policy=policy,
            dp_aware=True,
            extra=(*extra, *NO_HEALTH["peer"]),
        ),
        120,
        model="tiny",
    )


async def fire(
    session: aiohttp.ClientSession, url: str, burst: rollout_burst.Burst
) -> tuple[float, list[float], list[str]]:
    """Send every request of ``burst`` at once; (makespan, latencies, failures)."""
    gate = asyncio.Event()
    latencies = [0.0] * len(burst)
    failed: list[str] = []

    async def one(i: int) -> None:
        await gate.wait()
        t0 = time.perf_counter()
        try:
            async with session.post(url + "/generate", json=burst.body(i)) as r:
                status, text = r.status, await r.text()
            if status != 200:
                failed.append(f"request {i}: HTTP {status}: {text[:160]}")
            else:
                got = _tokens(text)
                if got != burst.lengths[i]:
                    failed.append(f"request {i}: {got} tokens of {burst.lengths[i]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            failed.append(f"request {i}: lost ({type(exc).__name__}: {exc})")
        latencies[i] = time.perf_counter() - t0

    tasks = [asyncio.create_task(one(i)) for i in range(len(burst))]
    await asyncio.sleep(0.2)  # every task waits at the gate
    t0 = time.perf_counter()
    gate.set()
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0, latencies, failed


def _tokens(text: str) -> int | None:
    try:
        answer: Any = json.loads(text)
        return int(answer["meta_info"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


def p90(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))] if s else 0.0


async def one_burst(
    session: aiohttp.ClientSession, url: str, burst: rollout_burst.Burst, log: Path
) -> Outcome:
    """A burst and the decode steps the engine logged for it: the window opens once the
    log has settled after whatever ran before, and closes once it settles again."""
    start = await engine_log.settled(log, engine_log.offset(log), quiet=0.5)
    makespan, latencies, failed = await fire(session, url, burst)
    end = await engine_log.settled(log, start)
    return Outcome(engine_log.steps(log, start, end), makespan, p90(latencies), failed)


async def measure_on(
    engine_url: str, log: Path, systems: Sequence[System], variants: Sequence[str], rounds: int
) -> Measured:
    bursts = {v: [BURSTS[v][0](r) for r in range(rounds)] for v in variants}
    found = Measured(bursts, {v: {} for v in variants})
    dispatch = await asyncio.to_thread(serve_knows, "--dispatch")
    if not dispatch:
        found.notes.append("This dprouter has no --dispatch yet: its rows ran without it")
    procs: list[Proc] = []
    urls: dict[str, str] = {}
    timeout = aiohttp.ClientTimeout(total=BURST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0)
    try:
        for system in systems:
            try:
                proc, urls[system.name] = await start(system, engine_url, dispatch)
            except Exception as exc:  # a row says why; the run goes on
                found.unavailable[system.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            if proc is not None:
                procs.append(proc)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for url in urls.values():  # each system's first use: not counted
                await one_burst(session, url, rollout_burst.warmup(), log)
            for r in range(rounds):
                for v in variants:
                    for name, url in urls.items():
                        outcome = await one_burst(session, url, bursts[v][r], log)
                        found.runs[v].setdefault(name, []).append(outcome)
                        print(
                            f"round {r} {v} {name}: busiest {outcome.busiest} steps "
                            f"{outcome.steps}, {outcome.makespan:.1f} s, "
                            f"{len(outcome.failed)} failed",
                            file=sys.stderr,
                        )
    finally:
        for proc in reversed(procs):
            await proc.stop()
    return found


def measure(
    server: ModuleType, systems: Sequence[System], variants: Sequence[str], rounds: int
) -> Measured:
    """One engine for the whole run; every system, round after round."""
    with engine(server) as srv:
        assert srv.log_path is not None
        return asyncio.run(measure_on(srv.url, srv.log_path, systems, variants, rounds))


def ratios(
    mine: list[Outcome], alone: list[Outcome], of: Callable[[Outcome], float]
) -> list[float]:
    return [of(m) / max(of(a), 1e-9) for m, a in zip(mine, alone, strict=True)]


def table(found: Measured, variant: str, systems: Sequence[System]) -> Table:
    runs, bursts = found.runs[variant], found.bursts[variant]
    alone = runs[ALONE.name]
    columns = ["system", "busiest-rank steps (median)", "steps x alone: min", "median", "max"]
    columns += ["makespan x alone (median)", "p90 x alone (median)", "requests failed", "note"]
    rows: list[list[Cell]] = []
    for system in systems:
        if system.name in found.unavailable:
            rows.append([system.name, *[None] * 7, found.unavailable[system.name]])
            continue
        mine = runs[system.name]
        steps = ratios(mine, alone, lambda o: o.busiest)
        rows.append(
            [
                system.name,
                statistics.median(o.busiest for o in mine),
                min(steps),
                statistics.median(steps),
                max(steps),
                statistics.median(ratios(mine, alone, lambda o: o.makespan)),
                statistics.median(ratios(mine, alone, lambda o: o.p90)),
                sum(len(o.failed) for o in mine),
                None,
            ]
        )
    bound = [rollout_burst.lower_bound(b.lengths, SLOTS) for b in bursts]
    low = [b / max(a.busiest, 1) for b, a in zip(bound, alone, strict=True)]
    rows.append(["slot-model lower bound", statistics.median(bound), min(low)])
    rows[-1] += [statistics.median(low), max(low), None, None, None, None]
    return Table(columns, rows, title=BURSTS[variant][1])


def problems(found: Measured, quick: bool) -> list[str]:
    """What fails the run: a request lost, failed or short; in quick mode, dprouter's
    default needing more busiest-rank steps than the engine alone."""
    out = [
        f"{v} round {r}, {name}: {line}"
        for v, by_system in found.runs.items()
        for name, outcomes in by_system.items()
        for r, o in enumerate(outcomes)
        for line in o.failed
    ]
    for v, by_system in found.runs.items():
        if not quick or DEFAULT.name not in by_system:
            continue
        for r, (d, a) in enumerate(
            zip(by_system[DEFAULT.name], by_system[ALONE.name], strict=True)
        ):
            if d.busiest > a.busiest:
                out.append(
                    f"{v} round {r}: dprouter default {d.busiest} busiest-rank steps, "
                    f"more than the engine alone's {a.busiest}"
                )
    return out


def run(quick: bool, out: Path, rounds: int | None = None, variant: str | None = None) -> Result:
    rounds = rounds or (1 if quick else 4)
    variants = VARIANTS[variant or ("rollout" if quick else "both")]
    systems = QUICK if quick else SYSTEMS
    title = "Makespan: an RL rollout burst on a real SGLang engine, by route"
    server = sglang()
    if isinstance(server, str):
        return Result("makespan", title, server, [], f"Not run: {server}.")
    found = measure(server, systems, variants, rounds)
    result = Result(
        scenario="makespan",
        title=title,
        method=(
            "one real SGLang CPU engine (tiny Qwen3, --tp-size 2 --attn-dp-size 2, "
            "--max-running-requests 8: 4 running per rank) for every row; each round sends "
            "the same seeded burst to each system in turn, all at once, to /generate "
            "(token-id prompts, ignore_eos); decode steps per rank counted in the engine's "
            "log (--decode-log-interval 1), every answer checked (HTTP 200, "
            f"completion_tokens as asked); {rounds} round(s), a warm-up burst before each "
            "system's first. Ratios are to the engine alone (its own DP controller) in "
            f"the same round; lower bound: lower_bound(lengths, {SLOTS})."
            + "".join(f" {note}." for note in found.notes)
        ),
        tables=[table(found, v, systems) for v in variants],
        verdict=verdict(found, variants),
        checks=checks(found),
        data={
            "rounds": rounds,
            "unavailable": found.unavailable,
            "runs": {
                v: {n: [_raw(o) for o in os] for n, os in by.items()}
                for v, by in found.runs.items()
            },
        },
    )
    failing = problems(found, quick)
    if failing:
        print(f"\n{result.title}\n{result.table()}\n", file=sys.stdout)
        raise RuntimeError("makespan failed:\n  " + "\n  ".join(failing[:20]))
    return result


def _raw(o: Outcome) -> dict[str, Any]:
    return {"steps": o.steps, "makespan": o.makespan, "p90": o.p90, "failed": o.failed}


def verdict(found: Measured, variants: Sequence[str]) -> str:
    parts = []
    for v in variants:
        runs = found.runs[v]
        if DEFAULT.name not in runs:
            continue
        steps = ratios(runs[DEFAULT.name], runs[ALONE.name], lambda o: o.busiest)
        parts.append(
            f"{v}: dprouter default {statistics.median(steps):.2f}x the engine "
            "alone's busiest-rank decode steps"
        )
    return ("; ".join(parts) or "dprouter default did not run") + " (median over rounds)."


def checks(found: Measured) -> dict[str, bool]:
    lost = sum(len(o.failed) for by in found.runs.values() for os in by.values() for o in os)
    out = {"no request lost, failed or short": lost == 0}
    pairs = [
        (d, a)
        for by in found.runs.values()
        if DEFAULT.name in by
        for d, a in zip(by[DEFAULT.name], by[ALONE.name], strict=True)
    ]
    if pairs:
        out["dprouter default needs no more busiest-rank steps than the engine alone"] = all(
            d.busiest <= a.busiest for d, a in pairs
        )
    return out
