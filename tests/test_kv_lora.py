"""LoRA adapters in the KV index: an adapter's blocks chain apart from the base model's,
and a request looks its prompt up in the chain of the adapter its engine would run it
with -- vLLM's ``model`` naming an adapter, SGLang's ``base:adapter`` or ``lora_path``.
End to end over simulated DP4 engines serving one adapter beside the model, whose KV
events say the adapter as the real engines do (vLLM 0.32: ``lora_id`` and
``lora_name``; SGLang 0.5.23: ``lora_name``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest

from dprouter.core.tokenizer import ModelTokenizer
from dprouter.core.types import Incoming
from dprouter.engines.kvevents import wire
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.keys import chain, prompt_keys, root
from dprouter.engines.kvevents.lookup import Matcher
from dprouter.engines.kvevents.prompt import Asked, asked
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.sim.model.config import EngineConfig, RankLimits
from dprouter.sim.model.kvevents import Adapter, KvEventsConfig, Stored, encode_batch
from tests.conftest import StartCluster, StartRouter, until
from tests.test_kv_routing import (
    BLOCK,
    DP,
    PERSONAS,
    feed_of,
    prefix_config,
    send,
    spec,
    tok,  # noqa: F401  (a fixture)
    words,
)

BASE = "sim-model"
SQL = "sql-lora"
PARENTS = {BASE: None, SQL: BASE}


def incoming(model: str | None, **body: Any) -> Incoming:
    return Incoming({"model": model, **body}, model, False, None, "", 0)


def test_events_say_the_adapter_by_the_name_a_request_sends() -> None:
    """vLLM 0.32 sends the name beside its load-time id: the name wins; SGLang 0.5.23
    sends the name alone; an engine that sends only the id keeps it."""
    tokens = list(range(BLOCK))
    for persona in PERSONAS:
        stored = Stored([7], None, tokens, BLOCK, Adapter(3, SQL))
        payload = encode_batch(0.0, [stored], 0, persona, "map")
        (event,) = wire.batch(payload).events
        assert isinstance(event, wire.Stored) and event.lora == SQL
    raw = ["BlockStored", [7], None, tokens, BLOCK, 3, "GPU"]  # older vLLM: the id alone
    (event,) = wire.batch(msgpack.packb([0.0, [raw]])).events
    assert isinstance(event, wire.Stored) and event.lora == 3


def test_every_adapter_starts_its_own_chain() -> None:
    """Names alike in their first eight bytes and length still start apart; an integer id
    never shares a root with a name (a request names its adapter, never its id)."""
    roots = [root(None), root("adapter-a"), root("adapter-b"), root("1"), root(1), root("sql")]
    assert roots[0] == root(0) == 0
    assert len(set(roots)) == len(roots)
    ids = list(range(5 * BLOCK))
    assert chain(root(SQL), 0, ids, BLOCK) == prompt_keys(np.asarray(ids), BLOCK, root(SQL))


@pytest.mark.parametrize(
    ("dialect", "model", "body", "expected"),
    [
        ("vllm", SQL, {}, Asked(SQL, BASE)),  # vLLM serves an adapter as a model
        ("vllm", BASE, {}, Asked(None, BASE)),
        ("vllm", "unlisted", {}, Asked(None, "unlisted")),
        ("vllm", BASE, {"lora_path": SQL}, Asked(None, BASE)),  # not vLLM's field
        ("sglang", f"{BASE}:{SQL}", {}, Asked(SQL, BASE)),
        ("sglang", f"other:{SQL}", {}, Asked(SQL, "other")),
        ("sglang", BASE, {"lora_path": SQL}, Asked(SQL, BASE)),
        ("sglang", None, {"lora_path": [SQL, None]}, Asked(SQL, None)),  # /generate, a batch
        ("sglang", SQL, {}, Asked(None, SQL)),  # a bare adapter name runs the base model
        ("sglang", f"{BASE}:", {}, Asked(None, f"{BASE}:")),
    ],
)
def test_a_request_names_its_adapter_as_its_engine_reads_it(
    dialect: str, model: str | None, body: dict[str, Any], expected: Asked
) -> None:
    assert asked(dialect, incoming(model, **body), PARENTS) == expected


def test_the_matcher_looks_in_the_requests_adapter_chain() -> None:
    """Rank 0 holds a prompt for the adapter, rank 1 the same prompt for the base model:
    each lookup finds only its own chain's holder; blocks an event names only by an id
    are matched by neither."""
    registry = Registry()
    worker = registry.add(Worker("w0", "http://127.0.0.1:9", dialect="vllm"))
    worker.cards = {m: {"id": m, "parent": p} for m, p in PARENTS.items()}
    worker.ranks = 3
    registry.mark_ready(worker)
    pool = registry.snapshot.pool()
    index = KvIndex()
    ids = list(range(100, 100 + 4 * BLOCK))
    for rank, lora in enumerate((SQL, None, 9)):
        event = wire.Stored([rank * 10 + i for i in range(4)], None, ids, BLOCK, lora)
        index.apply(index.rank("w0", rank), [event])
    matcher = Matcher(index)
    labels = [t.label for t in pool]
    full = 4 * BLOCK
    prompt = np.asarray([*ids, 1, 2, 3])
    assert matcher.match(pool, prompt, 0.0, {"vllm": SQL}).prefix.held == {labels[0]: full}
    assert matcher.match(pool, prompt, 0.0).prefix.held == {labels[1]: full}
    assert matcher.match(pool, prompt, 0.0, {"vllm": "other"}).prefix.held == {}


def lora_engine(persona: str, tokenizer: Path) -> EngineConfig:
    events = KvEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    limits = RankLimits(prefix_cache_blocks=4096, kv_tokens=200_000, max_model_len=8192)
    return EngineConfig(
        persona=persona,  # type: ignore[arg-type]
        dp_size=DP,
        limits=limits,
        kv_events=events,
        tokenizer=str(tokenizer),
        model=BASE,
        lora_modules=(SQL,),
    )


def for_adapter(persona: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request body that runs the adapter on ``persona``'s engine."""
    return {**body, "model": SQL if persona == "vllm" else f"{BASE}:{SQL}"}


