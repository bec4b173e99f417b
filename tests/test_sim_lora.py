"""The simulated engines' LoRA answers, as vLLM 0.32 and SGLang 0.5.23 give them: an
adapter the engine does not have is refused in its own words, an SGLang adapter it once
loaded is loaded again, and answers name the adapter as each engine names it."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster

BASE, SQL = "sim-model", "sql-lora"


def engine(persona: str) -> EngineConfig:
    return EngineConfig(persona=persona, lora_modules=(SQL,))  # type: ignore[arg-type]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        raw = await r.read()
        return r.status, (orjson.loads(raw) if r.content_type == "application/json" else raw)


async def test_sglang_refuses_an_adapter_it_never_loaded_in_its_words(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    """``_resolve_lora_path``: a ValueError naming every adapter the engine ever loaded,
    400 on the OpenAI paths and /generate, inside a 200 stream on a streamed /generate."""
    (server,) = (await start_cluster([engine("sglang")])).servers
    said = (
        "Got LoRA adapter that has never been loaded: nope\n"
        f"All loaded adapters: dict_keys(['{SQL}'])."
    )
    prompt = {"prompt": "hello", "max_tokens": 2}
    for body in ({**prompt, "model": f"{BASE}:nope"}, {**prompt, "lora_path": "nope"}):
        status, answer = await post(http, server.url + "/v1/completions", body)
        assert (status, answer["message"], answer["type"]) == (400, said, "BadRequest")
    generate = {"text": "hello", "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}}
    status, answer = await post(http, server.url + "/generate", generate)
    assert (status, answer) == (400, {"error": {"message": said}})
    status, raw = await post(http, server.url + "/generate", {**generate, "stream": True})
    first = orjson.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))
    assert status == 200 and first["error"]["message"] == said and first["error"]["code"] == 400
    assert not server.received  # none ran


async def test_sglang_loads_an_unloaded_adapter_again_when_a_request_names_it(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    """SGLang keeps every adapter it loaded (``lora_ref_cache``): one unloaded straight at
    the engine is loaded again from its path by the next request naming it."""
    (server,) = (await start_cluster([engine("sglang")])).servers
    async with http.post(server.url + "/unload_lora_adapter", json={"lora_name": SQL}) as r:
        assert r.status == 200 and SQL not in (await r.json())["loaded_adapters"]
    body = {"model": f"{BASE}:{SQL}", "prompt": "hello", "max_tokens": 2}
    status, answer = await post(http, server.url + "/v1/completions", body)
    assert status == 200, answer
    async with http.get(server.url + "/v1/models") as r:
        assert SQL in {card["id"] for card in (await r.json())["data"]}


async def test_answers_name_the_adapter_as_each_engine_does(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    """vLLM names the adapter that ran it (``model_name(lora_request)``); SGLang echoes the
    request's ``model``, "default" when it had none."""
    vllm, sglang = (await start_cluster([engine("vllm"), engine("sglang")])).servers
    prompt = {"prompt": "hello", "max_tokens": 2}
    asked = [
        (vllm, {"model": SQL}, SQL),
        (vllm, {"model": BASE}, BASE),
        (vllm, {}, BASE),
        (sglang, {"model": f"{BASE}:{SQL}"}, f"{BASE}:{SQL}"),
        (sglang, {"model": BASE, "lora_path": SQL}, BASE),
        (sglang, {"lora_path": SQL}, "default"),
    ]
    for server, body, named in asked:
        status, answer = await post(http, server.url + "/v1/completions", {**prompt, **body})
        assert (status, answer["model"]) == (200, named)
        stream = {**prompt, **body, "stream": True}
        status, raw = await post(http, server.url + "/v1/completions", stream)
        first = orjson.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))
        assert (status, first["model"]) == (200, named)


async def test_vllm_refuses_a_model_it_does_not_serve_in_its_words(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    """``_check_model``: 404 naming the served aliases; no resolver found an adapter, but
    asking took an adapter number, so the next adapter loaded is numbered after it."""
    (server,) = (await start_cluster([engine("vllm")])).servers
    body = {"model": "nope", "prompt": "hello", "max_tokens": 2}
    status, answer = await post(http, server.url + "/v1/completions", body)
    assert status == 404
    assert answer["error"] == {
        "message": f"The model `nope` does not exist. Valid aliases: {BASE}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    loaded = {"lora_name": "chat", "lora_path": "/adapters/chat"}
    async with http.post(server.url + "/v1/load_lora_adapter", json=loaded) as r:
        assert r.status == 200
    assert server.adapters.loaded["chat"].id == 3  # sql-lora 1, the request 2
