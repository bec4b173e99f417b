"""RL rollout steps on DP-attention engines, for scenario 2 (``dp_attention``).

Step time is the RL training step's: a rollout step ends when its last
episode does, so one overloaded rank holds back the whole step -- the "2x step
time" of the miles incident. Several steps (seeds) are averaged because a
step's end hangs on its longest episode.

Costs: a DP-attention rank reads its own batch's KV each step (EP shares the
weights), so a forward step lasts as long as the rank holding the most KV; a
TP4 engine reads its whole batch's KV spread over four GPUs. A large MoE model
leaves little memory for KV: 50,000 tokens per rank.
"""

from __future__ import annotations

import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

from dprouter.bench.harness.sim_router import SimRouter, run_sessions
from dprouter.bench.harness.workloads import RolloutSessions
from dprouter.policies import PolicyOptions
from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits

ENGINES, DP = 8, 4
KV_TOKENS, MAX_RUNNING = 50_000, 32
DEADLINE = 180.0  # an episode's timeout, seconds
DP_ENGINE = EngineConfig(
    persona="sglang",
    dp_size=DP,
    dp_attention=True,
    cost=CostModel(
        step_base=2e-3, decode_per_seq=1e-4, prefill_per_token=4e-5, decode_per_kv_token=2e-7
    ),
    limits=RankLimits(max_running=MAX_RUNNING, kv_tokens=KV_TOKENS),
    mixed_chunk=True,  # as measured (report of 2026-12-01); SGLang's default is unmixed
)
TP_ENGINE = EngineConfig(
    persona="sglang",
    dp_size=1,
    cost=CostModel(
        step_base=2e-3, decode_per_seq=2.5e-5, prefill_per_token=1e-5, decode_per_kv_token=5e-8
    ),
    limits=RankLimits(max_running=MAX_RUNNING * DP, kv_tokens=KV_TOKENS * DP),
    mixed_chunk=True,
)


class Run(NamedTuple):
    name: str
    policy: str
    dp_aware: bool
    engine: EngineConfig
    oracle: bool = False  # the router knows each decode's true length at admission
    scrape: float = 0.0  # seconds between engine load reports; 0: the router's counts only
    session_bound: float = 1.5  # manual's: 0, a key never leaves its target for load


ORACLE = "oracle: min_tokens knowing each decode's length"
RUNS: tuple[Run, ...] = (
    # the reference and the peers' setup: keys stick whatever the load
    Run("TP-only reference (8 x TP4), manual", "manual", True, TP_ENGINE, session_bound=0),
    Run("not DP-aware: manual, engine round_robin", "manual", False, DP_ENGINE, session_bound=0),
    Run("DP-aware: manual", "manual", True, DP_ENGINE),
    Run("DP-aware: min_tokens", "min_tokens", True, DP_ENGINE),
    Run("DP-aware: min_tokens, engine reports", "min_tokens", True, DP_ENGINE, scrape=0.25),
    Run("DP-aware: least_load", "least_load", True, DP_ENGINE),
    Run(ORACLE, "min_tokens", True, DP_ENGINE, oracle=True),
)
SESSIONS, TURNS = 160, 4


def steps(quick: bool) -> int:
    return 2 if quick else 6


def one(run: Run, seed: int) -> dict[str, float]:
    """One RL rollout step (the workload seeded by ``seed``) under one routing."""
    configs = [run.engine] * ENGINES
    sessions = RolloutSessions(
        sessions=SESSIONS,
        turns=TURNS,
        system=3000,
        decode_median=1500,
        decode_sigma=1.0,
        decode_cap=12000,
        seed=seed,
    )
    options = PolicyOptions(assignment="min_load", session_bound=run.session_bound)
    router = SimRouter(configs, run.policy, run.dp_aware, options, run.oracle, run.scrape)
    report, sim = run_sessions(configs, router, sessions)
    steppers = [s for e in sim.cluster.engines for s in e.steppers]
    by_engine: dict[int, list[float]] = {}
    for r in report.ranks:
        by_engine.setdefault(r.engine, []).append(r.mean_load)
    lengths = [end - start for start, end in sessions.episodes.values()]
    return {
        "rl_step_s": report.makespan,
        "forward_ms": sum(s.busy_time for s in steppers)
        / max(sum(s.steps for s in steppers), 1)
        * 1e3,
        "rank_max_over_mean": statistics.mean(
            max(v) / statistics.mean(v) for v in by_engine.values() if statistics.mean(v) > 0
        ),
        "max_outstanding": max(r.max_load for r in report.ranks),
        "max_waiting": max(r.max_waiting for r in report.ranks),
        "ttft_p50": report.ttft.p50,
        "ttft_p99": report.ttft.p99,
        "tpot_p50": report.tpot.p50,
        "late": sum(1 for x in lengths if x > DEADLINE),
        "episodes": len(lengths),
    }


def measure(quick: bool) -> dict[str, list[dict[str, float]]]:
    """Every routing over the same steps, two processes at a time (the simulator is CPU)."""
    jobs = [(run, seed) for run in RUNS for seed in range(steps(quick))]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(one, *zip(*jobs, strict=True)))
    found: dict[str, list[dict[str, float]]] = {run.name: [] for run in RUNS}
    for (run, _), m in zip(jobs, done, strict=True):
        found[run.name].append(m)
    return found


def summarise(per_step: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Ratios to the TP-only reference step by step, then averaged over the steps."""
    reference, best = per_step[RUNS[0].name], per_step[ORACLE]
    out = {}
    for name, ms in per_step.items():
        ratios = [m["rl_step_s"] / r["rl_step_s"] for m, r in zip(ms, reference, strict=True)]
        forward = [m["forward_ms"] / r["forward_ms"] for m, r in zip(ms, reference, strict=True)]
        to_oracle = [m["rl_step_s"] / o["rl_step_s"] for m, o in zip(ms, best, strict=True)]
        out[name] = {
            "rl_step": statistics.mean(ratios),
            "rl_step_min": min(ratios),
            "rl_step_max": max(ratios),
            "rl_step_oracle": statistics.mean(to_oracle),
            "forward_step": statistics.mean(forward),
            "rank_max_over_mean": statistics.mean(m["rank_max_over_mean"] for m in ms),
            "max_outstanding": max(m["max_outstanding"] for m in ms),
            "max_waiting": max(m["max_waiting"] for m in ms),
            "ttft_p50": statistics.mean(m["ttft_p50"] for m in ms),
            "ttft_p99": statistics.mean(m["ttft_p99"] for m in ms),
            "tpot_p50": statistics.mean(m["tpot_p50"] for m in ms),
            "late": sum(m["late"] for m in ms),
            "episodes": sum(m["episodes"] for m in ms),
        }
    return out
