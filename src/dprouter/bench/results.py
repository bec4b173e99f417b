"""One scenario's findings, and the report every run writes: table, Markdown, JSON, plots."""

from __future__ import annotations

import json
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

    def markdown(self) -> str:
        out = [f"## {self.title}", "", self.verdict, "", f"*How:* {self.method}", ""]
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
    """``report.md`` and ``results.json`` under ``out``; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [
        "# dprouter benchmark report",
        "",
        f"`{command}` on {stamp}{' (--quick)' if quick else ''}. Ratios, not absolute "
        "times, are what carry over to other machines: every comparison ran side by side "
        "in the same run.",
        "",
    ]
    summary = ["| scenario | headline |", "|---|---|"]
    summary += [f"| {r.scenario} | {r.verdict} |" for r in results]
    report = out / "report.md"
    report.write_text("\n".join(head + summary) + "\n\n" + "\n".join(r.markdown() for r in results))
    (out / "results.json").write_text(
        json.dumps([asdict(r) for r in results], indent=1, default=str)
    )
    return report
