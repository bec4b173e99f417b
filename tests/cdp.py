"""Just enough of the Chrome DevTools protocol to drive a headless Chromium from a test.

Chromium is started with ``--remote-debugging-port=0`` and says on stderr where
it listens; the page's WebSocket takes JSON commands (``id``, ``method``,
``params``) and sends back results and events. aiohttp speaks WebSocket, so no
browser-driver library is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

CHROMIUM = "/usr/bin/chromium"
LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []  # every event, in order
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            said = message.json()
            if "id" in said:
                future = self._waiting.pop(said["id"], None)
                if future is not None and not future.done():
                    future.set_result(said)
            else:
                self.events.append(said)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = future
        await self.ws.send_json({"id": n, "method": method, "params": params})
        said = await asyncio.wait_for(future, 10)
        if "error" in said:
            raise RuntimeError(f"{method}: {said['error']}")
        result: dict[str, Any] = said.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        said = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in said:
            raise RuntimeError(f"{expression}: {said['exceptionDetails']}")
        return said["result"].get("value")

    def named(self, method: str) -> list[dict[str, Any]]:
        return [e["params"] for e in self.events if e["method"] == method]

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def chromium(width: int = 1280, height: int = 900) -> AsyncIterator[Page]:
    """A headless Chromium with one blank page, its console, log and network reported."""
    profile = tempfile.mkdtemp(prefix="dprouter-chromium-")
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # as root (CI) the sandbox refuses to start
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",  # no call home: the test counts every request
        "--disable-component-update",
        "--disable-sync",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        browser_url = ""
        async with asyncio.timeout(30):
            while not browser_url:
                line = await process.stderr.readline()
                if not line:
                    raise RuntimeError("chromium exited before listening")
                if found := LISTENING.search(line):
                    browser_url = found.group(1).decode()
        # keep reading its stderr: a full pipe would stall the browser
        drain = asyncio.get_running_loop().create_task(process.stderr.read())
        http_base = "http://" + browser_url.split("/")[2]
        async with aiohttp.ClientSession() as session:
            async with session.get(http_base + "/json/list") as r:
                pages = [t for t in await r.json() if t["type"] == "page"]
            async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Runtime", "Log", "Network", "Page"):
                    await page.send(f"{domain}.enable")
                try:
                    yield page
                finally:
                    await page.close()
                    drain.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        shutil.rmtree(profile, ignore_errors=True)
