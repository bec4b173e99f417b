"""Scenario 4, peers: the same simulated cluster behind dprouter, the SGLang gateway (smg
1.13.0 and its January build 0.3.2) and vllm-router; routing quality of scenarios 2 and
3, side by side, over real HTTP.

The simulated engines run in this process (their step times and caches are
read directly), compressed in time; each router runs in its own process.
Closed-loop sessions send text prompts with every session header the
routers know (``X-SMG-Routing-Key``, ``X-Session-ID``). The chat engines tokenise
with real tokenizer files, written once per run, and publish their KV-cache events,
which dprouter's ``prefix`` run subscribes to; every chat row runs on that same
engine config.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in
from dprouter.bench.report.plots import bars
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.peers_checks import ORACLE, aims, hits, processes
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.model.vocab import write_tokenizer

SCALE = 0.25  # wall seconds per simulated second
# rollout workloads per run, each on a fresh cluster, by --quick: their rank balance swings
# from run to run; the chat hit rates hold steady on one
SEEDS = {False: 2, True: 1}
# ...and for the rows that compare --processes 2 with one process, by --quick: one seed's
# busiest/mean moves by +-0.15 between two runs of the same seed through the same router
# (a few long decodes decide the busiest of 32 ranks), with outliers past 2.0 in either
# mode, so a 5 % comparison needs the mean of many: +-3 % (paired) at 12 seeds, where 6
# once put one outlier on a ratio of 1.15 that 14 seeds put at 0.98
PAIRED_SEEDS = {False: 12, True: 1}
DEADLINE = 60.0  # a turn slower than this (simulated seconds) counts as late
# DP-attention engines for the rollouts: few running sequences per rank, so that the
# HTTP run stays short in wall time
ROLLOUT_ENGINE = EngineConfig(
    persona="sglang",
    dp_size=4,
    dp_attention=True,
    cost=CostModel(
        step_base=5e-3, decode_per_seq=1e-4, prefill_per_token=4e-5, decode_per_kv_token=2e-7
    ),
    limits=RankLimits(max_running=4),
)
# the chat engines' KV events: each engine's ranks on free ports, with a replay socket
CHAT_EVENTS = KvEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
)


@dataclass(frozen=True)
class Run:
    name: str
    kind: str  # dprouter, or a peer's kind: smg, sglang-gateway, vllm-router
    args: tuple[str, ...]
    events: bool = False  # dprouter subscribes to the engines' KV events, with their tokenizer
    paired: bool = False  # compared with another row to a few %: run PAIRED_SEEDS times
    # the client sends each turn's true length as max_tokens (the oracle row), not the cap
    exact: bool = False


TWO = ("--processes", "2")
ROLLOUT_RUNS = (
    Run("dprouter, not DP-aware (manual)", "dprouter", ("--dp-aware", "off", "--sessions")),
    Run("dprouter, manual + min_load", "dprouter", ("--sessions",)),
    Run("dprouter, min_tokens", "dprouter", ("--policy", "min_tokens"), paired=True),
    Run("dprouter, least_load", "dprouter", ("--policy", "least_load"), paired=True),
    Run(
        "dprouter, min_tokens, --processes 2",
        "dprouter",
        ("--policy", "min_tokens", *TWO),
        paired=True,
    ),
    Run(
        "dprouter, least_load, --processes 2",
        "dprouter",
        ("--policy", "least_load", *TWO),
        paired=True,
    ),
    # the best any admission-time router could do with min_tokens: told each decode's length
    Run(
        ORACLE,
        "dprouter",
        ("--policy", "min_tokens", "--output-budget", "cap"),
        paired=True,
        exact=True,
    ),
    Run("smg 1.13.0 --dp-aware, manual", "smg", ("manual", "dp-aware")),
    # smg's own minimum-tokens scheduler over the DP ranks: its answer to the DP-attention case
    Run(
        "smg 1.13.0 --dp-aware, least_load, min tokens",
        "smg",
        ("least_load", "dp-aware", "--dp-minimum-tokens-scheduler"),
    ),
    Run("SGLang gateway 0.3.2 --dp-aware, manual", "sglang-gateway", ("manual", "dp-aware")),
    Run("SGLang gateway 0.3.2, manual (not DP-aware)", "sglang-gateway", ("manual",)),
    Run("vllm-router DP4, consistent_hash", "vllm-router", ("consistent_hash",)),
)
PREFIX_RUNS = (
    Run("dprouter, round_robin", "dprouter", ("--policy", "round_robin")),
    Run("dprouter, cache_aware", "dprouter", ("--policy", "cache_aware")),
    Run("dprouter, cache_aware, --processes 2", "dprouter", ("--policy", "cache_aware", *TWO)),
    Run("dprouter, consistent_hash", "dprouter", ("--policy", "consistent_hash")),
    Run("dprouter, prefix", "dprouter", ("--policy", "prefix"), events=True),
    Run("smg 1.13.0 --dp-aware, cache_aware", "smg", ("cache_aware", "dp-aware")),
    Run("smg 1.13.0 --dp-aware, prefix_hash", "smg", ("prefix_hash", "dp-aware")),
    Run(
        "SGLang gateway 0.3.2 --dp-aware, cache_aware",
        "sglang-gateway",
        ("cache_aware", "dp-aware"),
    ),
    Run("vllm-router DP4, cache_aware", "vllm-router", ("cache_aware",)),
)


async def start(run: Run, servers: Sequence[SimServer], engine: EngineConfig) -> tuple[Proc, str]:
    urls = [s.url for s in servers]
    dp = engine.dp_size
    if run.kind != "dprouter":
        return await peer_routers.start_on_free_port(
            lambda port: peer_routers.router(
                run.kind,
                urls,
                port,
                policy=run.args[0],
                dp_size=dp,
                dp_aware="dp-aware" in run.args,
                extra=tuple(a for a in run.args[1:] if a.startswith("--")),
            ),
            90,
            model="sim-model",
        )
    options = [""] * len(servers)
    tokenizer: list[str] = []
    if run.events:
        if engine.tokenizer is None or any(s.kv is None for s in servers):
            raise ValueError(f"{run.name}: the engines publish no KV events or have no tokenizer")
        options = [_events_option(s) for s in servers]
        tokenizer = ["--tokenizer", engine.tokenizer]
    workers = (a for u, o in zip(urls, options, strict=True) for a in ("--worker", u + o))
    proc = Proc(
        [
            *DPROUTER,
            "serve",
            *workers,
            *tokenizer,
            "--port",
            "0",
            "--load-interval",
            "0.5",
            *run.args,
        ]
    )
    url = url_in(await proc.start(r"dprouter on http://"))
    await peer_routers.until_serving(url, 90, model="sim-model", proc=proc)
    return proc, url


def _events_option(server: SimServer) -> str:
    """``,kv_events=...,kv_replay=...`` for a worker: rank 0's endpoints; rank r publishes
    at port + r, as the engines do (the simulator picks a base where all are free)."""
    assert server.kv is not None
    option = f",kv_events={server.kv.endpoints[0]}"
    replay = server.kv.replay_endpoints[0]
    return option + (f",kv_replay={replay}" if replay is not None else "")


async def sessions(
    url: str,
    count: int,
    turns: int,
    system: int,
    decode: tuple[int, int],
    shared: int,
    seed: int,
    per_word: float = 1.0,
    exact: bool = False,
) -> list[float]:
    """Closed-loop sessions; returns each turn's latency in simulated seconds. Prompts are
    text of random words (token-id prompts are not accepted by every router); sizes are
    in tokens, a word costing ``per_word`` of them (1 by the simulator's built-in rule)."""
    rng = random.Random(seed)

    def words(tokens: int) -> list[str]:
        return [f"w{rng.getrandbits(20)}" for _ in range(max(1, round(tokens / per_word)))]

    systems = [words(system) for _ in range(max(shared, 1))]
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        context = systems[i % len(systems)] + words(100)
        headers = {"X-SMG-Routing-Key": f"s{i}", "X-Session-ID": f"s{i}"}
        await asyncio.sleep(rng.uniform(0, 2.0) * SCALE)
        for _ in range(turns):
            n = max(16, min(decode[1], int(rng.lognormvariate(0, 1.0) * decode[0])))
            # the client sends the cap, as a rollout does; the engine stops after n tokens
            # (the simulator's end of sequence: a prompt ending in "eos=N"); ``exact``: the
            # client knows n and sends it
            prompt = " ".join(context) + f" eos={n}"
            cap = n if exact else decode[1]
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": cap}
            t0 = loop.time()
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status} through {url}")
            latencies.append((loop.time() - t0) / SCALE)
            context = context + words(n + rng.randint(50, 200))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(count)))
    return latencies


