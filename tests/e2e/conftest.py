"""The real-engine groups: skipped, with the reason, unless their environment is prepared
(``bash e2e/prepare.sh`` for vLLM, ``bash e2e/sglang/prepare.sh`` for SGLang)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e.sglang import server as sglang_server

from e2e import vllm_server  # beside prepare.sh, not part of the installed package

SUMMARY: list[str] = []  # lines printed at the end of the run: what really happened


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {"realvllm": vllm_server.available(), "realsglang": sglang_server.available()}
    for item in items:
        for marker, reason in reasons.items():
            if marker in item.keywords and reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARY:
        terminalreporter.section("real engines: what they counted")
        for line in SUMMARY:
            terminalreporter.write_line(line)


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
