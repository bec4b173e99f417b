"""Audio through the router: a multipart form is routed by its model field and reaches
the engine byte for byte, the rank in a header for either engine."""

from __future__ import annotations

import random
import zlib

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.sim.config import EngineConfig, Persona
from tests.conftest import StartCluster, StartRouter, workers

AUDIO = random.Random(5).randbytes(200_000)


def form(model: str | None = "sim-model", audio: bytes = AUDIO) -> aiohttp.FormData:
    data = aiohttp.FormData()
    data.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    if model is not None:  # after the file: the router finds it wherever it is
        data.add_field("model", model)
    data.add_field("language", "en")
    return data


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_transcription_reaches_its_rank_with_the_file_unchanged(
    persona: Persona,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), policy="round_robin"))
    for _ in range(2):
        async with http.post(router.url + "/v1/audio/transcriptions", data=form()) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["text"] == f"{len(AUDIO)} bytes, crc {zlib.crc32(AUDIO):08x}"
            label, rank = r.headers["x-dprouter-target"], r.headers["x-sim-dp-rank"]
            assert label.endswith("/" + rank)
    got = [g for g in engine.received if g.path == "/v1/audio/transcriptions"]
    assert [g.headers["X-data-parallel-rank"] for g in got] == ["0", "1"]
    assert got[0].body["model"] == "sim-model" and got[0].body["language"] == "en"
    if persona == "vllm":  # an SGLang engine serves whatever name a client writes
        async with http.post(router.url + "/v1/audio/transcriptions", data=form("other")) as r:
            assert r.status == 404 and (await r.json())["error"]["param"] == "model"
        assert len(engine.received) == 2


async def test_bad_audio_requests_get_the_routers_own_errors(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang")])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), max_body=100_000))
    url = router.url + "/v1/audio/transcriptions"
    async with http.post(url, json={"model": "sim-model"}) as r:
        assert r.status == 400 and "multipart/form-data" in (await r.json())["error"]["message"]
    async with http.post(url, data=form()) as r:
        assert r.status == 413  # 200 kB over --max-body 100 kB
    async with http.post(router.url + "/v1/audio/translations", data=form(audio=b"x")) as r:
        assert r.status == 404  # vLLM's own endpoint, and no vLLM worker
    assert not engine.received
