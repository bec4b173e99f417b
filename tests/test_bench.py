"""The benchmark's scenarios produce what the report claims (small and offline here)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dprouter.bench import aliasing, burst, dp_attention, prefix
from dprouter.bench.results import Result, Table, write_report


def test_aliasing_reproduces_half_idle_ranks_and_dprouter_covers_all(tmp_path: Path) -> None:
    result = aliasing.run(False, tmp_path)
    assert result.checks and all(result.checks.values()), result.checks
    rows = {row[0]: row for row in result.tables[0].rows}
    assert rows["2 x DP8EP"][3] == "50%" and rows["2 x DP8EP"][5] == "0%"
    assert (tmp_path / "aliasing.png").stat().st_size > 10_000


def test_report_files(tmp_path: Path) -> None:
    result = Result(
        "demo",
        "A title",
        "How it was measured.",
        [Table(["name", "value"], [["a", 1.5], ["b", None]])],
        "The headline.",
        checks={"something held": True, "something else": False},
    )
    report = write_report([result], tmp_path, "dprouter bench demo", quick=True)
    text = report.read_text()
    assert "| demo | The headline. |" in text
    assert "| a | 1.5 |" in text and "| b | - |" in text
    assert "- met: something held" in text and "- **not met**: something else" in text
    (saved,) = json.loads((tmp_path / "results.json").read_text())
    assert saved["tables"][0]["rows"] == [["a", 1.5], ["b", None]]


@pytest.mark.slow
def test_dp_attention_pathology_shows_without_dp_aware_routing(tmp_path: Path) -> None:
    result = dp_attention.run(True, tmp_path)
    blind = result.data["not DP-aware: manual, engine round_robin"]
    aware = result.data["DP-aware: min_tokens"]
    assert blind["rl_step"] >= 1.5 and blind["max_waiting"] >= 2  # the RL step pays for one rank
    assert aware["rl_step"] - 1 <= (blind["rl_step"] - 1) / 2
    assert aware["max_waiting"] <= 1 and aware["late"] * 2 <= blind["late"]


@pytest.mark.slow
def test_affinity_policies_keep_more_prefix_hits(tmp_path: Path) -> None:
    shared = prefix.run(True, tmp_path).data["shared"]
    assert shared["cache_aware"]["hit_rate"] > shared["round_robin"]["hit_rate"] + 0.1
    assert shared["consistent_hash"]["hit_rate"] > shared["round_robin"]["hit_rate"]


@pytest.mark.slow
def test_a_plain_burst_through_dprouter_loses_nothing() -> None:
    found = asyncio.run(burst.plain("dprouter", 512))
    assert found["ok"] == 512 and found["lost"] == found["resets"] == 0