@pytest.mark.parametrize("persona", PERSONAS)
async def test_an_adapters_repeated_prompt_goes_where_its_adapter_holds_it(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,  # noqa: F811
    persona: str,
) -> None:
    """One document, held on rank 1 for the adapter and on rank 2 for the base model
    (warmed by another client): a repeat for the adapter goes to rank 1 and hits there,
    one for the base model to rank 2; neither is sent to the other's blocks."""
    server = (await start_cluster([lora_engine(persona, tokenizer_dir)]))[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    feed = feed_of(router)
    doc = words(11, 400)
    full = len(tok.encode(doc)) // BLOCK * BLOCK
    await send(http, server.url, for_adapter(persona, {"prompt": doc}), rank=1)
    await send(http, server.url, {"model": BASE, "prompt": doc}, rank=2)
    blocks = sum(len(server.engine.ranks[r].cache) for r in range(DP))
    assert blocks == 2 * (full // BLOCK)  # two chains: the engine does not share them
    assert await until(lambda: feed.index.size == blocks)
    ids = np.asarray(tok.encode(doc))
    for start, holder in ((root(SQL), 1), (0, 2)):  # each chain where its engine holds it
        keys = prompt_keys(ids, BLOCK, start)
        bits = {rank.bit: rank.name[1] for rank in feed.index.ranks.values()}
        held = feed.index.match(keys, sum(1 << b for b in bits))
        assert {bits[b]: n for b, n in held.items()} == {holder: full // BLOCK}

    lookup = router.parts.lookup
    assert lookup is not None
    pool = router.parts.registry.snapshot.pool()
    label = {t.rank: t.label for t in pool}
    adapter = for_adapter(persona, {"prompt": doc})
    asks = Incoming(adapter, adapter["model"], False, None, "", 0)
    found = await lookup.find("completion", asks, pool, 0.0)
    assert found is not None and found.prefix.held == {label[1]: full}
    found = await lookup.find("completion", incoming(BASE, prompt=doc), pool, 0.0)
    assert found is not None and found.prefix.held == {label[2]: full}

    for i in range(2):
        text = f"{doc} and then question {i}"
        answer = await send(http, router.url, for_adapter(persona, {"prompt": text}))
        assert answer["rank"] == 1
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full
        answer = await send(http, router.url, {"model": BASE, "prompt": text})
        assert answer["rank"] == 2
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full


async def test_sglang_lora_path_runs_the_adapter_and_finds_its_blocks(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tok: ModelTokenizer,  # noqa: F811
) -> None:
    """SGLang's other spelling, ``lora_path`` beside the base model, on /generate."""
    server = (await start_cluster([lora_engine("sglang", tokenizer_dir)]))[0]
    router = await start_router(prefix_config(tokenizer_dir, spec(server)))
    feed = feed_of(router)
    doc = words(12, 400)
    full = len(tok.encode(doc)) // BLOCK * BLOCK
    await send(http, server.url, {"prompt": doc, "lora_path": SQL}, rank=3)
    assert await until(lambda: feed.index.size == full // BLOCK)
    body = {"text": f"{doc} and more", "lora_path": SQL, "sampling_params": {"max_new_tokens": 2}}
    async with http.post(router.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-sim-dp-rank"] == "3"
        assert (await r.json())["meta_info"]["cached_tokens"] == full


async def test_an_adapters_requests_go_only_where_it_is_loaded(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    """vLLM lists a loaded adapter in /v1/models (``parent``: its base): the registry
    learns it there, and the adapter's pool is the workers that list it."""
    plain = lora_engine("vllm", tokenizer_dir)
    cluster = (await start_cluster([replace(plain, lora_modules=()), plain])).servers
    config = prefix_config(tokenizer_dir, *(WorkerSpec(s.url) for s in cluster))
    router = await start_router(config)
    snapshot = router.parts.registry.snapshot
    (without, with_) = sorted(snapshot.workers, key=lambda w: SQL in w.models)
    assert with_.cards[SQL]["parent"] == BASE and SQL not in without.models
    assert {t.worker for t in snapshot.pool("regular", SQL)} == {with_}
    for i in range(8):
        await send(http, router.url, {"model": SQL, "prompt": words(i, 20)})
        await send(http, router.url, {"model": BASE, "prompt": words(i, 20)})

    def count(model: str) -> dict[str, int]:
        return {s.url: sum(r.body.get("model") == model for r in s.received) for s in cluster}

    assert count(SQL) == {without.url: 0, with_.url: 8}
    assert sum(count(BASE).values()) == 8
    assert {t.worker for t in snapshot.pool("regular", BASE)} == {without, with_}


async def test_sglangs_base_colon_adapter_goes_only_where_the_adapter_is_loaded(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
) -> None:
    """SGLang runs ``base:adapter`` with the adapter, and lists a loaded adapter in
    /v1/models (``parent``: its base): such a request's pool is the SGLang workers that
    list the adapter; one none lists is refused in the router, as vLLM's is (404)."""
    plain = lora_engine("sglang", tokenizer_dir)
    cluster = (await start_cluster([replace(plain, lora_modules=()), plain])).servers
    config = prefix_config(tokenizer_dir, *(WorkerSpec(s.url) for s in cluster))
    router = await start_router(config)
    snapshot = router.parts.registry.snapshot
    (without, with_) = sorted(snapshot.workers, key=lambda w: SQL in w.models)
    assert {t.worker for t in snapshot.pool("regular", f"{BASE}:{SQL}")} == {with_}
    assert snapshot.pool("regular", f"{BASE}:nothing") == ()
    assert {t.worker for t in snapshot.pool("regular", f"default:{SQL}")} == {with_}  # any base
    for i in range(8):
        await send(http, router.url, {"model": f"{BASE}:{SQL}", "prompt": words(i, 20)})

    def count(model: str) -> dict[str, int]:
        return {s.url: sum(r.body.get("model") == model for r in s.received) for s in cluster}

    assert count(f"{BASE}:{SQL}") == {without.url: 0, with_.url: 8}
    # SGLang's own /generate names the adapter in lora_path (RL frameworks' LoRA rollouts)
    for i in range(4):
        body = {"text": words(i, 20), "lora_path": SQL, "sampling_params": {"max_new_tokens": 2}}
        async with http.post(router.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
    by_path = {s.url: sum(r.body.get("lora_path") == SQL for r in s.received) for s in cluster}
    assert by_path == {without.url: 0, with_.url: 4}


@pytest.mark.parametrize("persona", PERSONAS)
async def test_an_adapter_loaded_through_the_router_is_routed_to_at_once(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    persona: str,
) -> None:
    """An RL framework loads a LoRA adapter while the engines run (SGLang's
    /load_lora_adapter, vLLM's /v1/load_lora_adapter) through the router, here on one of
    two workers: the router reads that engine's /v1/models again, and the adapter's very
    next requests go only there; unloaded, none does."""
    plain = replace(lora_engine(persona, tokenizer_dir), lora_modules=())
    cluster = (await start_cluster([plain, plain])).servers
    router = await start_router(prefix_config(tokenizer_dir, *(spec(s) for s in cluster)))
    path = "/load_lora_adapter" if persona == "sglang" else "/v1/load_lora_adapter"
    first, second = sorted(router.registry.workers.values(), key=lambda w: w.url)
    loaded = {"lora_name": SQL, "lora_path": "/adapters/sql/step-1"}
    async with http.post(f"{router.url}{path}?worker={first.id}", json=loaded) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert [row["worker"] for row in answer["workers"]] == [first.id]
    assert answer["workers"][0]["models"] == [BASE, SQL]
    assert SQL in first.models and SQL not in second.models
    for i in range(6):
        await send(http, router.url, for_adapter(persona, {"prompt": words(i, 20)}))
    sent = {
        s.url: sum(r.body.get("model") == for_adapter(persona, {})["model"] for r in s.received)
        for s in cluster
    }
    assert sent == {first.url: 6, second.url: 0}
    async with http.get(router.url + "/v1/models") as r:
        assert SQL in {card["id"] for card in (await r.json())["data"]}
    gone = {"lora_name": SQL}
    async with http.post(router.url + path.replace("load", "unload"), json=gone) as r:
        answer = await r.json()  # the second worker never had it: its engine says so
        assert r.status == 200, answer  # every engine that had it unloaded it
    statuses = {row["worker"]: row["status"] for row in answer["workers"]}
    assert statuses == {first.id: 200, second.id: 400 if persona == "sglang" else 404}
    assert SQL not in first.models
    body = {**for_adapter(persona, {"prompt": words(0, 20)}), "max_tokens": 2}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 404, await r.text()  # the router's, for either engine
