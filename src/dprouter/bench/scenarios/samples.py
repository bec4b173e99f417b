"""Scenario: GRPO groups sent as one request of n = 8 each, their samples split or not.

The GRPO shape of ``groups`` (2 SGLang engines x DP4 with DP attention and KV events,
16 groups of 8 samples of one ~4,500-token prompt, a group each simulated second), but
each group one request with ``n = 8``, as RL frameworks that sample through the engine
send it. An engine runs a request's samples on one rank; dprouter's ``--samples split``
routes them as separate samples would go and merges the answers. Rows:
split and together under ``prefix`` and ``least_load``, and smg 1.13 (which sends a
request to one rank) where it runs. Over real HTTP, engines in this process as in
``groups-peers``; every figure is the engines' own, in simulated time.

All 8 samples of a request run to the same length here (the simulator's ``eos=N`` is
the prompt's): each group's length is log-normal (median 256, cap 1,024).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.groups_peers import SCALE, Log, routed, with_session, words
from dprouter.bench.scenarios.peers import CHAT_EVENTS, Run, tokens_per_word
from dprouter.sim.model.config import CostModel, EngineConfig
from dprouter.sim.model.vocab import write_tokenizer

ENGINES, DP, N = 2, 4, 8
RUNS = (
    Run(
        "dprouter, prefix (events), split",
        "dprouter",
        ("--policy", "prefix", "--samples", "split"),
        events=True,
    ),
    Run(
        "dprouter, prefix (events), together",
        "dprouter",
        ("--policy", "prefix", "--samples", "together"),
        events=True,
    ),
    Run(
        "dprouter, least_load, split", "dprouter", ("--policy", "least_load", "--samples", "split")
    ),
    Run(
        "dprouter, least_load, together",
        "dprouter",
        ("--policy", "least_load", "--samples", "together"),
    ),
    Run("smg 1.13.0 --dp-aware, cache_aware", "smg", ("cache_aware", "dp-aware")),
)
# each decoding sequence reads its KV every step: ~128 KiB a token of an 8B model in
# bf16 at ~3.3 TB/s (the default cost model leaves it out, so a rank's long contexts
# cost its lock-step engine nothing)
KV_READS = CostModel(decode_per_kv_token=3.9e-8)
VARIANTS: dict[str, tuple[CostModel, tuple[Run, ...]]] = {
    "default costs": (CostModel(), RUNS),
    "KV reads": (KV_READS, (RUNS[0], RUNS[1], RUNS[4])),
}
Metrics = dict[str, float]


async def groups_as_requests(
    log: Log, url: str, per_word: float, groups: int, seed: int
) -> list[list[float]]:
    """One request of n = 8 a simulated second; each engine's clock at each send."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    sends: list[list[float]] = []

    async def one(session: aiohttp.ClientSession, prompt: str) -> None:
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1024, "n": N}
        async with session.post(url + "/v1/completions", json=body) as r:
            answer = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status} through {url}: {answer[:200]!r}")

    async def send(session: aiohttp.ClientSession) -> None:
        t0, tasks = loop.time(), []
        for g in range(groups):
            await asyncio.sleep(max(0.0, t0 + g * SCALE - loop.time()))
            length = max(32, min(1024, int(rng.lognormvariate(0, 0.6) * 256)))
            prompt = words(rng, 4500 + rng.randint(-300, 300), per_word) + f" eos={length}"
            sends.append([s.runner.now() for s in log.servers])
            tasks.append(asyncio.create_task(one(session, prompt)))
        await asyncio.gather(*tasks)

    await with_session(send)
    return sends


async def once(run: Run, config: EngineConfig, per_word: float, groups: int) -> Metrics:
    engine = replace(config, dp_size=DP, time_scale=SCALE)
    async with routed(run, engine, ENGINES) as (log, url):
        sends = await groups_as_requests(log, url, per_word, groups, seed=1)
        return _metrics(log, sends)


