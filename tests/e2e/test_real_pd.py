"""dprouter in front of real prefill/decode pairs on the CPU, the KV moving over Mooncake's TCP.

What happened is read from the engines themselves: which prefill rank ran a request (its
``/v1/loads`` counts), that the KV moved (SGLang's prefill records each transfer in
``sglang:kv_transfer_latency_ms``; vLLM's decode counts prompt tokens by source), that
the decode's greedy output is the plain run's. ``bash e2e/pd/prepare.sh`` prepares them.

On two cores the vLLM decode is not bound to a core (``nobind``) while the prefill's two
ranks are: a decode bound to a rank's core starved that rank (a vLLM decode waiting for
KV polls without pause), and its requests took 8-60 s or never finished.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from e2e.pd.pair import SglangPd, VllmPd

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from tests.conftest import StartRouter, metric_sum
from tests.e2e.conftest import SUMMARY

pytestmark = [pytest.mark.realpd, pytest.mark.timeout(900)]
NONCE = itertools.count()
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def prompt() -> str:
    n = next(NONCE)
    return f"pair {n} carries the cache {n % 5} ways from prefill {n % 3} to decode"


def body(path: str, stream: bool, text: str | None = None, tokens: int = 4) -> dict[str, Any]:
    text = text or prompt()
    if path == "/generate":
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        return {"text": text, "sampling_params": params, "stream": stream}
    common = {"model": "tiny", "max_tokens": tokens, "temperature": 0, "stream": stream}
    if path == "/v1/completions":
        return {**common, "prompt": text}
    return {**common, "messages": [{"role": "user", "content": text}]}


async def ask(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    sent: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    async with http.post(url + path, json=sent, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.text()


def series(text: str, name: str) -> float:
    """The sum of a Prometheus series' samples (0 when absent)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


async def uncached(http: aiohttp.ClientSession, engine: SglangPd) -> dict[int, int]:
    async with http.get(engine.url + "/v1/loads") as r:
        return {x["dp_rank"]: x["total_prefill_uncached_tokens"] for x in (await r.json())["loads"]}


async def waiting(http: aiohttp.ClientSession, engine: SglangPd) -> int:
    """Requests an SGLang engine holds, on every rank, in any queue (P/D's included)."""
    async with http.get(engine.url + "/v1/loads") as r:
        loads = (await r.json())["loads"]
    held = 0
    for rank in loads:
        held += rank.get("num_running_reqs", 0) + rank.get("num_waiting_reqs", 0)
        queues = rank.get("disaggregation") or {}
        held += sum(v for k, v in queues.items() if k.endswith("_queue_reqs"))
    return held


@pytest.fixture(scope="module")
def sglang_pair() -> Iterator[tuple[SglangPd, SglangPd]]:
    """A real SGLang prefill with two DP replicas and a one-rank decode."""
    metrics = ("--enable-metrics",)
    with (
        SglangPd("prefill", dp_size=2, extra_args=metrics) as prefill,
        SglangPd("decode", extra_args=metrics) as decode,
    ):
        prefill.wait_ready(400)
        decode.wait_ready(400)
        yield prefill, decode


@pytest.fixture(scope="module")
def vllm_pair() -> Iterator[tuple[VllmPd, VllmPd]]:
    """A real vLLM Mooncake prefill with two DP ranks, a core each, and a decode."""
    with (
        VllmPd("prefill", dp_size=2, cpus="0|1") as prefill,
        VllmPd("decode", cpus="nobind") as decode,
    ):
        prefill.wait_ready(400)
        decode.wait_ready(400)
        yield prefill, decode


def sglang_router(prefill: SglangPd, decode: SglangPd, **options: Any) -> RouterConfig:
    workers = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
    # no /health checks: SGLang answers one by running a generation
    return RouterConfig(pd="sglang", workers=workers, health_interval=0, **options)


