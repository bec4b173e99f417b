"""The peers scenario's checks: the issues' aims, from the rollouts' figures by row name."""

from __future__ import annotations

import statistics


def processes(
    rollouts: dict[str, dict[str, float]], balances: dict[str, list[float]]
) -> dict[str, bool]:
    """Each policy's busiest/mean rank with --processes 2 at most 5 % above one process's
    (the aim: sharing the view of load across processes costs no balance; below is no
    fault, and one seed past 2.5 in the one-process row has put a mean 8 % above): the
    ratio of the means of seeds, named with its standard error (the seeds paired: both
    rows ran each seed's workload, one after the other) and the ratio of mean steps."""
    checks = {}
    for one in ("dprouter, min_tokens", "dprouter, least_load"):
        two = rollouts.get(f"{one}, --processes 2", {})
        if "rank_max_over_mean" in two and "rank_max_over_mean" in rollouts.get(one, {}):
            ratio = two["rank_max_over_mean"] / rollouts[one]["rank_max_over_mean"]
            step = two["step_ms"] / rollouts[one]["step_ms"]
            seeds = int(two["seeds"])
            error = spread(balances[one], balances[f"{one}, --processes 2"])
            checks[
                f"{one}: busiest/mean with --processes 2 at most 5 % above 1 process's "
                f"(x{ratio:.3f} {error}, means of {seeds} seeds; mean step x{step:.3f})"
            ] = ratio <= 1.05
    return checks


def hits(chats: dict[str, dict[str, float]]) -> dict[str, bool]:
    """``cache_aware``'s hit rate with --processes 2 within 0.02 of one process's: each
    process learns where the others sent each prompt, so they route as one."""
    one, two = (
        chats.get("dprouter, cache_aware", {}),
        chats.get("dprouter, cache_aware, --processes 2", {}),
    )
    if "hit_rate" not in one or "hit_rate" not in two:
        return {}
    a, b = one["hit_rate"], two["hit_rate"]
    return {
        f"dprouter, cache_aware: hit rate with --processes 2 within 0.02 of 1 process "
        f"({b:.3f} against {a:.3f})": abs(b - a) <= 0.02
    }


ORACLE = "dprouter, min_tokens, told each turn's length (an oracle)"


def aims(rollouts: dict[str, dict[str, float]]) -> dict[str, bool]:
    """The aims for balance by true load over HTTP, beside what the oracle row reached:
    how far routing at admission can go on this workload at all."""
    best, manual = (
        rollouts.get("dprouter, min_tokens", {}),
        rollouts.get("dprouter, manual + min_load", {}),
    )
    oracle = rollouts.get(ORACLE, {})
    gateways = [  # a failed row has no step
        m["step_ms"]
        for n, m in rollouts.items()
        if n.startswith(("smg", "SGLang")) and "step_ms" in m
    ]
    if "rank_max_over_mean" not in best or "rank_max_over_mean" not in manual:
        return {}
    told = (
        f"; told each turn's length: {oracle['rank_max_over_mean']:.2f}, "
        f"step {oracle['step_ms']:.2f} ms"
        if "rank_max_over_mean" in oracle
        else ""
    )
    found = {
        f"dprouter, min_tokens: busiest/mean <= 1.3 ({best['rank_max_over_mean']:.2f}{told})": (
            best["rank_max_over_mean"] <= 1.3
        ),
        f"dprouter, manual + min_load: busiest/mean <= 1.4 ({manual['rank_max_over_mean']:.2f})": (
            manual["rank_max_over_mean"] <= 1.4
        ),
    }
    if gateways:
        ratio = best["step_ms"] / min(gateways)
        found[
            f"dprouter, min_tokens: mean step <= 0.9x the SGLang gateway's best (x{ratio:.3f})"
        ] = ratio <= 0.9
    return found


def spread(one: list[float], two: list[float]) -> str:
    """How far the ratio of two means over the same seeds could move by chance: +- one
    standard error of the ratio estimate, from the paired differences ``two - ratio x one``."""
    n = min(len(one), len(two))
    if n < 2:
        return "(one run)"
    one, two = one[:n], two[:n]
    mean = statistics.mean(one)
    ratio = statistics.mean(two) / mean
    error = statistics.stdev(b - ratio * a for a, b in zip(one, two, strict=True))
    return f"+-{error / mean / n**0.5:.3f}"
