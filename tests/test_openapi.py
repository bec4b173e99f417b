"""The router against its own OpenAPI description, fuzzed by schemathesis (a real process)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, workers


async def test_the_description_documents_the_errors_the_router_really_gives(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), max_body=1024))
    async with http.get(router.url + "/openapi.json") as r:
        documented = set((await r.json())["paths"]["/v1/completions"]["post"]["responses"])
    bad = {
        b"{not json": "invalid JSON",
        b'{"prompt": 7}': "a wrong type",
        b'{"prompt": "x", "model": "nope"}': "an unknown model",
        b'{"prompt": "' + b"x" * 2000 + b'"}': "a body over --max-body",
    }
    for raw, what in bad.items():
        async with http.post(router.url + "/v1/completions", data=raw) as r:
            assert str(r.status) in documented, (what, r.status)
            assert (await r.json())["error"]["message"], what
    assert engine.generation_requests == 0


async def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(
    start_cluster: StartCluster, start_router: StartRouter, tmp_path: Path
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, time_scale=0.01)])).servers
    # with a token it cannot guess: a fuzzer that paused the engines would stall the rest
    router = await start_router(RouterConfig(workers=workers(engine.url), admin_token="t0k"))
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        router.url + "/openapi.json",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance",
        "--mode",
        "all",  # valid and invalid bodies: invalid ones must get a documented 4xx
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "40",
        "--seed",
        "7",
        "--no-color",
    ]
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,  # its cache and reports stay out of the repository
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert engine.generation_requests > 0  # valid requests reached the engine


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


@pytest.mark.parametrize("dashboard", [False, True])
async def test_the_description_lists_every_route_the_router_serves(
    dashboard: bool,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    config = RouterConfig(workers=workers(engine.url), admin_token="t", dashboard=dashboard)
    router = await start_router(config)
    served = {
        (route.method, _shape(route.resource.canonical))
        for route in router.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    async with http.get(router.url + "/openapi.json") as r:
        paths = (await r.json())["paths"]
    documented = {(m.upper(), _shape(p)) for p, ops in paths.items() for m in ops}
    assert served - {("GET", "/openapi.json")} == documented
    assert {("POST", "/generate"), ("POST", "/workers"), ("POST", "/v1/embeddings")} <= served
    assert (("GET", "/dashboard/data") in served) is dashboard
