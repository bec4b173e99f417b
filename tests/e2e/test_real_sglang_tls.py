"""dprouter to a real SGLang 0.5.23 serving HTTPS with both of its keys (``--api-key``,
``--admin-api-key``): the engine's own checks first -- its admin endpoints take the admin
key alone, the others the API key alone -- then the router, given the CA and both keys,
discovers the ranks, routes requests (the API key) and flushes the cache (the admin
key). The certificates are made in the test (``tests/test_tls.py``'s throwaway CA);
SGLang checks no client certificate (it has no option to require one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from e2e.sglang import server as sglang_server

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from tests.conftest import StartRouter
from tests.e2e.answers import served_by
from tests.e2e.conftest import SUMMARY
from tests.test_tls import Authority

pytestmark = [pytest.mark.realsglang, pytest.mark.timeout(600)]
KEY, ADMIN = "sk-sglang-api-4c2e", "sk-sglang-admin-8d1f"
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}


async def test_sglangs_two_keys_over_https_each_where_the_engine_takes_it(
    tmp_path: Path, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    ca = Authority(tmp_path)
    server = ca.issue("engine")
    args = (
        *("--api-key", KEY, "--admin-api-key", ADMIN),
        *("--ssl-keyfile", str(server.key), "--ssl-certfile", str(server.cert)),
    )
    port = sglang_server.free_port()
    with sglang_server.SglangServer(port, dp_size=2, extra_args=args) as engine:
        engine.tls = ca.trusting()
        await asyncio.to_thread(engine.wait_ready)
        assert engine.url.startswith("https://")
        trusting = ca.trusting()
        # the engine's own checks: each key where SGLang takes it, and nowhere else
        for path, key, status in (
            ("/v1/completions", None, 401),
            ("/v1/completions", ADMIN, 401),
            ("/flush_cache", KEY, 401),
            ("/flush_cache", ADMIN, 200),
        ):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = BODY if path == "/v1/completions" else None
            async with http.post(engine.url + path, json=body, headers=headers, ssl=trusting) as r:
                assert r.status == status, (path, key == ADMIN, r.status, await r.text())
        config = RouterConfig(
            workers=(WorkerSpec(engine.url),),
            health_interval=0,
            engine_ca=str(ca.path),
            engine_api_key=KEY,
            engine_admin_key=ADMIN,
        )
        router = await start_router(config)
        (worker,) = router.registry.workers.values()
        assert worker.ready and worker.ranks == 2  # discovered over HTTPS, with the API key
        served = await served_by(http, router.url, BODY, 4)
        assert served == {"w0/0": 2, "w0/1": 2}, served
        async with http.post(router.url + "/flush_cache") as r:  # an admin endpoint
            answer = await r.json()
        assert r.status == 200 and [w["status"] for w in answer["workers"]] == [200], answer
        SUMMARY.append(
            f"SGLang over HTTPS with --api-key and --admin-api-key: router served "
            f"{dict(served)}, its flush answered {answer['workers'][0]['status']}"
        )
