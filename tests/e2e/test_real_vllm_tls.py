"""dprouter to a real vLLM that takes only HTTPS with a client certificate and an API key
(its own ``--ssl-*`` and ``--api-key`` options): discovery, load scrapes and requests
all pass with the router's certificate and key, and the engine's own
figures show the requests on both ranks. The certificates are made in the test
(``tests/test_tls.py``'s throwaway CA)."""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from e2e import vllm_server
from tests.conftest import StartRouter, until
from tests.e2e.answers import served_by
from tests.e2e.conftest import SUMMARY
from tests.e2e.test_real_vllm import BODY, engine_counts
from tests.test_tls import Authority

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(600)]
KEY = "sk-vllm-engine-5e1d"


async def test_a_vllm_taking_only_mtls_and_its_key_is_served_through_the_router(
    tmp_path: Path, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    ca = Authority(tmp_path)
    server, client = ca.issue("engine"), ca.issue("router-client", client=True)
    args = (
        *("--api-key", KEY),
        *("--ssl-keyfile", str(server.key), "--ssl-certfile", str(server.cert)),
        *("--ssl-ca-certs", str(ca.path), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))),
    )
    port = vllm_server.free_port()
    with vllm_server.VllmServer(port, dp_size=2, extra_args=args) as engine:
        engine.tls = ca.trusting(client)
        await asyncio.to_thread(engine.wait_ready)
        assert engine.url.startswith("https://")
        direct = aiohttp.TCPConnector(ssl=ca.trusting(client))
        async with aiohttp.ClientSession(connector=direct) as mtls:
            # the engine's own checks: no client certificate, no handshake; no key, a 401
            with pytest.raises(aiohttp.ClientError):
                async with http.get(engine.url + "/health", ssl=ca.trusting()) as r:
                    await r.read()
            async with mtls.post(engine.url + "/v1/completions", json=BODY) as r:
                assert r.status == 401
            config = RouterConfig(
                workers=(WorkerSpec(engine.url),),
                engine_ca=str(ca.path),
                engine_cert=str(client.cert),
                engine_key=str(client.key),
                engine_api_key=KEY,
                load_interval=0.2,
            )
            router = await start_router(config)
            (worker,) = router.registry.workers.values()
            assert worker.ready and worker.ranks == 2  # discovered over mTLS, with the key
            served = await served_by(http, router.url, BODY, 6)
            assert served == {"w0/0": 3, "w0/1": 3}, served
            # the engine counted them, per rank
            counts: Counter[str] = Counter()
            for _ in range(50):  # vLLM publishes its stats a moment later
                counts = await engine_counts(mtls, engine.url, "vllm:request_success_total")
                if sum(counts.values()) >= 6:
                    break
                await asyncio.sleep(0.1)
            assert sorted(counts.values()) == [3, 3], counts
            # the load scrapes of its /metrics pass too: each rank's KV capacity is read
            assert await until(lambda: all(t.board.kv[t.slot] for t in worker.targets), 5)
            SUMMARY.append(
                f"vLLM over mTLS with --api-key: router served {dict(served)}, "
                f"engine counted {dict(counts)}"
            )