def _metrics(log: Log, sends: list[list[float]]) -> Metrics:
    """Per group (its prompt), from the samples the engines ran: SGLang's prompt-only
    copies (``-prompt``) are not samples, though their prefill counts in the hit rate."""
    group_of: dict[int, int] = {}
    ends: dict[int, float] = defaultdict(float)
    ranks: dict[int, set[int]] = defaultdict(set)
    per_rank: dict[int, int] = defaultdict(int)
    ttft: list[float] = []
    for i, req in log.taken:
        if req.rid.endswith("-prompt"):
            continue
        if req.first_token_at is None or req.finished_at is None:
            continue  # aborted
        g = group_of.setdefault(hash(tuple(req.prompt_ids)), len(group_of))
        sent = sends[g][i]
        target = i * DP + (req.rank or 0)
        ranks[g].add(target)
        per_rank[target] += 1
        ends[g] = max(ends[g], req.finished_at - sent)
        ttft.append(req.first_token_at - sent)
    if len(group_of) != len(sends) or sum(per_rank.values()) != N * len(sends):
        raise RuntimeError("a sample the client asked for never ran")
    all_ranks = [r for s in log.servers for r in s.engine.ranks]
    counts = [per_rank[t] for t in range(len(all_ranks))]
    steps = [r.stats.decode_steps for r in all_ranks]
    latency = sorted(ends.values())
    return {
        "latency_p50": latency[len(latency) // 2],
        "latency_p90": latency[int(0.9 * (len(latency) - 1))],
        "ttft_mean": statistics.mean(ttft),
        "ranks_per_group": statistics.mean(len(r) for r in ranks.values()),
        "imbalance": max(counts) / statistics.mean(counts),
        "steps_imbalance": max(steps) / statistics.mean(steps),
        "hit_rate": sum(r.stats.prefix_hits for r in all_ranks)
        / max(sum(r.stats.prefix_queries for r in all_ranks), 1),
    }


async def measure(quick: bool) -> tuple[dict[str, dict[str, Metrics]], list[str], list[str]]:
    missing = peer_routers.ensure()
    smg = missing is None or peer_routers.binary("smg").exists()
    skipped = [f"{r.name} ({missing})" for r in RUNS if r.kind != "dprouter" and not smg]
    data: dict[str, dict[str, Metrics]] = {variant: {} for variant in VARIANTS}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dprouter-samples-") as files:
        tokenizer = write_tokenizer(Path(files))
        per_word = tokens_per_word(tokenizer)
        for variant, (cost, runs) in VARIANTS.items():
            config = EngineConfig(
                persona="sglang",
                dp_attention=True,
                tokenizer=str(tokenizer),
                kv_events=CHAT_EVENTS,
                cost=cost,
            )
            for run in runs:
                if run.kind != "dprouter" and not smg:
                    continue
                try:
                    data[variant][run.name] = await once(run, config, per_word, 8 if quick else 16)
                except (RuntimeError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    print(f"{variant}, {run.name}: {exc}")
                    failed.append(f"{variant}: {run.name}")
    return data, skipped, failed


def checks(data: dict[str, dict[str, Metrics]]) -> dict[str, bool]:
    """Split against together under prefix, per cost model: a group reaches more ranks,
    the engines' decode steps are evener, and the p90 group latency stays within 10 %
    (two runs of a row differed by 5 %)."""
    out: dict[str, bool] = {}
    for variant, found in data.items():
        split = found.get("dprouter, prefix (events), split")
        together = found.get("dprouter, prefix (events), together")
        if split is None or together is None:
            continue
        out[f"{variant}: split groups reach more ranks"] = (
            split["ranks_per_group"] > together["ranks_per_group"]
        )
        out[f"{variant}: split evens the busiest rank's decode steps"] = (
            split["steps_imbalance"] < together["steps_imbalance"]
        )
        out[f"{variant}: split p90 group latency within 10 % of together's"] = (
            split["latency_p90"] <= 1.1 * together["latency_p90"]
        )
    return out


def _rows(found: dict[str, Metrics]) -> list[list[Cell]]:
    return [
        [
            name,
            f"{m['latency_p50']:.2f} / {m['latency_p90']:.2f}",
            m["ttft_mean"] * 1e3,
            m["ranks_per_group"],
            m["imbalance"],
            m["steps_imbalance"],
            f"{m['hit_rate']:.1%}",
        ]
        for name, m in found.items()
    ]


def _versus(found: dict[str, Metrics]) -> str:
    split = found.get("dprouter, prefix (events), split")
    together = found.get("dprouter, prefix (events), together")
    if split is None or together is None:
        return "not run"
    return (
        f"prefix split p90 {split['latency_p90']:.2f} s against together "
        f"{together['latency_p90']:.2f} s, busiest/mean decode steps "
        f"{split['steps_imbalance']:.2f} against {together['steps_imbalance']:.2f}"
    )


def run(quick: bool, out: Path) -> Result:
    data, skipped, failed = asyncio.run(measure(quick))
    header = [
        "router",
        "group latency p50 / p90 s",
        "TTFT mean ms",
        "ranks per group",
        "busiest/mean samples",
        "busiest/mean decode steps",
        "hit rate",
    ]
    notes = [f"not run: {', '.join(skipped)}"] if skipped else []
    notes += [f"failed: {', '.join(failed)}"] if failed else []
    verdict = "; ".join(f"{variant}: {_versus(found)}" for variant, found in data.items())
    return Result(
        scenario="samples",
        title="GRPO groups as one request of n = 8: samples split over ranks, or together",
        method=(
            f"Over real HTTP, each router in its own process, the engines in the bench "
            f"process at {SCALE} wall s per simulated s: {ENGINES} simulated SGLang engines x "
            f"DP{DP} with DP attention (lock-step, gathered MLP) publishing KV events; "
            f"{8 if quick else 16} groups, one request each a simulated second, n = {N} "
            "samples of one ~4,500-token prompt, every sample of a group ending at the "
            "group's log-normal length (median 256, cap 1,024 sent as max_tokens). Two cost "
            "models: the default (a decode step's cost does not grow with the KV it reads), "
            "and KV reads (each decoding sequence reads its KV every step, 3.9e-8 s a token: "
            "an 8B model in bf16 on an H100). A group's latency runs from the send to its "
            "last sample's last token; TTFT per sample; ranks per group: distinct ranks its "
            "samples ran on; busiest/mean: samples per rank, and decode steps per rank (under "
            "DP attention the busiest rank's steps are the engine's); hit rate from the "
            "engines' prefix-cache counters (SGLang's prompt-only copy of an n request "
            "included). One run per row: two runs of the KV-reads rows differed by 5 % in "
            "p90 group latency, which way split and together compare."
        ),
        tables=[
            Table(header, _rows(found), f"GRPO groups, one request of n = {N} each, {variant}")
            for variant, found in data.items()
        ],
        verdict=verdict + (f" ({'; '.join(notes)})" if notes else "") + ".",
        checks=checks(data),
        data={**data, "not_run": skipped, "failed": failed},
    )
