"""``dprouter bench SCENARIO``: run scenarios side by side, print tables, write the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
from tqdm import tqdm

from dprouter.bench import (
    aliasing,
    burst,
    crosscheck,
    dp_attention,
    overhead,
    peers_quality,
    prefix,
    scale,
    soak,
    stacks,
)
from dprouter.bench.results import Result, write_report

Scenario = Callable[[bool, Path], Result]
SCENARIOS: dict[str, Scenario] = {
    "aliasing": aliasing.run,
    "dp-attention": dp_attention.run,
    "prefix": prefix.run,
    "peers": peers_quality.run,
    "overhead": overhead.run,
    "burst": burst.run,
    "scale": scale.run,
    "crosscheck": crosscheck.run,
}
LONG: dict[str, Scenario] = {"soak": soak.run}  # minutes by design: not part of "all"
# a study of the HTTP stacks beneath dprouter, not of dprouter: not part of "all" either
STUDIES: dict[str, Scenario] = {"stacks": stacks.run}


@click.command()
@click.argument(
    "scenarios", nargs=-1, type=click.Choice([*SCENARIOS, *LONG, *STUDIES, "all"]), required=True
)
@click.option("--quick", is_flag=True, help="Smaller runs: the whole set in a few minutes.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench/results"),
    show_default=True,
    help="Where the report, the JSON file and the plots go.",
)
def bench(scenarios: tuple[str, ...], quick: bool, out: Path) -> None:
    """Measure dprouter: the seed scenarios, the policies, and the peers, side by side."""
    names = list(SCENARIOS) if "all" in scenarios else list(dict.fromkeys(scenarios))
    results: list[Result] = []
    with tqdm(names, unit="scenario", file=sys.stderr, dynamic_ncols=True) as bar:
        for name in bar:
            bar.set_description(name)
            t0 = time.perf_counter()
            result = {**SCENARIOS, **LONG, **STUDIES}[name](quick, out)
            result.data["wall_seconds"] = time.perf_counter() - t0
            results.append(result)
            tqdm.write(f"\n{result.title}\n{result.table()}\n{result.verdict}\n", file=sys.stdout)
            for check, ok in result.checks.items():
                tqdm.write(f"  [{'met' if ok else 'NOT MET'}] {check}", file=sys.stdout)
    command = "dprouter bench " + " ".join(scenarios) + (" --quick" if quick else "")
    report = write_report(results, out, command, quick)
    click.echo(f"\nreport: {report}")
