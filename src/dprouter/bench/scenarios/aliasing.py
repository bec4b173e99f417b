"""Scenario 1, aliasing: every (instance, rank) slot used, or half the GPUs idle?

The old scheme (the MoRIIO toy proxy before its fix) picked the instance by
``n % N`` and the rank by an unrelated ``n % dp``; it lives only here, as the
baseline. dprouter's ``round_robin`` runs as the router runs it: the real
policy over the real registry's flat slot space.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from dprouter.bench.report.plots import bars
from dprouter.bench.report.results import Result, Table
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.policies import RequestInfo, make_policy

# one role of each RFC #46107 shape: (instances, dp_size); TP8 is one rank per instance
SHAPES: dict[str, tuple[int, int]] = {
    "1 x TP8": (1, 1),
    "2 x TP8": (2, 1),
    "4 x TP8": (4, 1),
    "1 x DP8EP": (1, 8),
    "2 x DP8EP": (2, 8),
    "3 x DP8EP": (3, 8),
}
WINDOWS = 4  # whole cycles of the slot space per shape


def old_scheme(n: int, instances: int, dp: int) -> tuple[int, int]:
    return n % instances, n % dp


def dprouter_slots(instances: int, dp: int, requests: int) -> list[tuple[int, int]]:
    registry = Registry()
    for i in range(instances):
        w = registry.add(Worker(id=f"i{i}", url=f"http://10.0.0.{i + 1}:8000", dialect="vllm"))
        w.ranks = dp
        registry.mark_ready(w)
    pool = registry.snapshot.pool()
    rr = make_policy("round_robin")
    picks = [rr.select(pool, RequestInfo()) for _ in range(requests)]
    return [(int(t.worker.id[1:]), t.rank or 0) for t in picks]


def coverage(slots: list[tuple[int, int]], total: int) -> tuple[float, float]:
    """(share of slots used in the worst window, share of slots never used)."""
    windows = [set(slots[i : i + total]) for i in range(0, len(slots), total)]
    worst = min(len(w) for w in windows) / total
    return worst, 1 - len(set(slots)) / total


def run(quick: bool, out: Path) -> Result:
    rows: list[list[str | int | float | None]] = []
    checks: dict[str, bool] = {}
    data: dict[str, object] = {}
    for name, (instances, dp) in SHAPES.items():
        total = instances * dp
        n = WINDOWS * total
        old = [old_scheme(k, instances, dp) for k in range(n)]
        new = dprouter_slots(instances, dp, n)
        (old_used, old_idle), (new_used, new_idle) = coverage(old, total), coverage(new, total)
        spread = Counter(new)
        rows.append(
            [
                name,
                total,
                f"{old_used:.0%}",
                f"{old_idle:.0%}",
                f"{new_used:.0%}",
                f"{new_idle:.0%}",
                f"{min(spread.values())}-{max(spread.values())}",
            ]
        )
        data[name] = {"old": dict(Counter(map(str, old))), "dprouter": dict(Counter(map(str, new)))}
        checks[f"{name}: dprouter covers every slot evenly"] = (
            new_used == 1.0 and min(spread.values()) == max(spread.values()) == WINDOWS
        )
        if name == "2 x DP8EP":
            checks["2 x DP8EP: the old scheme leaves 50% of the slots idle"] = old_idle == 0.5
            labels = [f"i{i}r{r}" for r in range(dp) for i in range(instances)]
            old_counts = Counter(old)
            bars(
                out / "aliasing.png",
                labels,
                {
                    "old scheme (n % N, n % dp)": [
                        old_counts[(i, r)] for r in range(dp) for i in range(instances)
                    ],
                    "dprouter round_robin": [
                        spread[(i, r)] for r in range(dp) for i in range(instances)
                    ],
                },
                f"2 prefill instances x DP8: requests per slot over {n} requests",
                "requests",
            )
    return Result(
        scenario="aliasing",
        title="1. Aliasing: every (instance, rank) slot used?",
        method=(
            f"{WINDOWS} whole cycles of each shape's slot space; the old scheme computed "
            "as the toy proxy did, dprouter's round_robin run as the router runs it (the "
            "real policy over the real registry). Used: slots reached in the worst cycle."
        ),
        tables=[
            Table(
                [
                    "shape (one role)",
                    "slots",
                    "old: used/cycle",
                    "old: never used",
                    "dprouter: used/cycle",
                    "dprouter: never used",
                    "dprouter: per slot",
                ],
                rows,
            )
        ],
        verdict=(
            "The old scheme leaves 50% of the ranks idle at 2 x DP8 (every second rank of "
            "each instance); dprouter reaches every slot of every shape evenly."
        ),
        checks=checks,
        plots=["aliasing.png"],
        data=data,
    )
