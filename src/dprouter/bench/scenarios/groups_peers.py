"""Scenario: the two shapes of ``groups`` over real HTTP, dprouter beside smg 1.13.0.

The simulated engines (SGLang persona, DP attention, KV events, the simulator's
byte-level BPE files) run in this process, time-compressed as in ``peers``; each
router runs in its own process. Every figure is the engines' own: each request's
``SimRequest`` is kept as the engine takes it, and its first token and end are read
against the moment the client sent it, on that engine's virtual clock -- so the
router's own time (and any wait it imposes) counts, the HTTP client's does not.

- shared: 1 engine x DP8, 16 groups x 32 prompts sharing a 4,096-token system prompt,
  128-token questions, 256-token answers, 64 closed-loop clients sending them in order;
- grpo: 2 engines x DP4, 16 groups of 8 concurrent samples of one ~4,500-token prompt,
  a group every simulated second (open loop), outputs log-normal (median 256, cap 1,024).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.peers import CHAT_EVENTS, Run, start, tokens_per_word
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.http.runner import Progress
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.request import SimRequest
from dprouter.sim.model.vocab import write_tokenizer

RUNS = (
    Run("dprouter, round_robin", "dprouter", ("--policy", "round_robin")),
    Run("dprouter, cache_aware", "dprouter", ("--policy", "cache_aware")),
    Run("dprouter, prefix (events)", "dprouter", ("--policy", "prefix"), events=True),
    Run("dprouter, min_tokens", "dprouter", ("--policy", "min_tokens")),
    Run("smg 1.13.0 --dp-aware, cache_aware", "smg", ("cache_aware", "dp-aware")),
    Run("smg 1.13.0 --dp-aware, prefix_hash", "smg", ("prefix_hash", "dp-aware")),
)
BASE = RUNS[0].name
# wall seconds per simulated second. The engines tokenise each ~4k-token prompt on the
# bench's event loop in wall time (2-5 ms), and a DP-attention batch ends its requests
# together, so 64 closed-loop clients send in waves that queue there: ~200 wall ms from
# send to engine at any scale, 0.8 simulated s at peers' 0.25 (TTFT x3, req/s / 2 against
# the offline run); 0.5 halves that, 1.0 would take ~6 minutes
SCALE = 0.5
SHAPES = {"shared": (1, 8), "grpo": (2, 4)}  # engines x DP
Metrics = dict[str, float]
Submit = Callable[[SimRequest], asyncio.Queue[Progress]]


@dataclass
class Log:
    """What the client sent (prompt text -> each engine's virtual clock at the send,
    one entry per copy sent) and what the engines took, in order of arrival."""

    servers: list[SimServer]
    sent: dict[str, list[list[float]]] = field(default_factory=lambda: defaultdict(list))
    taken: list[tuple[int, SimRequest]] = field(default_factory=list)
    before: list[int] = field(default_factory=list)  # each engine's records before the run

    def watch(self) -> None:
        """Keep each request an engine takes from now on (a router's warm-up came before)."""
        self.before = [sum(r.rank is not None for r in s.received) for s in self.servers]
        for i, server in enumerate(self.servers):
            runner = server.runner
            runner.submit = self._keeping(i, runner.submit)  # type: ignore[method-assign,assignment]

    def _keeping(self, engine: int, submit: Submit) -> Submit:
        def kept(req: SimRequest) -> asyncio.Queue[Progress]:
            queue = submit(req)
            self.taken.append((engine, req))
            return queue

        return kept

    async def post(self, session: aiohttp.ClientSession, url: str, prompt: str, cap: int) -> None:
        self.sent[prompt].append([s.runner.now() for s in self.servers])
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": cap}
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status} through {url}: {(await r.text())[:200]}")


def words(rng: random.Random, tokens: float, per_word: float) -> str:
    return " ".join(f"w{rng.getrandbits(20)}" for _ in range(max(1, round(tokens / per_word))))


