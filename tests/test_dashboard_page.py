"""The dashboard page in a real headless Chromium, against a simulated 2 × DP8 + 1 × DP4
cluster: it loads cleanly, draws one cell per target, and a loaded rank's cell
changes colour within 2 s. Skipped where Chromium is missing, except in CI.

With ``DPROUTER_SCREENSHOT=path`` it also saves the page under load there (how
docs/dashboard.png is made).
"""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dprouter.cli.demo import demo_cluster
from dprouter.config import RouterConfig
from dprouter.server.router import Router
from tests.cdp import CHROMIUM, Page, chromium
from tests.conftest import StartCluster, StartRouter, background, until, workers

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
            if shot := os.environ.get("DPROUTER_SCREENSHOT"):
                await screenshot(page, http, router, Path(shot))
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


async def screenshot(page: Page, http: aiohttp.ClientSession, router: Router, path: Path) -> None:
    """More load, uneven over the ranks, then the page as a PNG."""
    opened: list[int] = []
    spread = [rank for rank, n in enumerate((0, 1, 2, 3, 6, 1, 0, 2)) for _ in range(n)]
    async with background(*(hold(http, router.url, rank, opened) for rank in spread)):
        assert await until(lambda: len(opened) == len(spread), 10)
        for _ in range(20):  # some answered requests, for the rates
            async with http.post(
                router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}
            ) as r:
                await r.read()
        await asyncio.sleep(1.5)  # a refresh of the page or two
        shot = await page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
