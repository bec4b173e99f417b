"""Affinity per model and adapter: an engine caches each LoRA adapter's prompts apart, so
every policy that keeps affinity (to a prefix or a routing key) keeps it per model, its
adapter included. Pure: literal targets, one prompt sent as two adapters and the base."""

from __future__ import annotations

import numpy as np

from dprouter.engines.kvevents import wire
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.lookup import Matcher
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import PolicyOptions, RequestInfo, make_policy

BASE, P, Q = "base", "base:sql", "base:chat"  # as ``Snapshot.named`` writes them
PROMPT = "You are a careful assistant. Answer with the facts only. " * 16  # ~240 tokens
BLOCK = 16


def fleet(workers: int = 2, dp: int = 2) -> tuple[Registry, tuple[Target, ...]]:
    registry = Registry()
    for i in range(workers):
        w = registry.add(Worker(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", dialect="sglang"))
        w.ranks = dp
        registry.mark_ready(w)
    return registry, registry.snapshot.pool()


def asked(model: str, key: str | None = None) -> RequestInfo:
    return RequestInfo(key=key, text=PROMPT, adapter=model, tokens=300)


def test_cache_aware_keeps_one_prompt_apart_per_adapter() -> None:
    """The issue's sequence, P, Q, P, base, Q, on one prompt: each adapter's repeat goes
    where that adapter sent it first, and no adapter follows another's blocks (before,
    all five went where P went)."""
    _, targets = fleet()
    policy = make_policy("cache_aware")
    picks = [policy.select(targets, asked(m)).label for m in (P, Q, P, BASE, Q)]
    assert picks[2] == picks[0] and picks[4] == picks[1]
    assert len({picks[0], picks[1], picks[3]}) == 3
    again = [policy.select(targets, asked(m)).label for m in (BASE, P, Q)]
    assert again == [picks[3], picks[0], picks[1]]


def test_cache_aware_keeps_a_prompt_with_no_model_apart() -> None:
    """No model at all is a name of its own too: a prompt without one is not sent after
    an adapter's blocks."""
    _, targets = fleet()
    policy = make_policy("cache_aware")
    first = policy.select(targets, asked(P)).label
    bare = policy.select(targets, RequestInfo(text=PROMPT, tokens=300)).label
    assert bare != first
    assert policy.select(targets, asked(P)).label == first


def test_consistent_hash_hashes_a_key_per_adapter() -> None:
    """One session key sent as two adapters is two keys: each sticks where its own hash
    says (about 3 in 4 land apart over 4 targets; before, every one shared P's)."""
    _, targets = fleet()
    policy = make_policy("consistent_hash")
    apart = 0
    for i in range(64):
        key = f"session-{i}"
        p, q = policy.select(targets, asked(P, key)), policy.select(targets, asked(Q, key))
        assert policy.select(targets, asked(P, key)) is p  # each sticks
        assert policy.select(targets, asked(Q, key)) is q
        apart += p is not q
    assert 32 <= apart < 64


def test_manual_sticks_a_key_per_adapter() -> None:
    """``min_group`` places a key where fewest are stuck: the session's second adapter is
    a new key, placed apart, and neither moves the other."""
    _, targets = fleet()
    policy = make_policy("manual", PolicyOptions(assignment="min_group"))
    p = policy.select(targets, asked(P, "s"))
    q = policy.select(targets, asked(Q, "s"))
    assert q is not p  # before: the key's one target, whatever the adapter
    assert [policy.select(targets, asked(m, "s")) for m in (P, Q, P)] == [p, q, p]
    assert len(policy.sticky) == 2  # type: ignore[attr-defined]


def test_prefix_policy_reads_each_adapters_chain() -> None:
    """``prefix`` reads what the KV index says each target holds of the prompt in the
    adapter's own chain (rank 0 holds it for one adapter, rank 1 for the other) and what
    the router sent since (pending, per chain too): each adapter goes to its holder."""
    registry, targets = fleet(1, 3)
    (worker,) = registry.snapshot.workers
    worker.dialect = "vllm"  # vLLM's adapter is a model of its own name
    worker.cards = {m: {"id": m, "parent": p} for m, p in ((BASE, None), ("sql", BASE))}
    worker.cards["chat"] = {"id": "chat", "parent": BASE}
    index = KvIndex()
    ids = np.arange(100, 100 + 8 * BLOCK)
    for rank, adapter in enumerate(("sql", "chat")):
        event = wire.Stored([rank * 10 + i for i in range(8)], None, ids.tolist(), BLOCK, adapter)
        index.apply(index.rank("w0", rank), [event])
    other = wire.Stored([99], None, list(range(BLOCK)), BLOCK, None)  # rank 2: another prompt
    index.apply(index.rank("w0", 2), [other])
    matcher = Matcher(index)
    policy = make_policy("prefix")
    chose = {}
    for adapter in ("sql", "chat"):
        found = matcher.match(targets, ids, 0.0, {"vllm": adapter})
        info = RequestInfo(text=PROMPT, tokens=len(ids), adapter=adapter, prefix=found.prefix)
        chose[adapter] = policy.select(targets, info).label
    assert chose == {"sql": "w0/0", "chat": "w0/1"}
    sql = matcher.match(targets, ids, 1.0, {"vllm": "sql"})
    matcher.sent(sql, targets[2], 1.0)  # now pending on rank 2, in sql's chain only
    assert matcher.match(targets, ids, 1.0, {"vllm": "sql"}).prefix.held.keys() == {"w0/0", "w0/2"}
    assert matcher.match(targets, ids, 1.0, {"vllm": "chat"}).prefix.held.keys() == {"w0/1"}
