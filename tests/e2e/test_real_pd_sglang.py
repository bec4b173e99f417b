"""dprouter's ``--pd sglang`` in front of real SGLang 0.5.23 P/D engines on the CPU, the KV
moving over Mooncake's TCP transport (``bash e2e/pd/prepare.sh`` prepares them).

The fleet: two prefill workers of two DP replicas each and a decode of two DP replicas,
so that both roles have several slots and one has several workers. What happened is read
from the engines: each prefill rank counts the transfers it sent
(``sglang:kv_transfer_latency_ms``) and the prefill tokens it computed (``/v1/loads``),
each decode rank the transfers it received (``sglang:kv_transfer_bootstrap_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from e2e.pd.pair import SglangPd

from dprouter.bench.scenarios.aliasing import coverage, dprouter_slots, old_scheme
from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from tests.conftest import StartRouter, metric_by, metric_sum
from tests.e2e.answers import ask, loads, prompt
from tests.e2e.conftest import SUMMARY

pytestmark = [pytest.mark.realpd, pytest.mark.timeout(900)]
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
SENT = "sglang:kv_transfer_latency_ms_count"  # a prefill rank sent a request's KV
TAKEN = "sglang:kv_transfer_bootstrap_ms_count"  # a decode rank took one
METRICS = ("--enable-metrics",)


@dataclass
class Fleet:
    prefills: list[SglangPd]
    decode: SglangPd
    stack: contextlib.ExitStack  # an engine started here is stopped with the others


def body(path: str, stream: bool, text: str | None = None) -> dict[str, Any]:
    text = text or prompt()
    if path == "/generate":
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        return {"text": text, "sampling_params": params, "stream": stream}
    common = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": stream}
    if path == "/v1/completions":
        return {**common, "prompt": text}
    return {**common, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Two real SGLang prefill workers of two DP replicas, one decode of two (about 100 s
    to start on two cores, 7 GB)."""
    with contextlib.ExitStack() as stack:
        prefills = [
            stack.enter_context(SglangPd("prefill", dp_size=2, extra_args=METRICS))
            for _ in range(2)
        ]
        decode = stack.enter_context(SglangPd("decode", dp_size=2, extra_args=METRICS))
        for engine in (*prefills, decode):
            engine.wait_ready(600)
        yield Fleet(prefills, decode, stack)


def router_config(fleet: Fleet, **options: Any) -> RouterConfig:
    prefills, decode = fleet.prefills, fleet.decode
    workers = (
        *(WorkerSpec(p.url, role="prefill") for p in prefills),
        WorkerSpec(decode.url, role="decode"),
    )
    # no /health checks: SGLang answers one by running a generation
    return RouterConfig(pd="sglang", workers=workers, health_interval=0, **options)


async def slots(http: aiohttp.ClientSession, fleet: Fleet) -> dict[str, float]:
    """What every slot's engine counted: ``p<i>/<rank>`` transfers sent, ``d0/<rank>``
    transfers taken."""
    out: dict[str, float] = {}
    for i, engine in enumerate(fleet.prefills):
        for rank, n in (await metric_by(http, engine.url, SENT, "dp_rank")).items():
            out[f"p{i}/{rank}"] = n
    for rank, n in (await metric_by(http, fleet.decode.url, TAKEN, "dp_rank")).items():
        out[f"d0/{rank}"] = n
    return out


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {slot: int(after[slot] - before.get(slot, 0)) for slot in sorted(after)}


async def uncached(http: aiohttp.ClientSession, engine: SglangPd) -> dict[int, int]:
    return {
        r: x["total_prefill_uncached_tokens"] for r, x in (await loads(http, engine.url)).items()
    }


async def decoding(http: aiohttp.ClientSession, engine: SglangPd) -> int:
    return sum(x["num_running_reqs"] for x in (await loads(http, engine.url)).values())


async def waiting(http: aiohttp.ClientSession, engine: SglangPd) -> int:
    """Requests an SGLang engine holds, on every rank, in any queue (P/D's included)."""
    held = 0
    for rank in (await loads(http, engine.url)).values():
        held += rank.get("num_running_reqs", 0) + rank.get("num_waiting_reqs", 0)
        queues = rank.get("disaggregation") or {}
        held += sum(v for k, v in queues.items() if k.endswith("_queue_reqs"))
    return held


