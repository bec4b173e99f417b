"""The real-engine groups: skipped, with the reason, unless their environment is prepared
(``bash e2e/prepare.sh`` for vLLM, ``bash e2e/sglang/prepare.sh`` for SGLang)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.pd import pair as pd_pair
from e2e.sglang import server as sglang_server

from dprouter.bench.scenarios.makespan import engine_lock
from e2e import beside, vllm_server  # beside prepare.sh, not part of the installed package

SUMMARY: list[str] = []  # lines printed at the end of the run: what really happened
LOCK_WAIT = 3000.0  # seconds another run's real engines may hold the machine


async def installs_beside(engine: str, python: Path, home: Path, url: str) -> None:
    """``pip install`` of dprouter into an engine's own environment (where an RL framework
    imports it) changes none of its packages and adds no problem to ``pip check``; a
    ``Router`` run from there routes to the engine's 2 ranks at ``url``."""
    done = await asyncio.to_thread(beside.install, python)
    assert done.changed == {}, done.changed
    assert done.new_problems == [], done.new_problems
    answer = await asyncio.to_thread(beside.embedded, python, url)
    assert str(answer["imported_from"]).startswith(str(home))
    assert (answer["status"], answer["ranks"]) == (200, 2)
    SUMMARY.append(f"dprouter beside {engine}: added {sorted(done.added)}, changed nothing")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {
        "realvllm": vllm_server.available(),
        "realsglang": sglang_server.available(),
        "realpd": pd_pair.available(),
    }
    for item in items:
        for marker, reason in reasons.items():
            if marker in item.keywords and reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARY:
        terminalreporter.section("real engines: what they counted")
        for line in SUMMARY:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def one_real_engine_group_at_a_time() -> Iterator[None]:
    """A real-engine group holds ``/tmp/dprouter-real-engine.lock`` while it runs (a
    benchmark's real engine, or another run's, waits), as ``bench makespan`` does; the
    scenarios and tests inside that ask for it again only count."""
    with engine_lock(LOCK_WAIT):
        yield


@pytest.fixture(scope="module")
def vllm_dp2() -> Iterator[vllm_server.VllmServer]:
    # dev mode: vLLM's RL routes (pause, resume, weight versions) for the RL loop
    with vllm_server.VllmServer(vllm_server.free_port(), dp_size=2, dev_mode=True) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def sglang_dp2() -> Iterator[sglang_server.SglangServer]:
    """``--dp-size 2``: two data-parallel replicas of the tiny Llama."""
    with sglang_server.SglangServer(sglang_server.free_port(), dp_size=2) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def sglang_attn2() -> Iterator[sglang_server.SglangServer]:
    """``--tp-size 2 --attn-dp-size 2``: attention DP over two ranks (the tiny Qwen3)."""
    port = sglang_server.free_port()
    with sglang_server.SglangServer(port, attn_dp_size=2, model="qwen3") as server:
        server.wait_ready()
        yield server
