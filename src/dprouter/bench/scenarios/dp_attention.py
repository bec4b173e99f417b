"""Scenario 2, DP attention: the miles incident, scaled down.

8 SGLang-persona engines x DP4 with DP attention run RL rollout steps: a
batch of agentic sessions (long, heavy-tailed decodes, sticky routing keys,
no think time) under the session-server setup, ``manual`` with ``min_load``
assignment. Not DP-aware, the router places sessions on engines and each
engine's ``round_robin`` dispatch places every turn on a rank, blind to load;
DP-aware, the router places them on ranks (``manual``, ``min_tokens``,
``least_load``). The same 32 GPUs as 8 TP4 engines are the reference; the
steps themselves are run by ``rl_steps``.
"""

from __future__ import annotations

from pathlib import Path

from dprouter.bench.report.plots import bars
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.rl_steps import (
    DEADLINE,
    KV_TOKENS,
    ORACLE,
    RUNS,
    SESSIONS,
    TURNS,
    measure,
    steps,
    summarise,
)


def run(quick: bool, out: Path) -> Result:
    found = summarise(measure(quick))
    names = [run.name for run in RUNS]
    blind, oracle = found[names[1]], found[ORACLE]
    aware = [found[n] for n in names[2:] if n != ORACLE]
    rows: list[list[Cell]] = [
        [
            name,
            m["rl_step"],
            f"{m['rl_step_min']:.2f}-{m['rl_step_max']:.2f}",
            m["rl_step_oracle"],
            m["forward_step"],
            m["rank_max_over_mean"],
            int(m["max_waiting"]),
            m["ttft_p50"],
            m["ttft_p99"],
            m["tpot_p50"] * 1e3,
            f"{int(m['late'])}/{int(m['episodes'])}",
        ]
        for name, m in found.items()
    ]
    bars(
        out / "dp_attention.png",
        ["TP-only", "not DP-aware", *(n.split(":")[1].strip()[:24] for n in names[2:])],
        {
            "RL step time / TP-only": [found[n]["rl_step"] for n in names],
            "forward step / TP-only": [found[n]["forward_step"] for n in names],
            "busiest / mean rank": [found[n]["rank_max_over_mean"] for n in names],
        },
        "8 engines x DP4 with DP attention, RL rollout steps",
        "ratio",
    )
    load_aware = [found["DP-aware: min_tokens"], found["DP-aware: least_load"]]
    best = min(aware, key=lambda m: m["rl_step"])
    best_name = next(n for n in names if found[n] is best)
    checks = {
        "not DP-aware: a rank queues while its siblings have room": blind["max_waiting"] > 0,
        "not DP-aware: RL step time about 2x the TP-only reference (>= 1.5x)": blind["rl_step"]
        >= 1.5,
        "DP-aware: less RL step time than not DP-aware": all(
            m["rl_step"] < blind["rl_step"] for m in aware
        ),
        "DP-aware, load-aware policies: at least half of the extra step time removed": all(
            m["rl_step"] - 1 <= (blind["rl_step"] - 1) / 2 for m in load_aware
        ),
        "DP-aware, load-aware policies: at most half the late episodes": all(
            m["late"] <= blind["late"] / 2 for m in load_aware
        ),
        "the best dprouter policy: RL step within 1.05x the oracle's": best["rl_step_oracle"]
        <= 1.05,
        "the best dprouter policy: late episodes at most the oracle's + 10 %": best["late"]
        <= oracle["late"] * 1.1,
    }
    n = steps(quick)
    return Result(
        scenario="dp-attention",
        title="2. DP attention: a rank overloaded while its siblings idle (miles, scaled down)",
        method=(
            f"Offline simulator in virtual time; {n} RL rollout steps (seeds), each a batch of "
            f"{SESSIONS} sessions of {TURNS} turns started within 2 s (3,000-token system "
            "prompt, log-normal decodes: median 1,500 tokens, capped at 12,000; 100-600 token "
            "tool results). 8 SGLang engines x DP4 with DP attention, per rank 32 running "
            f"sequences and {KV_TOKENS:,} KV tokens; a forward step lasts the max over ranks of "
            "(2 ms + 0.1 ms per sequence + 0.2 us per KV token), a prompt's MLP share summed "
            "over the ranks (gathered). RL step time: the step's "
            "last episode's end, divided by the TP-only reference's for the same seed (8 TP4 "
            "engines on the same GPUs), mean and range over the steps. Forward step: mean "
            "engine forward step, same ratio. Busiest / mean: time-averaged outstanding per "
            f"rank, within each engine. Late: episodes longer than {DEADLINE:.0f} s (a "
            "rollout's timeout). A request weighs what the router counts: prompt + the "
            "max_tokens the client sends (the cap, 12,000); the oracle weighs it by the "
            "output it really runs to, the best an admission-time router could know. The "
            "reference and the not-DP-aware rows keep every key on its target (the peers' "
            "manual); dprouter's manual moves a key off a rank loaded past 1.5x the mean + 2. "
            "'engine reports': the engines' per-rank running + waiting and tokens reach the "
            "board every 0.25 s, as the monitor scrapes them."
        ),
        tables=[
            Table(
                [
                    "routing",
                    "RL step / TP-only",
                    "range",
                    "RL step / oracle",
                    "forward step / TP-only",
                    "busiest / mean rank",
                    "max queued",
                    "TTFT p50 s",
                    "TTFT p99 s",
                    "TPOT p50 ms",
                    "late episodes",
                ],
                rows,
            )
        ],
        verdict=(
            f"Not DP-aware, an RL step takes {blind['rl_step']:.2f}x the TP-only reference, "
            f"up to {int(blind['max_waiting'])} requests queue on one rank and "
            f"{int(blind['late'])}/{int(blind['episodes'])} episodes run past the timeout; "
            f"DP-aware routing ({best_name}) brings the step to {best['rl_step']:.2f}x "
            f"({best['rl_step_oracle']:.2f}x the oracle's {oracle['rl_step']:.2f}x) and late "
            f"episodes to {int(best['late'])} (the oracle: {int(oracle['late'])})."
        ),
        checks=checks,
        plots=["dp_attention.png"],
        data=found,
    )