async def test_sglang_pd_serves_120_requests_on_every_slot_evenly_with_no_refusal(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Every path, streamed and not, 4 at a time, ``round_robin`` on both roles: all
    answered, each of the 4 prefill ranks sent 30 requests' KV and each of the 2 decode
    ranks took 60 (the engines' own counts), every prefill rank computed, no engine
    refused, no target went out. (Round robin turns per pool, a role and a model: the
    40 ``/generate`` requests name no model, the 80 others name one, and each count is a
    multiple of the 4 slots.)"""
    prefills, decode = fleet.prefills, fleet.decode
    router = await start_router(router_config(fleet))
    # every (prefill, decode) pair meets once, one at a time, before the concurrent load:
    # in 1 of 5 runs one of the first concurrent requests after start-up never finished
    # its bootstrap on SGLang 0.5.23 (prefill and decode each waiting for the other)
    for _ in range(8):
        status, _, text = await ask(http, router.url, "/generate", body("/generate", False))
        assert status == 200, text
    before, computed_before = await slots(http, fleet), [await uncached(http, p) for p in prefills]
    gate = asyncio.Semaphore(4)
    n = 120

    async def one(i: int) -> tuple[str, str]:
        path, stream = PATHS[i % 3], (i // 3) % 2 == 1
        async with gate:
            status, headers, text = await ask(http, router.url, path, body(path, stream))
        assert status == 200, text
        assert '"error"' not in text, text
        return headers["x-dprouter-prefill"], headers["x-dprouter-target"]

    started = time.monotonic()
    pairs = await asyncio.gather(*(one(i) for i in range(n)))
    took = time.monotonic() - started
    errors = await metric_sum(http, router.url, "dprouter_upstream_errors_total")
    chosen = Counter(p for p, _ in pairs)
    assert errors == 0 and chosen == {f"p{i}/{r}": n // 4 for i in range(2) for r in range(2)}
    counted = grew(before, await slots(http, fleet))
    for _ in range(50):  # each scheduler publishes its counts on its own beat
        if sum(counted.values()) == 2 * n:
            break
        await asyncio.sleep(0.1)
        counted = grew(before, await slots(http, fleet))
    assert counted == {
        **{f"p{i}/{r}": n // 4 for i in range(2) for r in range(2)},
        **{f"d0/{r}": n // 2 for r in range(2)},
    }
    assert len(set(pairs)) == 8  # every (prefill, decode) pair, not locked together
    for engine, was in zip(prefills, computed_before, strict=True):
        now = await uncached(http, engine)
        assert all(now[rank] > was[rank] for rank in now), (was, now)
    assert not any(t.tripped for t in router.registry.targets())
    assert await metric_sum(http, decode.url, "sglang:num_transfer_failed_reqs_total") == 0
    SUMMARY.append(
        f"SGLang P/D, 2 prefill x DP 2 + decode DP 2: {n} requests over {len(PATHS)} paths in "
        f"{took:.0f} s; KV transfers the engines counted per slot {counted}; 0 refused"
    )


async def test_aliasing_on_the_real_fleet_the_old_scheme_leaves_half_the_prefill_ranks_idle(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The seed's measurement, on real engines: the toy proxy's scheme (instance ``n % N``,
    rank ``n % dp``) sends 2 x DP 2 prefill traffic to 2 of its 4 slots; dprouter's
    ``round_robin`` to all 4. Counted by the prefill engines themselves, beside the
    same shape computed as ``dprouter bench aliasing`` does."""
    prefills, decode = fleet.prefills, fleet.decode
    n, rng = 16, random.Random(0)

    async def old(k: int) -> None:  # the toy proxy: both legs at once, ranks aliased
        i, rank = old_scheme(k, 2, 2)
        text = prompt()
        room = rng.randrange(1 << 40) * 2 + rank  # room % dp == rank, as SGLang wants
        meet = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefills[i].bootstrap_port,
            "bootstrap_room": room,
            "disagg_prefill_dp_rank": rank,
        }
        legs = (
            ask(http, prefills[i].url, "/generate", {**body("/generate", False, text), **meet}),
            ask(http, decode.url, "/generate", {**body("/generate", False, text), **meet}),
        )
        answers = await asyncio.gather(*(asyncio.wait_for(leg, 120) for leg in legs))
        assert [status for status, _, _ in answers] == [200, 200], answers

    before = await slots(http, fleet)
    for k in range(n):
        await old(k)
    old_counted = grew(before, await slots(http, fleet))
    router = await start_router(router_config(fleet))
    before = await slots(http, fleet)
    for _ in range(n):
        status, _, text = await ask(http, router.url, "/generate", body("/generate", False))
        assert status == 200, text
    new_counted = grew(before, await slots(http, fleet))

    def used(counted: dict[str, int]) -> int:
        return sum(1 for slot, k in counted.items() if slot.startswith("p") and k > 0)

    assert (used(old_counted), used(new_counted)) == (2, 4)
    _, computed_idle = coverage([old_scheme(k, 2, 2) for k in range(n)], 4)
    computed_new = Counter(dprouter_slots(2, 2, n))
    assert computed_idle == 0.5 and set(computed_new.values()) == {n // 4}
    SUMMARY.append(
        f"aliasing, real prefill 2 x DP 2, {n} requests: the old scheme used {used(old_counted)}"
        f" of 4 prefill slots {old_counted}, dprouter 4 of 4 {new_counted}; computed "
        f"(bench aliasing): old {1 - computed_idle:.0%} of the slots, dprouter 100%"
    )


async def test_sglang_pd_a_session_key_keeps_its_pair(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(router_config(fleet, sessions=True))
    pairs: dict[str, set[tuple[str, str]]] = {"alice": set(), "bob": set()}
    for i in range(8):
        key = "alice" if i % 2 else "bob"
        path = PATHS[i % 3]
        status, headers, text = await ask(
            http, router.url, path, body(path, False), {"X-Session-ID": key}
        )
        assert status == 200, text
        pairs[key].add((headers["x-dprouter-prefill"], headers["x-dprouter-target"]))
    assert all(len(seen) == 1 for seen in pairs.values()), pairs
    assert pairs["alice"] != pairs["bob"]  # two keys, placed on the least loaded pairs


async def test_sglang_pd_requests_wait_in_the_router_for_a_decode_slot(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """One running slot per decode rank (``--dispatch-slots 1``): of 6 requests sent at
    once, the decode runs 2 at a time (its own count, polled throughout), the router
    holds the rest, and all 6 are answered whole (their usage, streams' too)."""
    router = await start_router(router_config(fleet, dispatch_slots=1))
    proxy = router.parts.proxy
    assert proxy is not None
    most, held_most = 0, 0

    async def watch() -> None:
        nonlocal most, held_most
        for _ in range(3000):  # bounded: the requests take seconds
            most = max(most, await decoding(http, fleet.decode))
            held_most = max(held_most, proxy.parts.dispatch.held)
            await asyncio.sleep(0.02)

    watching = asyncio.create_task(watch())
    long = {"max_tokens": 64, "ignore_eos": True}
    usage = {"stream_options": {"include_usage": True}}
    try:
        answers = await asyncio.gather(
            *(
                ask(
                    http,
                    router.url,
                    "/v1/completions",
                    {**body("/v1/completions", s), **long, **(usage if s else {})},
                )
                for s in (False, True) * 3
            )
        )
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert [status for status, _, _ in answers] == [200] * 6, answers
    assert all(finished(status, text, 64) for status, _, text in answers), answers
    assert 1 <= most <= 2 and held_most >= 3, (most, held_most)
    SUMMARY.append(
        f"SGLang P/D, --dispatch-slots 1 on a decode of DP 2, 6 requests at once: the decode "
        f"ran at most {most} (its own count), the router held up to {held_most}; 6 of 6 served"
    )


def finished(status: int, text: str, tokens: int) -> bool:
    """Whether ``text`` is a whole completion of ``tokens`` tokens, its usage counted by
    the engine (a stream's in its last chunk), and no error."""
    if status != 200 or '"error"' in text:
        return False
    if text.startswith("data:"):
        chunks = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
        text = chunks[-1] if chunks else "{}"
    usage = json.loads(text).get("usage") or {}
    return usage.get("completion_tokens") == tokens


async def test_sglang_pd_a_killed_decode_fails_requests_clearly_and_recovers(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Requests in flight when the decode dies get an error, a request sent while it is
    down does not wait on the prefill's bootstrap timeout (300 s), the prefills are left
    with nothing queued, and once a decode runs there again requests are served."""
    prefills, decode = fleet.prefills, fleet.decode
    router = await start_router(router_config(fleet))
    tokens = 1500  # half a minute of decoding here
    endless = {"max_tokens": tokens, "ignore_eos": True}
    usage = {"stream_options": {"include_usage": True}}
    long = [
        asyncio.create_task(
            ask(
                http,
                router.url,
                "/v1/completions",
                {**body("/v1/completions", s), **endless, **(usage if s else {})},
            )
        )
        for s in (False, True, False, True)
    ]
    for _ in range(300):  # all four decoding (the decode's own count), however slow
        if (running := await decoding(http, decode)) >= 4:
            break
        await asyncio.sleep(0.2)
    assert running == 4
    decode.kill()
    try:
        started = time.monotonic()
        answers = await asyncio.wait_for(asyncio.gather(*long), 60)
        down = await asyncio.wait_for(
            asyncio.gather(*(ask(http, router.url, p, body(p, False)) for p in PATHS)), 60
        )
        waited = time.monotonic() - started
        # A long request may have ended before the kill: once, on CI, one of the four
        # was whole. Such an answer must be all its tokens, counted by the engine; the
        # others, in flight, an error (a stream's in its last event).
        whole = [finished(status, text, tokens) for status, _, text in answers]
        cut = [a for a, w in zip(answers, whole, strict=True) if not w]
        assert cut, "no request was in flight when the decode died"
        for status, _, text in cut + down:
            assert status >= 500 or '"error"' in text, (status, text[-300:])
        for engine in prefills:
            for _ in range(100):
                if (held := await waiting(http, engine)) == 0:
                    break
                await asyncio.sleep(0.2)
            assert held == 0  # nothing left on a prefill
    finally:  # the next tests want a decode, whatever happened here
        decode.stop()
        fleet.decode = fleet.stack.enter_context(
            SglangPd("decode", port=decode.port, dp_size=2, extra_args=METRICS)
        )
        fleet.decode.wait_ready(600)
    for _ in range(60):  # the router finds it again on its own
        status, _, text = await ask(
            http, router.url, "/v1/completions", body("/v1/completions", False)
        )
        if status == 200:
            break
        await asyncio.sleep(2)
    assert status == 200, text
    statuses = sorted(status for status, _, _ in cut + down)
    SUMMARY.append(
        f"SGLang P/D, decode killed under 4 requests ({sum(whole)} already whole), 3 more "
        f"sent while down: HTTP {statuses} within {waited:.1f} s, the prefills left with "
        "nothing queued; served again once a decode came back"
    )


async def test_sglang_pd_a_killed_prefill_is_passed_over_for_the_other(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Last, it leaves the fleet short: prefill worker 1 killed, every request is served,
    by prefill worker 0, and the router says why it took worker 1 out."""
    router = await start_router(router_config(fleet))
    fleet.prefills[1].kill()
    chosen = Counter[str]()
    for i in range(8):
        path = PATHS[i % 3]
        status, headers, text = await ask(http, router.url, path, body(path, i % 2 == 1))
        assert status == 200, text
        chosen[headers["x-dprouter-prefill"]] += 1
    assert set(chosen) <= {"p0/0", "p0/1"}
    assert router.registry.workers["p1"].state != "ready"
    SUMMARY.append(f"SGLang P/D, prefill worker 1 killed: 8 of 8 served, by {dict(chosen)}")