async def shared(log: Log, url: str, per_word: float, groups: int, seed: int) -> None:
    """``groups`` x 32 prompts over 4,096-token system prompts, in order, 64 clients."""
    rng = random.Random(seed)
    queue = [
        system + " " + words(rng, 128, per_word)
        for system in (words(rng, 4096, per_word) for _ in range(groups))
        for _ in range(32)
    ]
    queue.reverse()  # popped from the end: in order

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            await log.post(session, url, queue.pop(), 256)

    await with_session(lambda s: asyncio.gather(*(client(s) for _ in range(64))))


async def grpo(log: Log, url: str, per_word: float, groups: int, seed: int) -> None:
    """A group of 8 samples each simulated second; each sample ends at its log-normal
    length (the simulator's ``eos=N``) under max_tokens 1,024, as a rollout's does."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()

    async def send(session: aiohttp.ClientSession) -> None:
        t0, tasks = loop.time(), []
        for g in range(groups):
            await asyncio.sleep(max(0.0, t0 + g * SCALE - loop.time()))
            prompt = words(rng, 4500 + rng.randint(-300, 300), per_word)
            for _ in range(8):
                n = max(32, min(1024, int(rng.lognormvariate(0, 0.6) * 256)))
                tasks.append(asyncio.create_task(log.post(session, url, f"{prompt} eos={n}", 1024)))
        await asyncio.gather(*tasks)

    await with_session(send)


async def with_session(body: Callable[[aiohttp.ClientSession], Awaitable[object]]) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await body(session)


@contextlib.asynccontextmanager
async def routed(run: Run, engine: EngineConfig, engines: int) -> AsyncIterator[tuple[Log, str]]:
    """``run``'s router over a fresh cluster of ``engines`` x ``engine``, what the engines
    take watched from now on: the log and the router's URL. The router stops on the way
    out; the engines after, so their records can still be read inside."""
    async with SimCluster([engine] * engines) as cluster:
        proc, url = await start(run, cluster.servers, engine)
        try:
            log = Log(cluster.servers)
            log.watch()
            yield log, url
        finally:
            await proc.stop()


async def once(run: Run, shape: str, config: EngineConfig, per_word: float, quick: bool) -> Metrics:
    engines, dp = SHAPES[shape]
    engine = replace(config, dp_size=dp, time_scale=SCALE)
    async with routed(run, engine, engines) as (log, url):
        workload = shared if shape == "shared" else grpo
        lags: list[float] = []
        probe = asyncio.create_task(_lag(lags))
        try:
            await workload(log, url, per_word, 8 if quick else 16, seed=1)
        finally:
            probe.cancel()
        return {**_metrics(log, dp), "loop_lag_ms": statistics.mean(lags or [0.0]) * 1e3}


async def _lag(lags: list[float]) -> None:
    """How late this process's event loop wakes (wall s): the engines, the clients and
    their clocks share it, so a loop that cannot keep up stretches every figure."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.01)
        lags.append(loop.time() - t - 0.01)


def _metrics(log: Log, dp: int) -> Metrics:
    """The engines' figures of the requests the client sent (a router's warm-up not)."""
    sends = {p: list(times) for p, times in log.sent.items()}
    groups: dict[str, int] = {}  # the text before "eos=": one group's prompt
    per_rank: dict[int, int] = defaultdict(int)
    spread: dict[int, set[int]] = defaultdict(set)
    ttft, latency, routed, start, end = [], [], [], float("inf"), 0.0
    for (i, req), prompt in zip(log.taken, _received(log), strict=True):
        if not sends.get(prompt):
            continue  # a router's retry of one taken before, or not ours
        if req.first_token_at is None or req.finished_at is None:
            continue  # aborted: the router tried again, or gave up and said so
        sent = sends[prompt].pop(0)[i]
        target = i * dp + (req.rank or 0)
        per_rank[target] += 1
        g = groups.setdefault(prompt.rsplit(" eos=", 1)[0], len(groups))
        spread[g].add(target)
        ttft.append(req.first_token_at - sent)
        latency.append(req.finished_at - sent)
        routed.append(req.arrival - sent)
        start, end = min(start, sent), max(end, req.finished_at)
    if any(sends.values()):
        raise RuntimeError("a request the client sent never reached an engine")
    ranks = [r for s in log.servers for r in s.engine.ranks]
    counts = [per_rank[t] for t in range(len(ranks))]
    ttft.sort()
    latency.sort()
    widths = [len(s) for s in spread.values()]
    return {
        "requests": float(len(ttft)),
        "req_s": len(ttft) / (end - start),
        "ttft_mean": statistics.mean(ttft),
        "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "latency_p50": latency[len(latency) // 2],
        "latency_p90": latency[int(0.9 * (len(latency) - 1))],
        "to_engine_ms": statistics.mean(routed) * 1e3,
        "imbalance": max(counts) / statistics.mean(counts),
        "hit_rate": sum(r.stats.prefix_hits for r in ranks)
        / max(sum(r.stats.prefix_queries for r in ranks), 1),
        "mean_ranks_per_group": statistics.mean(widths),
    }


