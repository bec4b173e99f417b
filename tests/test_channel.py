"""The serving process's channel up to the parent, against a real server on a Unix socket."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from dprouter.multiproc.control_link import Channel
from tests.conftest import until


async def slow_parent(path: Path, batches: list[list[dict[str, Any]]]) -> web.AppRunner:
    """A parent whose /control/events takes 0.2 s to answer, keeping every batch."""

    async def events(request: web.Request) -> web.Response:
        batches.append(orjson.loads(await request.read()))
        await asyncio.sleep(0.2)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/control/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    return runner


async def test_what_is_sent_while_a_batch_is_being_posted_goes_next(tmp_path: Path) -> None:
    batches: list[list[dict[str, Any]]] = []
    runner = await slow_parent(tmp_path / "control.sock", batches)
    channel = Channel(str(tmp_path / "control.sock"))
    try:
        channel.send({"kind": "first"})
        assert await until(lambda: len(batches) == 1)
        channel.send({"kind": "during"})  # the first batch's answer is still 0.2 s away
        assert await until(lambda: len(batches) == 2, seconds=2)
        assert batches == [[{"kind": "first"}], [{"kind": "during"}]]
    finally:
        await channel.close()
        await runner.cleanup()
