"""``dprouter bench SCENARIO``: run scenarios side by side, print tables, update the report.

A scenario's module is imported when it runs: ``dprouter --help`` and this
module need none of the ``bench`` extra (matplotlib, tqdm).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dprouter.bench.report.results import Result, write_report

# scenario -> its module under dprouter.bench.scenarios: run(quick, out, **options) -> Result
SCENARIOS = {
    "aliasing": "aliasing",
    "dp-attention": "dp_attention",
    "prefix": "prefix",
    "groups": "groups",
    "groups-peers": "groups_peers",
    "samples": "samples",
    "peers": "peers",
    "overhead": "overhead",
    "burst": "burst",
    "scale": "scale",
    "crosscheck": "crosscheck",
    "replicas": "replicas",
    "weight-updates": "weight_updates",
    "overload": "overload",
}
LONG = {"soak": "soak"}  # minutes by design: not part of "all"
# studies of what lies beneath dprouter (its HTTP stacks, the offline simulator's own
# speed), not of dprouter: not part of "all" either
STUDIES = {"stacks": "stacks", "sim-scale": "sim_scale"}
# on a real engine (bash e2e/sglang/prepare.sh), one at a time on the machine: not in "all"
REAL = {"makespan": "makespan"}
MODULES = {**SCENARIOS, **LONG, **STUDIES, **REAL}
PD_MODES = ("sglang", "vllm-nixl", "vllm-mooncake")


def scenario(name: str) -> Callable[..., Result]:
    run: Callable[..., Result] = importlib.import_module(
        f"dprouter.bench.scenarios.{MODULES[name]}"
    ).run
    return run


@click.command()
@click.argument("scenarios", nargs=-1, type=click.Choice([*MODULES, "all"]), required=True)
@click.option("--quick", is_flag=True, help="Smaller runs: the whole set in a few minutes.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench/results"),
    show_default=True,
    help="Where the report, the JSON file and the plots go; the scenarios run replace "
    "their own entries there and leave the others.",
)
@click.option(
    "--requests",
    type=click.IntRange(1),
    multiple=True,
    help="burst: the burst sizes [1024 with --quick, else 4096 and 10000]; "
    "sim-scale: the request counts [10000 with --quick, else 100000]. Repeatable.",
)
@click.option(
    "--pd",
    type=click.Choice(PD_MODES),
    multiple=True,
    help="burst: the P/D flows burst through dprouter [sglang]. Repeatable.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=None,
    help="makespan: rounds, each system running the same burst [1 with --quick, else 4].",
)
@click.option(
    "--variant",
    type=click.Choice(["rollout", "grpo", "both"]),
    default=None,
    help="makespan: the bursts [rollout with --quick, else both].",
)
def bench(
    scenarios: tuple[str, ...],
    quick: bool,
    out: Path,
    requests: tuple[int, ...],
    pd: tuple[str, ...],
    rounds: int | None,
    variant: str | None,
) -> None:
    """Measure dprouter: the seed scenarios, the policies, and the peers, side by side."""
    try:
        from tqdm import tqdm

        import dprouter.bench.report.plots  # noqa: F401 -- fails here, not mid-run, without matplotlib
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"dprouter bench needs the bench extra: pip install 'dprouter[bench]' ({exc})"
        ) from None
    names = list(SCENARIOS) if "all" in scenarios else list(dict.fromkeys(scenarios))
    options: dict[str, dict[str, Any]] = {name: {} for name in names}
    if requests:
        takers = [n for n in names if n in ("burst", "sim-scale")]
        if not takers:
            raise click.UsageError("--requests applies to burst and sim-scale only")
        for name in takers:
            options[name]["sizes"] = requests
    if pd:
        if "burst" not in names:
            raise click.UsageError("--pd applies to burst only")
        options["burst"]["pd_modes"] = pd
    for flag, value, key in (("--rounds", rounds, "rounds"), ("--variant", variant, "variant")):
        if value is not None:
            if "makespan" not in names:
                raise click.UsageError(f"{flag} applies to makespan only")
            options["makespan"][key] = value
    given = [*(f"--requests {n}" for n in requests), *(f"--pd {m}" for m in pd)]
    given += [
        *([f"--rounds {rounds}"] if rounds else []),
        *([f"--variant {variant}"] if variant else []),
    ]
    command = " ".join(["dprouter bench", *scenarios, *given, *(["--quick"] if quick else [])])
    with tqdm(names, unit="scenario", file=sys.stderr, dynamic_ncols=True) as bar:
        for name in bar:
            bar.set_description(name)
            t0 = time.perf_counter()
            result = scenario(name)(quick, out, **options[name])
            result.data["wall_seconds"] = time.perf_counter() - t0
            # each scenario saved as it ends: one that fails later does not lose it
            write_report([result], out, command, quick)
            tqdm.write(f"\n{result.title}\n{result.table()}\n{result.verdict}\n", file=sys.stdout)
            for check, ok in result.checks.items():
                tqdm.write(f"  [{'met' if ok else 'NOT MET'}] {check}", file=sys.stdout)
    click.echo(f"\nreport: {out / 'report.md'}")
