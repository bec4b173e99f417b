"""dprouter's ``--pd vllm-mooncake`` in front of a real vLLM CPU 0.32 pair, the KV moving
over Mooncake's TCP transport (``bash e2e/pd/prepare.sh`` prepares it).

What happened is read from the engines: which prefill rank ran (vLLM's per-engine
``request_success_total``), that the decode computed none of the prompt (its
``prompt_tokens_by_source``), that its greedy answer is the plain run's.

On two cores the decode is not bound to a core (``nobind``) while the prefill's two
ranks are: a decode bound to a rank's core starved that rank (a vLLM decode waiting for
KV polls without pause), and its requests took 8-60 s or never finished.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from e2e.pd.pair import VllmPd

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from tests.conftest import StartRouter, metric_by, metric_sum
from tests.e2e.answers import ask, prompt
from tests.e2e.conftest import SUMMARY

pytestmark = [pytest.mark.realpd, pytest.mark.timeout(900)]
PATHS = ("/v1/completions", "/v1/chat/completions")
RAN = "vllm:request_success_total"  # requests a prefill rank (vLLM's engine label) finished


def body(path: str, stream: bool, text: str) -> dict[str, Any]:
    common = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream}
    if path == "/v1/completions":
        return {**common, "prompt": text}
    return {**common, "messages": [{"role": "user", "content": text}]}


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
    for path, stream in itertools.product(PATHS, (False, True)):
        before = await metric_by(http, decode.url, name, "source")
        ran_before = await metric_by(http, prefill.url, RAN, "engine")
        text = prompt()
        status, headers, answer = await ask(http, router.url, path, body(path, stream, text))
        assert status == 200, answer
        after = await metric_by(http, decode.url, name, "source")
        ran_after = await metric_by(http, prefill.url, RAN, "engine")
        ran = [e for e in ran_after if ran_after[e] > ran_before.get(e, 0)]
        assert [f"p0/{e}" for e in ran] == [headers["x-dprouter-prefill"]], (ran, headers)
        ranks[headers["x-dprouter-prefill"]] += 1
        plain_status, _, plain = await ask(http, prefill.url, path, body(path, False, text))
        assert plain_status == 200, plain
        assert said(answer, stream) == said(plain, False), (answer[:300], plain[:300])
        grew = {s: after[s] - before[s] for s in ("external_kv_transfer", "local_compute")}
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
