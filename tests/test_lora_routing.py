"""LoRA adapters through the router, over two simulated engines of two DP ranks each
(both personas): affinity kept per adapter, and an adapter no engine lists refused alike."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.core.headers import TARGET_HEADER
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, until

BASE, P, Q = "sim-model", "sql-lora", "chat-lora"
PERSONAS = ("vllm", "sglang")
PROMPT = " ".join(f"system{i % 17} rule{i}" for i in range(120))  # ~240 tokens


def engines(persona: str, adapters: tuple[str, ...] = (P, Q)) -> list[EngineConfig]:
    config = EngineConfig(persona=persona, dp_size=2, lora_modules=adapters)  # type: ignore[arg-type]
    return [config, config]


def router_config(servers: list[SimServer], **keys: Any) -> RouterConfig:
    return RouterConfig(workers=tuple(WorkerSpec(s.url) for s in servers), seed=1, **keys)


def as_adapter(persona: str, adapter: str | None, spelling: str = "model") -> dict[str, Any]:
    """The body fields that run ``adapter`` (None: the base model) on ``persona``'s engine:
    vLLM's adapter is a model; SGLang's ``base:adapter``, or ``lora_path`` beside the base."""
    if adapter is None:
        return {"model": BASE}
    if persona == "vllm":
        return {"model": adapter}
    if spelling == "model":
        return {"model": f"{BASE}:{adapter}"}
    return {"model": BASE, "lora_path": adapter}


async def complete(
    http: aiohttp.ClientSession, url: str, fields: dict[str, Any]
) -> tuple[str, int]:
    """One completion of the prompt: the target that served it, and its cached tokens."""
    body = {**fields, "prompt": PROMPT, "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as r:
        answer = await r.json()
        assert r.status == 200, answer
        return r.headers[TARGET_HEADER], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize(
    ("persona", "spellings"),
    [
        ("vllm", ("model",) * 5),
        ("sglang", ("model",) * 5),
        ("sglang", ("lora_path",) * 5),
        ("sglang", ("model", "lora_path", "lora_path", "model", "model")),  # mixed: one name
    ],
)
async def test_cache_aware_keeps_each_adapters_prompt_where_that_adapter_cached_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: str,
    spellings: tuple[str, ...],
) -> None:
    """The issue's case: one ~240-token prompt sent as adapter P, Q, P, the base model, Q
    under cache_aware. The engine caches each adapter's KV apart, so each of the three
    goes to a rank of its own and each repeat finds its own blocks there (before, all
    five went to P's rank: cached 0, 0, 240, 0, 240 on one rank)."""
    servers = (await start_cluster(engines(persona))).servers
    router = await start_router(router_config(servers, policy="cache_aware"))
    sent = [
        await complete(http, router.url, as_adapter(persona, adapter, spelling))
        for adapter, spelling in zip((P, Q, P, None, Q), spellings, strict=True)
    ]
    (p, p_cold), (q, q_cold), (p_again, p_hit), (base, base_cold), (q_again, q_hit) = sent
    assert len({p, q, base}) == 3, sent
    assert (p_again, q_again) == (p, q)
    assert p_cold == q_cold == base_cold == 0
    assert p_hit >= 200 and q_hit >= 200, sent  # the prompt's full blocks, on its own rank


@pytest.mark.parametrize("persona", PERSONAS)
async def test_an_adapter_no_engine_lists_is_refused_in_the_router_alike(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: str,
) -> None:
    """One behaviour for both engines: 404 from the router, no engine asked (before,
    SGLang's went to every engine, and those without it answered 400)."""
    servers = (await start_cluster(engines(persona, (P,)))).servers
    router = await start_router(router_config(servers))
    asked = [as_adapter(persona, "nope")]
    if persona == "sglang":
        asked.append(as_adapter(persona, "nope", "lora_path"))
    for fields in asked:
        body = {**fields, "prompt": "hello", "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            answer = await r.json()
            assert r.status == 404, answer
            assert answer["error"]["type"] == "not_found_error"
            assert "does not exist" in answer["error"]["message"]
    generate = {"text": "hello", "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}}
    if persona == "sglang":  # SGLang's own /generate names it in lora_path, with no model
        async with http.post(router.url + "/generate", json=generate) as r:
            answer = await r.json()
            assert r.status == 404, answer
            assert answer["error"]["message"] == "The LoRA adapter `nope` does not exist."
    assert not any(s.received for s in servers)
    known = {**as_adapter(persona, P), "prompt": "hello", "max_tokens": 2}
    async with http.post(router.url + "/v1/completions", json=known) as r:
        assert r.status == 200  # a listed adapter goes on


async def test_an_sglang_adapter_waits_for_the_paused_worker_that_has_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """The only worker listing the adapter is paused (an RL weight update): a request for
    ``base:adapter`` waits for it, as one for a model only it serves does, not a 404."""
    plain, lora = EngineConfig(persona="sglang", dp_size=2), engines("sglang", (P,))[0]
    servers = (await start_cluster([plain, lora])).servers
    router = await start_router(router_config(servers))
    held = next(w for w in router.registry.workers.values() if w.url == servers[1].url)
    pause = f"{router.url}/pause_generation?worker={held.id}"
    async with http.post(pause, json={"mode": "in_place"}) as r:
        assert r.status == 200
    listening = len(router.registry.listeners)
    asked = asyncio.create_task(complete(http, router.url, as_adapter("sglang", P)))
    # a request waiting for a pool listens for the registry's changes meanwhile
    assert await until(lambda: len(router.registry.listeners) > listening)
    assert not asked.done() and not any(s.received for s in servers)
    async with http.post(router.url + "/continue_generation", json={}) as r:
        assert r.status == 200
    target, _ = await asyncio.wait_for(asked, 10)
    assert target.startswith(held.id + "/")


@pytest.mark.parametrize("policy", ["manual", "consistent_hash"])
async def test_one_session_keeps_its_target_whichever_path_names_the_base_model(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession, policy: str
) -> None:
    """SGLang's /generate names no model, its OpenAI paths do: the same base model, so one
    session's requests on all three stay on one target (the real P/D group caught them
    split when affinity was kept by the name as written); an adapter's is apart."""
    cluster = await start_cluster(engines("sglang"))
    router = await start_router(router_config(cluster.servers, policy=policy))
    sent = {
        "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"model": BASE, "prompt": PROMPT, "max_tokens": 2},
        "/v1/chat/completions": {
            "model": BASE,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2,
        },
    }
    seen: dict[str, set[str]] = {key: set() for key in ("alice", "bob", "carol", "dave")}
    for round_ in range(2):
        for key in seen:
            for path, body in sent.items():
                headers = {"X-Session-ID": key}
                async with http.post(router.url + path, json=body, headers=headers) as r:
                    assert r.status == 200, (round_, await r.text())
                    seen[key].add(r.headers[TARGET_HEADER])
    assert all(len(targets) == 1 for targets in seen.values()), seen