QUICK = {
    "dprouter, not DP-aware (manual)",
    "dprouter, least_load",
    "dprouter, least_load, --processes 2",
    "dprouter, cache_aware",
    "dprouter, cache_aware, --processes 2",
    "dprouter, prefix",
    "smg 1.13.0 --dp-aware, manual",
    "smg 1.13.0 --dp-aware, cache_aware",
    "SGLang gateway 0.3.2 --dp-aware, manual",
    "SGLang gateway 0.3.2 --dp-aware, cache_aware",
    "vllm-router DP4, consistent_hash",
    "vllm-router DP4, cache_aware",
}


async def measure(
    runs: Sequence[Run],
    engine: EngineConfig,
    engines: int,
    workload: dict[str, Any],
    quick: bool,
    seeds: int = 1,
) -> tuple[dict[str, dict[str, float]], dict[str, list[float]]]:
    """Each run once per seed, on a fresh cluster: means over seeds (busiest/mean with its
    range), turn latencies pooled; and each row's busiest/mean seed by seed. The paired
    rows run interleaved, seed after seed through each of them, so that a slower stretch of
    a shared machine falls on all of them alike."""
    usable = set(peer_routers.available()) | {"dprouter"}
    chosen = [r for r in runs if r.kind in usable and not (quick and r.name not in QUICK)]
    per_seed: dict[str, list[dict[str, float]]] = {r.name: [] for r in chosen}
    latencies: dict[str, list[float]] = {r.name: [] for r in chosen}
    failed: set[str] = set()

    async def once(run: Run, seed: int) -> None:
        if run.name not in failed:
            got = await _once(run, engine, engines, workload, seed)
            if got is None:
                failed.add(run.name)
                return
            per_seed[run.name].append(got[0])
            latencies[run.name] += got[1]

    for seed in range(1, PAIRED_SEEDS[quick] + 1):
        for run in (r for r in chosen if r.paired):
            await once(run, seed)
    for run in (r for r in chosen if not r.paired):
        for seed in range(1, seeds + 1):
            await once(run, seed)
    found: dict[str, dict[str, float]] = {}
    for run in chosen:
        found[run.name] = (
            {"failed": 1.0}
            if run.name in failed
            else _summary(per_seed[run.name], latencies[run.name])
        )
    balances = {n: [m["rank_max_over_mean"] for m in ms] for n, ms in per_seed.items()}
    return found, balances