async def test_sglang_pd_serves_100_requests_on_both_prefill_ranks_with_no_refusal(
    sglang_pair: tuple[SglangPd, SglangPd], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Every path, streamed and not, 4 at a time: all answered, both prefill ranks ran
    their share (the engine's own counts), no engine refused and no target went out, and
    the prefill sent the KV of every request to the decode."""
    prefill, decode = sglang_pair
    router = await start_router(sglang_router(prefill, decode))
    before = await uncached(http, prefill)
    sent_before = series(await scrape(http, prefill.url), "sglang:kv_transfer_latency_ms_count")
    gate = asyncio.Semaphore(4)
    n = 100

    async def one(i: int) -> tuple[str, str]:
        path, stream = PATHS[i % 3], (i // 3) % 2 == 1
        async with gate:
            status, headers, text = await ask(http, router.url, path, body(path, stream))
        assert status == 200, text
        assert '"error"' not in text, text
        return path, headers["x-dprouter-prefill"]

    started = time.monotonic()
    done = await asyncio.gather(*(one(i) for i in range(n)))
    took = time.monotonic() - started
    chosen = Counter(label for _, label in done)
    assert chosen == {"p0/0": n // 2, "p0/1": n // 2}
    after = await uncached(http, prefill)
    rose = {rank: after[rank] - before[rank] for rank in after}
    assert all(v > 0 for v in rose.values()) and len(rose) == 2, rose
    share = min(rose.values()) / sum(rose.values())
    assert share > 0.35, rose  # even prompts, even turns: each rank computed about half
    assert await metric_sum(http, router.url, "dprouter_upstream_errors_total") == 0
    assert not any(t.tripped for t in router.registry.targets())
    prefill_metrics = await scrape(http, prefill.url)
    sent = series(prefill_metrics, "sglang:kv_transfer_latency_ms_count") - sent_before
    failed = series(await scrape(http, decode.url), "sglang:num_transfer_failed_reqs_total")
    assert (sent, failed) == (n, 0)
    SUMMARY.append(
        f"SGLang P/D, prefill DP 2 + decode: {n} requests over {len(PATHS)} paths in {took:.0f} s"
        f", router chose {dict(chosen)}, prefill ranks computed {rose} uncached tokens, "
        f"{sent:.0f} KV transfers, 0 refused"
    )


async def test_sglang_pd_a_session_key_keeps_its_prefill_rank(
    sglang_pair: tuple[SglangPd, SglangPd], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sglang_pair
    router = await start_router(sglang_router(prefill, decode, sessions=True))
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


async def test_sglang_pd_a_killed_decode_fails_requests_clearly_and_recovers(
    sglang_pair: tuple[SglangPd, SglangPd], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Requests in flight when the decode dies get an error, none hangs on the prefill's
    bootstrap wait (300 s), and once a decode runs there again requests are served."""
    prefill, decode = sglang_pair
    router = await start_router(sglang_router(prefill, decode))
    endless = {"max_tokens": 1500, "ignore_eos": True}  # a minute of decoding, at least
    long = [
        asyncio.create_task(
            ask(http, router.url, "/v1/completions", {**body("/v1/completions", s), **endless})
        )
        for s in (False, True, False, True)
    ]
    await asyncio.sleep(3)  # all four decoding
    decode.kill()
    started = time.monotonic()
    answers = await asyncio.wait_for(asyncio.gather(*long), 60)
    # and while it is gone: the prefill leg of each new request must not wait for a decode
    # that never comes (SGLang's prefill would hold it for its 300 s bootstrap timeout)
    answers += await asyncio.wait_for(
        asyncio.gather(*(ask(http, router.url, p, body(p, False)) for p in PATHS)), 60
    )
    waited = time.monotonic() - started
    for status, _, text in answers:
        # an answer already streaming ends with an error event; the others are errors
        assert status >= 500 or '"error"' in text, (status, text[:200])
    for _ in range(100):
        if (held := await waiting(http, prefill)) == 0:
            break
        await asyncio.sleep(0.2)
    assert held == 0  # no request left on the prefill
    decode.stop()
    back = SglangPd("decode", port=decode.port, extra_args=("--enable-metrics",))
    with back:
        back.wait_ready(400)
        for _ in range(60):  # the router finds it again on its own
            status, _, text = await ask(
                http, router.url, "/v1/completions", body("/v1/completions", False)
            )
            if status == 200:
                break
            await asyncio.sleep(2)
        assert status == 200, text
        statuses = sorted(status for status, _, _ in answers)
        SUMMARY.append(
            f"SGLang P/D, decode killed under 4 requests, 3 more sent while down: HTTP "
            f"{statuses} within {waited:.1f} s, the prefill left with nothing queued; "
            "served again once a decode came back"
        )


async def test_vllm_mooncake_moves_the_kv_and_the_decode_answers_as_a_plain_run(
    vllm_pair: tuple[VllmPd, VllmPd], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Through ``--pd vllm-mooncake``: the prefill runs on the rank the router chose (the
    engine's own per-rank counts), the decode computes none of the prompt (its
    ``external_kv_transfer`` tokens rise by the prompt's, ``local_compute`` not at all: it
    pulled from that rank's engine) and its greedy answer is the one the prefill engine
    gives when run plainly."""
    prefill, decode = vllm_pair
    workers = (
        WorkerSpec(prefill.url, role="prefill", bootstrap_port=prefill.bootstrap_port),
        WorkerSpec(decode.url, role="decode"),
    )
    router = await start_router(RouterConfig(pd="vllm-mooncake", workers=workers))
    name = "vllm:prompt_tokens_by_source_total"
    moved = computed = prompts = 0
    ranks: Counter[str] = Counter()
    for path, stream in itertools.product(PATHS[1:], (False, True)):
        before, ran_before = await scrape(http, decode.url), await finished(http, prefill)
        text = prompt()
        status, headers, answer = await ask(http, router.url, path, body(path, stream, text, 8))
        assert status == 200, answer
        after, ran_after = await scrape(http, decode.url), await finished(http, prefill)
        ran = [e for e in ran_after if ran_after[e] > ran_before.get(e, 0)]
        assert [f"p0/{e}" for e in ran] == [headers["x-dprouter-prefill"]], (ran, headers)
        ranks[headers["x-dprouter-prefill"]] += 1
        plain_status, _, plain = await ask(http, prefill.url, path, body(path, False, text, 8))
        assert plain_status == 200, plain
        assert said(answer, stream) == said(plain, False), (answer[:300], plain[:300])
        grew = {
            source: series(after, f'{name}{{engine="0",model_name="tiny",source="{source}"}}')
            - series(before, f'{name}{{engine="0",model_name="tiny",source="{source}"}}')
            for source in ("external_kv_transfer", "local_compute")
        }
        tokens = prompt_tokens(plain)
        assert grew == {"external_kv_transfer": tokens, "local_compute": 0}, (path, grew)
        moved, computed, prompts = (
            moved + int(grew["external_kv_transfer"]),
            computed + int(grew["local_compute"]),
            prompts + tokens,
        )
    assert ranks == {"p0/0": 2, "p0/1": 2}
    assert await metric_sum(http, router.url, "dprouter_upstream_errors_total") == 0
    SUMMARY.append(
        f"vLLM Mooncake P/D, prefill DP 2 + decode: 4 requests on prefill ranks "
        f"{dict(ranks)} (the engine's counts), decode took {moved} of {prompts} prompt tokens over "
        f"the transfer, computed {computed}; greedy answers equal the plain run's"
    )


async def finished(http: aiohttp.ClientSession, engine: VllmPd) -> dict[str, float]:
    """Requests each DP rank (vLLM's ``engine`` label) finished."""
    text = await scrape(http, engine.url)
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^vllm:request_success_total{([^}]*)} (\S+)$", text, re.M):
        rank = re.search(r'engine="(\d+)"', labels)
        if rank is not None:
            out[rank[1]] = out.get(rank[1], 0.0) + float(value)
    return out


def said(answer: str, stream: bool) -> str:
    """The generated text of an OpenAI answer, whole or streamed."""
    if not stream:
        choice = json.loads(answer)["choices"][0]
        return str(choice.get("text") or choice["message"]["content"])
    out = []
    for line in answer.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"]
            if choice:
                out.append(choice[0].get("text") or choice[0].get("delta", {}).get("content") or "")
    return "".join(out)


def prompt_tokens(answer: str) -> int:
    return int(json.loads(answer)["usage"]["prompt_tokens"])
