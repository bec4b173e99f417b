"""The dashboard page in a real headless Chromium, against a simulated 2 × DP8 + 1 × DP4
cluster: it loads cleanly, draws one cell per target, and a loaded rank's cell
changes colour within 2 s. And mid-way through an RL step over simulated SGLang
engines: the page's text says how many requests the router holds by class, which
worker is paused and each one's weights' version. Skipped where Chromium is missing,
except in CI.

The RL step's page is saved as a PNG; with ``DPROUTER_SCREENSHOT=path`` there (how
docs/dashboard.png is made).
"""

from __future__ import annotations

import asyncio
import base64
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dprouter.cli.demo import demo_cluster
from dprouter.config import RouterConfig
from dprouter.server.router import Router
from tests.cdp import CHROMIUM, Page, chromium
from tests.conftest import StartCluster, StartRouter, background, until, workers
from tests.test_dashboard import HELD, SGLANG, mid_step, rl_config

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and os.environ.get("CI") != "true",
    reason="no chromium here (CI installs it and runs this test)",
)
CELLS = "document.querySelectorAll('#heat rect.cell')"
LONG: dict[str, Any] = {"model": "demo", "prompt": "hold on", "max_tokens": 3000, "stream": True}


def fill_of(label: str) -> str:
    return f"document.querySelector('#heat rect[data-target=\"{label}\"]')?.getAttribute('fill')"


async def hold(http: aiohttp.ClientSession, url: str, rank: int, opened: list[int]) -> None:
    """A long stream to ``rank`` (the router trusts the client's rank), read until cancelled."""
    headers = {"X-data-parallel-rank": str(rank)}
    async with http.post(url + "/v1/completions", json=LONG, headers=headers) as r:
        assert r.status == 200
        await r.content.readline()
        opened.append(rank)
        async for _ in r.content:
            pass


def loaded(router: Router) -> list[str]:
    return [t.label for t in router.registry.targets() if t.outstanding > 0]


def problems(page: Page, origin: str) -> list[str]:
    """Console errors, uncaught exceptions and requests to anywhere but the router."""
    found = [
        f"console: {c['args']}"
        for c in page.named("Runtime.consoleAPICalled")
        if c["type"] in ("error", "assert")
    ]
    found += [f"exception: {e['exceptionDetails']}" for e in page.named("Runtime.exceptionThrown")]
    found += [
        f"log: {e['entry']}" for e in page.named("Log.entryAdded") if e["entry"]["level"] == "error"
    ]
    for sent in page.named("Network.requestWillBeSent"):
        url = sent["request"]["url"]
        if not url.startswith(origin + "/"):
            found.append(f"request to another host: {url}")
    return found


async def test_the_page_shows_every_target_and_a_loaded_rank_changes_colour(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster())
    config = RouterConfig(workers=workers(*cluster.urls), dashboard=True, trust_client_rank=True)
    router = await start_router(config)
    async with chromium() as page:
        await page.send("Page.navigate", url=router.url + "/dashboard")
        assert await wait_for(page, f"{CELLS}.length === 20"), "the heat map never drew"
        labels = await page.evaluate(f"Array.from({CELLS}).map(c => c.dataset.target)")
        assert sorted(labels) == sorted(t.label for t in router.registry.targets())
        idle = {label: await page.evaluate(fill_of(label)) for label in labels}
        assert len(set(idle.values())) == 1  # nothing in flight: every cell alike

        opened: list[int] = []
        async with background(*(hold(http, router.url, 5, opened) for _ in range(3))):
            assert await until(lambda: len(opened) == 3)
            started = asyncio.get_running_loop().time()
            hot = loaded(router)
            assert hot and all(label.endswith("/5") for label in hot)
            changed = f"{fill_of(hot[0])} !== {idle[hot[0]]!r}"
            assert await wait_for(page, changed, seconds=2.0), "the loaded cell kept its colour"
            assert asyncio.get_running_loop().time() - started < 2.0
            assert await page.evaluate(fill_of(labels[-1])) == idle[labels[-1]] or labels[-1] in hot
        assert problems(page, router.url) == []
        sent = {e["request"]["url"] for e in page.named("Network.requestWillBeSent")}
        assert {router.url + "/dashboard/dashboard.js", router.url + "/dashboard/data"} <= sent


async def wait_for(page: Page, condition: str, seconds: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        if await page.evaluate(f"!!({condition})"):
            return True
        await asyncio.sleep(0.05)
    return bool(await page.evaluate(f"!!({condition})"))


def rows(table: str) -> str:
    """Each row of the page's table ``table`` as its rendered cells' text."""
    found = f"document.querySelectorAll('#{table} tbody tr')"
    return f"Array.from({found}).map(r => Array.from(r.cells).map(c => c.innerText))"


async def test_mid_step_the_page_shows_held_requests_and_each_workers_hold_and_version(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """Two SGLang engines of 4 ranks x 2 running slots: w1 paused and w0 at weights 7
    through the router, w0's 8 slots taken, 3 low and 2 high requests held."""
    engine = replace(SGLANG, dp_size=4)
    cluster = await start_cluster([engine, engine])
    router = await start_router(rl_config(tmp_path, *cluster.urls))
    assert await until(lambda: all(t.board.cap_of(t.slot) for t in router.registry.targets()))
    async with chromium() as page:
        await page.send("Page.navigate", url=router.url + "/dashboard")
        assert await wait_for(page, f"{CELLS}.length === 8"), "the heat map never drew"
        async with mid_step(http, router.url, slots=8):
            shown = "document.querySelector('#held tfoot td:last-child').innerText === '5'"
            assert await wait_for(page, shown), "the page never said 5 held"
            held = {r[0]: r[1:] for r in await page.evaluate(rows("held"))}
            assert held == {  # class: for a slot, for a worker, in all
                "high": ["2", "0", "2"],
                "normal": ["0", "0", "0"],
                "low": ["3", "0", "3"],
            }
            assert {name: int(held[name][2]) for name in HELD} == HELD
            seen = {r[0]: r[1:] for r in await page.evaluate(rows("workers"))}
            # worker: role, state, hold, weights, ranks, in flight
            assert seen == {
                "w0": ["regular", "ready", "serving", "7", "4", "8"],
                "w1": ["regular", "ready", "paused", "default", "4", "0"],
            }
            text = await page.evaluate("document.body.innerText")
            assert "held in the router" in text and "ready, paused" in text
            paused = await page.evaluate("document.querySelectorAll('#heat rect.cell.held').length")
            assert paused == 4  # w1's cells, marked
            shot = await page.send(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True
            )
        png = base64.b64decode(shot["data"])
        assert png.startswith(b"\x89PNG")
        for path in (tmp_path / "dashboard.png", os.environ.get("DPROUTER_SCREENSHOT")):
            if path:
                await asyncio.to_thread(Path(path).write_bytes, png)
        assert problems(page, router.url) == []
