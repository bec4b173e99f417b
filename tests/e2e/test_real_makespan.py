"""The makespan scenario's quick run on a real SGLang engine (attention DP over 2 ranks):
what a rollout burst costs the engine, counted in its own log, straight and through
dprouter's defaults."""

from __future__ import annotations

import pytest

from dprouter.bench.harness.rollout_burst import lower_bound
from dprouter.bench.scenarios import makespan
from tests.e2e.conftest import SUMMARY

# the engine starts in about a minute; two bursts and their warm-ups take a few more
pytestmark = [pytest.mark.realsglang, pytest.mark.timeout(1200)]


def test_dprouter_default_needs_no_more_decode_steps_than_the_engine_alone() -> None:
    server = makespan.sglang()
    assert not isinstance(server, str), server
    found = makespan.measure(server, makespan.QUICK, ("rollout",), rounds=1)
    runs = found.runs["rollout"]
    alone, default = runs[makespan.ALONE.name][0], runs[makespan.DEFAULT.name][0]
    assert (alone.failed, default.failed) == ([], [])
    assert default.busiest <= alone.busiest, (default.steps, alone.steps)
    bound = lower_bound(found.bursts["rollout"][0].lengths, makespan.SLOTS)
    SUMMARY.append(
        f"makespan, rollout(0): busiest-rank decode steps {alone.busiest} {alone.steps} "
        f"engine alone, {default.busiest} {default.steps} dprouter default "
        f"(slot-model bound {bound})"
    )
