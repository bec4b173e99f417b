"""Audio through the router: a multipart form is routed by its model field and reaches
the engine byte for byte, the rank in a header for either engine."""

from __future__ import annotations

import asyncio
import hashlib
import random
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.sim.config import EngineConfig, Persona
from dprouter.sim.server import SimServer
from tests.conftest import StartCluster, StartRouter, until, workers

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


# Streamed uploads. The form is written here byte by byte and sent by an async generator,
# chunk by chunk, so a test can stop mid-upload and look at what the engine holds by then.
BOUNDARY = "dprouter-audio-test"
FORM_TYPE = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
CHUNK = 64 << 10
Gate = Callable[[int], Awaitable[None]]


def multipart(audio: bytes, model: str | None = "sim-model", model_first: bool = True) -> bytes:
    def part(name: str, value: bytes, filename: str | None = None) -> bytes:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        kind = "\r\nContent-Type: audio/wav" if filename else ""
        return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}{kind}\r\n\r\n".encode() + (
            value + b"\r\n"
        )

    named = [part("model", model.encode())] if model is not None else []
    parts = [part("file", audio, "a.wav"), part("language", b"en")]
    parts = [*named, *parts] if model_first else [*parts, *named]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


async def trickle(
    body: bytes, gate: Gate | None = None, pause: float = 0.0
) -> AsyncIterator[bytes]:
    """``body`` in chunks; after each, ``gate`` hears how many bytes have gone."""
    for at in range(0, len(body), CHUNK):
        yield body[at : at + CHUNK]
        if gate is not None:
            await gate(at + CHUNK)
        await asyncio.sleep(pause)


def until_arrived(engine: SimServer, after: int) -> Gate:
    """A gate that holds the client, once ``after`` bytes have gone, until the engine has
    taken some of the file: the router forwards an upload while the client still sends it."""

    async def gate(sent: int) -> None:
        if sent == after:
            assert await until(lambda: engine.audio.arrived > 0), "nothing reached the engine"

    return gate


def transcript(audio: bytes) -> str:
    return f"{len(audio)} bytes, crc {zlib.crc32(audio):08x}"


@pytest.mark.parametrize(("persona", "declared"), [("vllm", True), ("sglang", False)])
async def test_a_large_upload_streams_through_byte_for_byte(
    persona: Persona,
    declared: bool,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    audio = random.Random(7).randbytes(8 << 20)
    body = multipart(audio)
    headers = {**FORM_TYPE, "Content-Length": str(len(body))} if declared else FORM_TYPE
    # the client stops at 1 MiB of 8 until the engine has some of the file
    sent = trickle(body, until_arrived(engine, 16 * CHUNK))
    url = router.url + "/v1/audio/transcriptions"
    async with http.post(url, data=sent, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["text"] == transcript(audio)
        rank = int(r.headers["x-sim-dp-rank"])
    assert engine.audio.files == {rank: [hashlib.sha256(audio).hexdigest()]}
    (got,) = [g for g in engine.received if g.path == "/v1/audio/transcriptions"]
    assert got.headers["Content-Type"] == FORM_TYPE["Content-Type"]  # its boundary, as sent
    if declared:  # the client's length goes on; else the engine gets it chunked
        assert got.headers["Content-Length"] == str(len(body))
    else:
        assert got.headers["Transfer-Encoding"] == "chunked"
    assert got.body["model"] == "sim-model" and got.body["language"] == "en"
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_a_model_after_the_file_waits_only_when_several_models_are_served(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    one, a, b = (
        await start_cluster([EngineConfig(), EngineConfig(model="a"), EngineConfig(model="b")])
    ).servers
    url = "/v1/audio/transcriptions"
    audio = random.Random(8).randbytes(2 << 20)
    # one model served: the field cannot change where the upload goes, so it streams at once
    router = await start_router(RouterConfig(workers=workers(one.url)))
    body = multipart(audio, model_first=False)
    async with http.post(
        router.url + url, data=trickle(body, until_arrived(one, 8 * CHUNK)), headers=FORM_TYPE
    ) as r:
        assert r.status == 200 and (await r.json())["text"] == transcript(audio)
    # several: the router holds the form's start (4 MiB at most) until the field comes
    router = await start_router(RouterConfig(workers=workers(a.url, b.url)))
    body = multipart(audio, model="b", model_first=False)
    async with http.post(router.url + url, data=trickle(body), headers=FORM_TYPE) as r:
        assert r.status == 200 and (await r.json())["text"] == transcript(audio)
    assert (a.audio.files, len(b.audio.files[0])) == ({}, 1)
    body = multipart(random.Random(9).randbytes(5 << 20), model="b", model_first=False)
    async with http.post(router.url + url, data=trickle(body), headers=FORM_TYPE) as r:
        assert r.status == 400, await r.text()
        problem = (await r.json())["error"]
        assert problem["param"] == "model" and "before the file" in problem["message"]
    assert (a.audio.arrived, b.audio.arrived) == (0, len(audio))
