"""The peers scenario's checks: the issues' aims, from the rollouts' figures by row name."""

from __future__ import annotations


def processes(rollouts: dict[str, dict[str, float]]) -> dict[str, bool]:
    """Each policy's busiest/mean rank with --processes 2 within 5 % of one process's: the
    ratio of the means of seeds, named with its standard error."""
    checks = {}
    for one in ("dprouter, min_tokens", "dprouter, least_load"):
        two = rollouts.get(f"{one}, --processes 2", {})
        if "rank_max_over_mean" in two and "rank_max_over_mean" in rollouts.get(one, {}):
            ratio = two["rank_max_over_mean"] / rollouts[one]["rank_max_over_mean"]
            seeds = int(two["seeds"])
            checks[
                f"{one}: busiest/mean with --processes 2 within 5 % of 1 process "
                f"(x{ratio:.3f} {spread(two, rollouts[one])}, means of {seeds} seeds)"
            ] = abs(ratio - 1) <= 0.05
    return checks


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


def spread(two: dict[str, float], one: dict[str, float]) -> str:
    """How far the ratio of two means of seeds could move by chance: +- one standard error."""
    n = two["seeds"]
    if n < 2:
        return "(one run)"
    a, b = one["rank_max_over_mean"], two["rank_max_over_mean"]
    error = (b / a) * ((one["balance_sd"] / a) ** 2 + (two["balance_sd"] / b) ** 2) ** 0.5
    return f"+-{error / n**0.5:.3f}"
