"""The real-vLLM group: skipped, with the reason, unless ``bash e2e/prepare.sh`` ran."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e import vllm_server  # beside prepare.sh, not part of the installed package

SUMMARY: list[str] = []  # lines printed at the end of the run: what really happened


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = vllm_server.available()
    for item in items:
        if "realvllm" in item.keywords and reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARY:
        terminalreporter.section("real vLLM: what the engines counted")
        for line in SUMMARY:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def vllm_dp2() -> Iterator[vllm_server.VllmServer]:
    with vllm_server.VllmServer(vllm_server.free_port(), dp_size=2) as server:
        server.wait_ready()
        yield server