def _summary(per_seed: list[dict[str, float]], latencies: list[float]) -> dict[str, float]:
    balance = [m["rank_max_over_mean"] for m in per_seed]
    return {
        **{k: statistics.mean(m[k] for m in per_seed) for k in per_seed[0]},
        "balance_min": min(balance),
        "balance_max": max(balance),
        "balance_sd": statistics.stdev(balance) if len(balance) > 1 else 0.0,
        "seeds": float(len(balance)),
        "latency_p50": statistics.median(latencies),
        "latency_p99": sorted(latencies)[int(0.99 * (len(latencies) - 1))],
        "late": float(sum(1 for x in latencies if x > DEADLINE)),
        "turns": float(len(latencies)),
    }


async def _once(
    run: Run, engine: EngineConfig, engines: int, workload: dict[str, Any], seed: int
) -> tuple[dict[str, float], list[float]] | None:
    """One run on a fresh cluster: its engine-side figures and its turn latencies."""
    async with SimCluster([replace(engine, time_scale=SCALE)] * engines) as cluster:
        proc, url = await start(run, cluster.servers, engine)
        try:
            latencies = await sessions(url, **workload, seed=seed, exact=run.exact)
        except RuntimeError as exc:
            print(f"{run.name}: {exc}")
            return None
        finally:
            await proc.stop()
        ranks = [r for s in cluster.servers for r in s.engine.ranks]
        steppers = [st for s in cluster.servers for st in s.engine.steppers]
        queries = sum(r.stats.prefix_queries for r in ranks)
        busy = [r.stats.busy_time for r in ranks]
        steps = max(sum(st.steps for st in steppers), 1)
        return {
            "step_ms": sum(st.busy_time for st in steppers) / steps * 1e3,
            "rank_max_over_mean": max(busy) / statistics.mean(busy),
            "hit_rate": sum(r.stats.prefix_hits for r in ranks) / max(queries, 1),
        }, latencies


def tokens_per_word(directory: Path) -> float:
    """What one of the sessions' words costs with the tokenizer in ``directory``: a
    byte-level BPE splits ``w123456`` into several tokens (about 4.7 with the
    simulator's own files), where the built-in rule counts one."""
    tokenizer = ModelTokenizer(directory)
    rng = random.Random(0)
    sample = " ".join(f"w{rng.getrandbits(20)}" for _ in range(2000))
    return len(tokenizer.encode(sample, special=False)) / 2000


