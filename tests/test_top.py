"""``dprouter top`` against a simulated 2 × DP8 + 1 × DP4 cluster, and mid-way through an
RL step over simulated SGLang engines, through rich's own console capture."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner
from rich.console import Console

from dprouter.cli.demo import demo_cluster
from dprouter.cli.top import TopError, top, top_command
from dprouter.config import RouterConfig
from tests.conftest import StartCluster, StartRouter, background, until, workers
from tests.test_dashboard import SGLANG, mid_step, rl_config

LONG: dict[str, Any] = {"model": "demo", "prompt": "hold on", "max_tokens": 3000, "stream": True}


async def hold(http: aiohttp.ClientSession, url: str, opened: list[int]) -> None:
    async with http.post(url + "/v1/completions", json=LONG) as r:
        await r.content.readline()
        opened.append(1)
        async for _ in r.content:
            pass


def rows(text: str) -> dict[str, int]:
    """Target -> load, from the printed table."""
    found = re.findall(r"^(w\d+/\d+)\s+regular\s+(\d+)", text, re.MULTILINE)
    return {label: int(load) for label, load in found}


async def test_once_prints_every_target_with_its_load_busiest_first(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster())
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), dashboard=True))
    opened: list[int] = []
    async with background(*(hold(http, router.url, opened) for _ in range(3))):
        assert await until(lambda: len(opened) == 3)
        console = Console(record=True, width=160)
        await top(router.url, once=True, console=console)
        text = console.export_text()
        loads = {t.label: t.load for t in router.registry.targets()}
    printed = rows(text)
    assert printed == loads and len(printed) == 20
    assert list(printed.values())[:3] == [1, 1, 1]  # --sort load: the busy ones on top
    assert "3 in flight" in text and "workers 3/3 ready" in text


async def test_live_refreshes_under_a_terminal(
    start_cluster: StartCluster, start_router: StartRouter
) -> None:
    cluster = await start_cluster(demo_cluster()[2:])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), dashboard=True))
    console = Console(record=True, width=160, force_terminal=True)
    await top(router.url, console=console, frames=3, interval=0.2, sort="target")
    text = console.export_text()
    assert text.count("w0/3") >= 3  # three frames drawn, each with every target


async def test_a_token_is_needed_when_set_and_a_router_without_dashboard_says_so(
    start_cluster: StartCluster, start_router: StartRouter
) -> None:
    cluster = await start_cluster(demo_cluster()[2:])
    config = RouterConfig(workers=workers(*cluster.urls), dashboard=True, admin_token="t")
    router = await start_router(config)
    with pytest.raises(TopError, match="--token"):
        await top(router.url, once=True, console=Console(record=True))
    console = Console(record=True, width=160)
    await top(router.url, once=True, token="t", console=console)
    assert len(rows(console.export_text())) == 4
    plain = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    with pytest.raises(TopError, match="--dashboard"):
        await top(plain.url, once=True, console=Console(record=True))


async def test_mid_step_it_shows_the_held_requests_and_each_workers_hold_and_version(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([SGLANG, SGLANG])
    router = await start_router(rl_config(tmp_path, *cluster.urls))
    assert await until(lambda: all(t.board.cap_of(t.slot) for t in router.registry.targets()))
    async with mid_step(http, router.url):
        console = Console(record=True, width=200)
        await top(router.url, once=True, console=console)
        text = console.export_text()
    assert "5 held (high 2, low 3)" in text
    printed = {
        worker: (hold, version)
        for worker, hold, version in re.findall(
            r"^(w\d+)\s+regular\s+ready\s+(\w+)\s+(\S+)\s+2\s+\d+$", text, re.MULTILINE
        )
    }
    assert printed == {"w0": ("serving", "7"), "w1": ("paused", "default")}
    assert re.search(r"^w1/0\s.*\bready, paused$", text, re.MULTILINE)  # its targets say so


def test_the_command_refuses_an_unknown_sort() -> None:
    result = CliRunner().invoke(top_command, ["http://127.0.0.1:1", "--sort", "colour"])
    assert result.exit_code == 2 and "colour" in result.output
