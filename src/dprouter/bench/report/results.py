"""One scenario's findings, and the report the runs build up: table, Markdown, JSON, plots.

``results.json`` holds one entry per scenario, each with the run that produced
it; a run replaces the entries of the scenarios it ran and keeps the others, and
``report.md`` is rendered from all of them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Cell = str | int | float | None


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Cell]]
    title: str = ""

    def text(self) -> str:
        cells = [[_fmt(c) for c in row] for row in self.rows]
        widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(self.columns)]
        out = [self.title] if self.title else []
        out.append("  ".join(h.ljust(w) for h, w in zip(self.columns, widths, strict=True)))
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
        return "\n".join(out)

    def markdown(self) -> list[str]:
        out = [f"*{self.title}*", ""] if self.title else []
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in self.rows]
        return [*out, ""]


@dataclass(frozen=True)
class Run:
    """The run that produced a scenario's result."""

    command: str  # as typed, without --out
    when: str  # "2026-11-30 08:35 UTC"
    quick: bool

    def describe(self) -> str:
        return f"`{self.command}` on {self.when}, {'quick' if self.quick else 'full'}"


@dataclass
class Result:
    scenario: str
    title: str
    method: str  # how it was measured: every figure says so
    tables: list[Table]
    verdict: str  # the headline, one sentence
    checks: dict[str, bool] = field(default_factory=dict)  # what the issue asks, and whether met
    plots: list[str] = field(default_factory=list)  # file names under the output folder
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for the JSON file

    def table(self) -> str:
        return "\n\n".join(t.text() for t in self.tables)

    def markdown(self, run: Run) -> str:
        out = [f"## {self.title}", "", f"*Run:* {run.describe()}.", "", self.verdict, ""]
        out += [f"*How:* {self.method}", ""]
        for t in self.tables:
            out += t.markdown()
        if self.checks:
            out += ["", "Checks:", ""]
            out += [
                f"- {'met' if ok else '**not met**'}: {name}" for name, ok in self.checks.items()
            ]
        out += ["", *(f"![{self.scenario}]({p})" for p in self.plots)]
        return "\n".join(out) + "\n"


def _fmt(c: Cell) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:,.0f}"
    return str(c)


def write_report(results: Sequence[Result], out: Path, command: str, quick: bool) -> Path:
    """Put ``results`` into ``out/results.json`` (each replaces its scenario's entry; the
    other scenarios' stay), then render ``out/report.md`` from every entry; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    run = Run(command, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), quick)
    saved = load(out)
    for r in results:
        saved[r.scenario] = (run, r)
    (out / "results.json").write_text(
        json.dumps(
            {name: {"run": asdict(run), "result": asdict(r)} for name, (run, r) in saved.items()},
            indent=1,
            default=str,
        )
    )
    head = [
        "# dprouter benchmark report",
        "",
        "Each scenario comes from the run named in its row and section: `dprouter bench "
        "SCENARIO` replaces that scenario's section and keeps the others. Ratios, not "
        "absolute times, are what carry over to other machines: every comparison in a "
        "scenario ran side by side in the same run.",
        "",
        "| scenario | headline | run |",
        "|---|---|---|",
    ]
    head += [f"| {r.scenario} | {r.verdict} | {run.describe()} |" for run, r in saved.values()]
    report = out / "report.md"
    report.write_text(
        "\n".join(head) + "\n\n" + "\n".join(r.markdown(run) for run, r in saved.values())
    )
    return report


def load(out: Path) -> dict[str, tuple[Run, Result]]:
    """What ``out/results.json`` holds, by scenario, in report order (none: empty)."""
    path = out / "results.json"
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    if isinstance(raw, list):  # before results were kept by scenario: one run made them all
        run = _run_of(out / "report.md")
        return {r["scenario"]: (run, _result(r)) for r in raw}
    return {name: (Run(**e["run"]), _result(e["result"])) for name, e in raw.items()}


def _result(raw: dict[str, Any]) -> Result:
    return Result(**{**raw, "tables": [Table(**t) for t in raw["tables"]]})


def _run_of(report: Path) -> Run:
    """The run a whole-report ``report.md`` names in its first paragraph."""
    text = report.read_text() if report.exists() else ""
    found = re.search(r"^`([^`]+)` on (.+? UTC)( \(--quick\))?\.", text, re.MULTILINE)
    if found is None:
        return Run("unknown", "an unknown date", quick=False)
    return Run(found[1], found[2], quick=found[3] is not None)