def run(quick: bool, out: Path) -> Result:
    dp_engine = ROLLOUT_ENGINE
    rollouts, balances = asyncio.run(
        measure(
            ROLLOUT_RUNS,
            dp_engine,
            4 if quick else 8,
            {
                "count": 24 if quick else 112,
                "turns": 2 if quick else 3,
                "system": 1500,
                "decode": (300, 2000) if quick else (600, 4000),
                "shared": 1,
            },
            quick,
            SEEDS[quick],
        )
    )
    with tempfile.TemporaryDirectory(prefix="dprouter-peers-") as files:
        tokenizer = write_tokenizer(Path(files))
        chat_engine = EngineConfig(
            persona="sglang",
            dp_size=4,
            limits=RankLimits(max_running=32),
            tokenizer=str(tokenizer),
            kv_events=CHAT_EVENTS,
        )
        chats, _ = asyncio.run(
            measure(
                PREFIX_RUNS,
                chat_engine,
                2 if quick else 4,
                {
                    "count": 48 if quick else 120,
                    "turns": 3,
                    "system": 1500,
                    "decode": (120, 400),
                    "shared": 8,
                    "per_word": tokens_per_word(tokenizer),
                },
                quick,
                1,
            )
        )
    rows: list[list[Cell]] = []
    for name, m in rollouts.items():
        rows.append(
            [
                name,
                *(
                    [
                        m["step_ms"],
                        _balance(m),
                        m["latency_p50"],
                        m["latency_p99"],
                    ]
                    if "failed" not in m
                    else ["failed"] * 4
                ),
                f"{int(m.get('late', 0))}/{int(m.get('turns', 0))}",
            ]
        )
    prefix_rows: list[list[Cell]] = [
        [
            name,
            *(
                [*_row(m, ("hit_rate", "latency_p50", "latency_p99")), _balance(m)]
                if "failed" not in m
                else ["failed"] * 4
            ),
        ]
        for name, m in chats.items()
    ]
    failed = [n for n, m in {**rollouts, **chats}.items() if "failed" in m]
    usable = set(peer_routers.available()) | {"dprouter"}
    missing = [r.name for r in (*ROLLOUT_RUNS, *PREFIX_RUNS) if r.kind not in usable]
    names = list(rollouts)
    bars(
        out / "peer_routers.png",
        [n.replace(", ", "\n", 1) for n in names],
        {"mean step, ms": [rollouts[n].get("step_ms", 0.0) for n in names]},
        "DP attention rollouts: mean forward step behind each router",
        "ms",
    )
    checks = {**processes(rollouts, balances), **hits(chats), **aims(rollouts)}
    return Result(
        scenario="peers",
        title="4. Peers: the same simulated cluster behind each router",
        method=(
            f"Simulated engines in the bench process at {SCALE} wall s per simulated s, each "
            "router in its own process. Rollouts: SGLang engines x DP4 with DP attention "
            "(step: max over ranks of 5 ms + 0.1 ms per sequence + 0.2 us per KV token; 4 "
            "running per rank), closed-loop sessions with long log-normal decodes, each turn "
            "sent with max_tokens at the cap and ending where the engine stops (a simulated "
            "end of sequence), as rollouts run; "
            "chat: SGLang engines x DP4 tokenising with the simulator's byte-level BPE files "
            "and publishing KV events (dprouter's prefix run subscribes, with the same "
            "tokenizer), 8 shared 1,500-token system prompts, 3 turns. Step: mean "
            "forward step of the engines; busiest/mean: ranks' busy time; latency per turn "
            f"in simulated seconds. Each rollout run {SEEDS[quick]} time(s) "
            f"(the rows compared with and without --processes 2: {PAIRED_SEEDS[quick]}), one "
            "seeded workload each on a fresh cluster: means, busiest/mean with its range, "
            "latencies pooled. The oracle row: each turn's client sends the turn's true length "
            "as max_tokens and dprouter counts it as sent (--output-budget cap), so min_tokens "
            "knows every decode's length at admission. "
            "Peers: "
            + peer_routers.__doc__.split("Command lines, as run:")[1]
            .split("Known limits")[0]
            .strip()
            .replace("\n", " ")
        ),
        tables=[
            Table(
                [
                    "router",
                    "mean step ms",
                    "busiest / mean rank (range)",
                    "turn p50 s",
                    "turn p99 s",
                    "turns > 60 s",
                ],
                rows,
                "rollouts (scenario 2 over HTTP)",
            ),
            Table(
                ["router", "hit rate", "turn p50 s", "turn p99 s", "busiest / mean rank"],
                prefix_rows,
                "multi-turn chat (scenario 3 over HTTP)",
            ),
        ],
        verdict=verdict(missing, failed),
        checks=checks,
        plots=["peer_routers.png"],
        data={"rollouts": rollouts, "chat": chats, "balances": balances},
    )


def _balance(m: dict[str, float]) -> str:
    """Busiest/mean rank, with its range over seeds when there was more than one value."""
    mean, low, high = m["rank_max_over_mean"], m["balance_min"], m["balance_max"]
    return f"{mean:.2f}" if low == high else f"{mean:.2f} ({low:.2f}-{high:.2f})"


def _row(m: dict[str, float], keys: Sequence[str]) -> list[Cell]:
    return [m[k] for k in keys]


def verdict(missing: list[str], failed: list[str]) -> str:
    notes = []
    if missing:
        notes.append(f"not run: {', '.join(missing)} (peers not installable here)")
    if failed:
        notes.append(f"failed: {', '.join(failed)}")
    return (
        "Side by side on one simulated cluster; "
        + ("; ".join(notes) or "every router completed both workloads")
        + "."
    )
