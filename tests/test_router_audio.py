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
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, Faults, Persona
from tests.conftest import StartCluster, StartRouter, metric_sum, until, workers

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
PATH = "/v1/audio/transcriptions"
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


def until_arrived(after: int, *engines: SimServer) -> Gate:
    """A gate that holds the client, once ``after`` bytes have gone, until one of the
    engines has taken more of a file than before: the router forwards an upload while
    the client still sends it."""
    before = sum(e.audio.arrived for e in engines)

    def arrived() -> bool:
        return sum(e.audio.arrived for e in engines) > before

    async def gate(sent: int) -> None:
        if sent == after:
            assert await until(arrived), "nothing reached the engine"

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
    sent = trickle(body, until_arrived(16 * CHUNK, engine))
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
        router.url + url, data=trickle(body, until_arrived(8 * CHUNK, one)), headers=FORM_TYPE
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


async def test_max_body_is_counted_as_the_upload_streams(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    config = RouterConfig(workers=workers(engine.url), max_body=1 << 20, breaker_failures=1)
    router = await start_router(config)
    url = router.url + "/v1/audio/transcriptions"
    # a declared length over the limit: 413 before the body is sent, and no engine asked
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
    head += f"{FORM_TYPE['Content-Type']}\r\nContent-Length: {2 << 20}\r\n\r\n"
    writer.write(head.encode() + multipart(b"x" * 1000)[:500])
    status = await asyncio.wait_for(reader.readline(), 5)
    assert status.startswith(b"HTTP/1.1 413"), status
    writer.close()
    await writer.wait_closed()
    # streamed past the limit (no length declared): 413, the engine's upload cut off
    body = multipart(random.Random(10).randbytes(3 << 20))
    sent = trickle(body, until_arrived(4 * CHUNK, engine))
    async with http.post(url, data=sent, headers=FORM_TYPE) as r:
        assert r.status == 413 and "exceeds 1048576 bytes" in (await r.json())["error"]["message"]
    assert await until(lambda: engine.audio.broken == 1)
    assert not engine.audio.files
    too_large = await metric_sum(http, router.url, "dprouter_rejected_total", cause="too_large")
    assert too_large == 2  # the declared one and the streamed one
    assert await metric_sum(http, router.url, "dprouter_upstream_errors_total") == 0
    assert all(t.outstanding == 0 for t in router.registry.targets())
    # not the engine's fault: with one failure to trip its breaker, it still serves
    async with http.post(url, data=multipart(AUDIO), headers=FORM_TYPE) as r:
        assert r.status == 200 and (await r.json())["text"] == transcript(AUDIO)


async def test_a_client_leaving_mid_upload_frees_its_count_and_the_engines_upload(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    halfway = asyncio.Event()

    async def gate(sent: int) -> None:
        if sent == 4 * CHUNK:
            assert await until(lambda: engine.audio.arrived > 0), "nothing reached the engine"
            halfway.set()
            await asyncio.Event().wait()  # and sends no more

    body = multipart(random.Random(11).randbytes(2 << 20))
    url = router.url + "/v1/audio/transcriptions"
    client = asyncio.create_task(http.post(url, data=trickle(body, gate), headers=FORM_TYPE))
    await asyncio.wait_for(halfway.wait(), 10)
    assert sum(t.outstanding for t in router.registry.targets()) == 1  # in flight, uploading
    client.cancel()  # the client's connection closes
    await asyncio.gather(client, return_exceptions=True)
    assert await until(lambda: all(t.outstanding == 0 for t in router.registry.targets()))
    assert await until(lambda: engine.audio.broken == 1)  # the router closed its upload too
    assert not engine.audio.files


async def test_an_upload_is_retried_only_before_the_engine_takes_it(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    down, failing, fine = (
        await start_cluster(
            [
                EngineConfig(),
                EngineConfig(faults=Faults(failing_ranks=frozenset({0}))),
                EngineConfig(),
            ]
        )
    ).servers
    config = RouterConfig(
        workers=workers(down.url, fine.url), policy="round_robin", health_interval=60
    )
    router = await start_router(config)
    await down.crash()
    audio = random.Random(12).randbytes(1 << 20)
    url = router.url + "/v1/audio/transcriptions"
    # a refused connection: the engine took nothing, the upload goes to the other one
    for _ in range(2):
        sent = trickle(multipart(audio), until_arrived(4 * CHUNK, fine))
        async with http.post(url, data=sent, headers=FORM_TYPE) as r:
            assert r.status == 200 and (await r.json())["text"] == transcript(audio)
    assert fine.audio.files == {0: [hashlib.sha256(audio).hexdigest()] * 2}
    assert (
        await metric_sum(http, router.url, "dprouter_upstream_errors_total", cause="connect") == 1
    )
    # after the engine took the upload, its answer stands: a 500 is not tried elsewhere
    config = RouterConfig(workers=workers(failing.url, fine.url), policy="round_robin")
    router = await start_router(config)
    statuses = []
    for _ in range(2):
        sent = trickle(multipart(audio), until_arrived(4 * CHUNK, failing, fine))
        async with http.post(router.url + PATH, data=sent, headers=FORM_TYPE) as r:
            statuses.append(r.status)
    assert sorted(statuses) == [200, 500]
    assert len(fine.audio.files[0]) == 3  # the 500 never reached it


async def test_an_engine_lost_mid_upload_is_a_502_not_a_retry(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    engines = (await start_cluster([EngineConfig(), EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(*(e.url for e in engines))))

    async def gate(sent: int) -> None:
        if sent == 4 * CHUNK:  # the engine that has the upload's start dies
            assert await until(lambda: any(e.audio.arrived for e in engines))
            await next(e for e in engines if e.audio.arrived).crash()

    sent = trickle(multipart(random.Random(13).randbytes(1 << 20)), gate)
    async with http.post(router.url + PATH, data=sent, headers=FORM_TYPE) as r:
        assert r.status == 502
        assert "after the engine began taking it" in (await r.json())["error"]["message"]
    assert sorted(e.audio.arrived > 0 for e in engines) == [False, True]  # tried once
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_the_first_byte_clock_starts_once_the_upload_is_sent(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    quick, slow = (
        await start_cluster(
            [EngineConfig(model="quick"), EngineConfig(model="slow", faults=Faults(delay=1.5))]
        )
    ).servers
    config = RouterConfig(workers=workers(quick.url, slow.url), first_byte_timeout=0.5)
    router = await start_router(config)
    audio = random.Random(14).randbytes(1 << 20)
    # sent over about 1.3 s, longer than the timer: the engine answers at once after it
    sent = trickle(multipart(audio, "quick"), until_arrived(4 * CHUNK, quick), pause=0.08)
    async with http.post(router.url + PATH, data=sent, headers=FORM_TYPE) as r:
        assert r.status == 200 and (await r.json())["text"] == transcript(audio)
    # an answer that starts 1.5 s after the upload ends is past the timer
    sent = trickle(multipart(audio, "slow"), until_arrived(4 * CHUNK, slow))
    async with http.post(router.url + PATH, data=sent, headers=FORM_TYPE) as r:
        assert r.status == 502
        assert "TimeoutError" in (await r.json())["error"]["message"]
    assert len(quick.audio.files[0]) == 1
