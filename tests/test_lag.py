"""``dprouter_event_loop_lag_seconds``: a blocked event loop shows in /metrics."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.server.loop_lag import LoopLag
from tests.conftest import StartRouter, completions_engine, metric_sum, serving, workers

LAG = "dprouter_event_loop_lag_seconds"


async def test_a_handler_that_blocks_the_loop_raises_the_lag_gauge(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    async def blocking(request: web.Request) -> web.Response:
        await request.read()
        time.sleep(0.4)  # noqa: ASYNC251 -- the mistake the gauge is for: a blocking call
        return web.json_response({"choices": [{"text": "late"}]})

    # the stand-in engine runs on the router's own loop: its sleep blocks the router too
    async with serving(completions_engine(blocking)) as url:
        config = RouterConfig(workers=workers(url, dialect="vllm", dp_size=1))
        router = await start_router(config)
        await asyncio.sleep(0.3)
        assert await metric_sum(http, router.url, LAG) < 0.2
        async with http.post(router.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
        await asyncio.sleep(0.25)  # a tick or two after the block
        assert 0.3 <= await metric_sum(http, router.url, LAG) < 2.0


def test_the_worst_of_the_last_seconds_is_kept_then_forgotten() -> None:
    told: list[float] = []
    lag = LoopLag(keep=10.0, on_tick=told.append)
    lag.note(100.0, 0.002)
    lag.note(100.1, 0.5)
    lag.note(105.0, 0.001)
    assert lag.worst == 0.5 and told == [0.002, 0.5, 0.5]
    lag.note(110.5, 0.003)  # the late tick is more than 10 s old
    assert lag.worst == 0.003
    lag.note(111.0, -0.001)  # early (clock granularity) counts as on time
    assert lag.worst == 0.003