def _received(log: Log) -> list[str]:
    """Each taken request's prompt text, in the order the engines took them: an engine
    records a request right after it takes it, with nothing in between."""
    out: list[str] = []
    by_engine = [[r for r in s.received if r.rank is not None] for s in log.servers]
    seen = list(log.before)
    for i, req in log.taken:
        r = by_engine[i][seen[i]]
        seen[i] += 1
        assert r.rank == req.rank, "an engine's records out of step with what it took"
        out.append(r.body.get("prompt", "") if isinstance(r.body, dict) else "")
    return out


async def measure(quick: bool) -> tuple[dict[str, dict[str, Metrics]], list[str], list[str]]:
    """Every row on both shapes, each on a fresh cluster: the figures by shape and row,
    the rows not run (no smg here) and the runs that failed."""
    missing = peer_routers.ensure()
    smg = missing is None or peer_routers.binary("smg").exists()
    chosen = [r for r in RUNS if r.kind == "dprouter" or smg]
    skipped = [f"{r.name} ({missing})" for r in RUNS if r not in chosen]
    data: dict[str, dict[str, Metrics]] = {shape: {} for shape in SHAPES}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dprouter-groups-peers-") as files:
        tokenizer = write_tokenizer(Path(files))
        config = EngineConfig(
            persona="sglang", dp_attention=True, tokenizer=str(tokenizer), kv_events=CHAT_EVENTS
        )
        per_word = tokens_per_word(tokenizer)
        for shape in SHAPES:
            for run in chosen:
                try:
                    data[shape][run.name] = await once(run, shape, config, per_word, quick)
                except (RuntimeError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    print(f"{shape}, {run.name}: {exc}")
                    failed.append(f"{shape}: {run.name}")
    return data, skipped, failed


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x"


def _rows(shape: str, found: dict[str, Metrics]) -> list[list[Cell]]:
    base = found.get(BASE)
    rows: list[list[Cell]] = []
    for name, m in found.items():
        row: list[Cell] = [
            name,
            m["req_s"],
            _ratio(m["req_s"], base["req_s"]) if base else "-",
            m["ttft_mean"] * 1e3,
            _ratio(m["ttft_mean"], base["ttft_mean"]) if base else "-",
            m["ttft_p99"] * 1e3,
        ]
        if shape == "grpo":
            row += [
                f"{m['latency_p50']:.2f} / {m['latency_p90']:.2f}",
                _ratio(m["latency_p90"], base["latency_p90"]) if base else "-",
                m["mean_ranks_per_group"],
            ]
        rows.append(
            [*row, m["imbalance"], f"{m['hit_rate']:.1%}", m["to_engine_ms"], m["loop_lag_ms"]]
        )
    return rows


def checks(data: dict[str, dict[str, Metrics]]) -> dict[str, bool]:
    """dprouter's best row against smg's best, per shape, on req/s and mean TTFT."""
    out: dict[str, bool] = {}
    for shape, found in data.items():
        ours = [m for n, m in found.items() if n.startswith("dprouter")]
        theirs = [m for n, m in found.items() if n.startswith("smg")]
        if not ours or not theirs:
            continue
        fast, quick = max(m["req_s"] for m in ours), min(m["ttft_mean"] for m in ours)
        out[f"{shape}: dprouter's best req/s >= smg's best"] = fast >= max(
            m["req_s"] for m in theirs
        )
        out[f"{shape}: dprouter's best mean TTFT <= smg's best"] = quick <= min(
            m["ttft_mean"] for m in theirs
        )
    return out


def _best(found: dict[str, Metrics], who: str, key: str) -> str:
    """``who``'s best row on ``key`` (req/s: the most; TTFT: the least), named."""
    rows = {n: m[key] for n, m in found.items() if n.startswith(who)}
    if not rows:
        return f"{who}: not run"
    name = (max if key == "req_s" else min)(rows, key=rows.__getitem__)
    return f"{name} {rows[name]:.1f}" if key == "req_s" else f"{name} {rows[name] * 1e3:.0f}"


def run(quick: bool, out: Path) -> Result:
    data, skipped, failed = asyncio.run(measure(quick))
    groups = 8 if quick else 16
    common = ["req/s", "vs round_robin", "TTFT mean ms", "vs round_robin", "TTFT p99 ms"]
    tail = ["busiest/mean requests", "hit rate", "send to engine ms", "loop lag ms"]
    tables = [
        Table(["router", *common, *tail], _rows("shared", data["shared"]), "shared system prompts"),
        Table(
            [
                "router",
                *common,
                "latency p50 / p90 s",
                "p90 vs round_robin",
                "ranks per group",
                *tail,
            ],
            _rows("grpo", data["grpo"]),
            "GRPO groups",
        ),
    ]
    found = checks(data)
    headline = "; ".join(
        f"{shape}: best req/s {_best(m, 'dprouter', 'req_s')} against "
        f"{_best(m, 'smg', 'req_s')}, best mean TTFT (ms) "
        f"{_best(m, 'dprouter', 'ttft_mean')} against {_best(m, 'smg', 'ttft_mean')}"
        for shape, m in data.items()
    )
    notes = [f"not run: {', '.join(skipped)}"] if skipped else []
    notes += [f"failed: {', '.join(failed)}"] if failed else []
    return Result(
        scenario="groups-peers",
        title="Groups over HTTP: dprouter beside smg 1.13.0 on the shapes of groups",
        method=(
            f"The two shapes of `groups` over real HTTP, one run each on a fresh cluster: "
            f"simulated SGLang engines with DP attention in the bench process at {SCALE} wall "
            "s per simulated s (default cost model: prefill runs alone, 6 ms + 0.08 ms per "
            "sequence a decode step), tokenising with the simulator's byte-level BPE files and "
            "publishing KV events, which dprouter's prefix subscribes to with the same "
            "tokenizer; each router in its own process, smg 1.13.0 with --dp-aware. Prompts "
            "are text of random words sized in that tokenizer's tokens. Shared: 1 engine x "
            f"DP8, {groups} groups x 32 prompts over a 4,096-token system prompt, 128-token "
            "questions, 256-token answers, 64 closed-loop clients sending them in order. GRPO: "
            f"2 engines x DP4, {groups} groups of 8 concurrent samples of one ~4,500-token "
            "prompt, a group each simulated second, each sample ending at a log-normal length "
            "(median 256, cap 1,024, sent as max_tokens). Every figure is the engines' own, "
            "in simulated time: TTFT and latency from the client's send to the engine's first "
            "and last token; req/s over first send to last token; busiest/mean is the busiest "
            "rank's requests over the mean; hit rate from the engines' prefix-cache counters; "
            "send to engine: from the client's send to the engine's taking the request "
            "(router, HTTP and the engine's tokenising, simulated ms); "
            "ranks per group: the distinct ranks a GRPO group's samples reached; loop lag: "
            "how late the bench process's event loop (engines and clients) woke, mean wall "
            "ms -- above a few ms the machine, not the router, sets the pace. One run per row, "
            "about 3 minutes in all: two full runs on this 2-core machine differed by up to 15 % "
            "in a row's req/s and 36 % in its mean TTFT on the shared shape, 2 % and 18 % on "
            "GRPO (whose req/s the arrivals set), so smaller margins are run-to-run noise."
        ),
        tables=tables,
        verdict=headline + (f" ({'; '.join(notes)})" if notes else "") + ".",
        checks=found,
        data={**data, "not_run": skipped, "failed": failed},
    )
