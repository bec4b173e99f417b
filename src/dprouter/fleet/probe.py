"""Ask a worker what it is: dialect, DP ranks, DP attention, models (its load: ``engine_load``).

SGLang answers ``/server_info`` (older ``/get_server_info``) in one of two
shapes (``sglang_ranks``). vLLM has no such endpoint in production; its
``/metrics`` series carry one ``engine`` label per DP rank, so the ranks are
the distinct labels (a hybrid-LB endpoint shows only its local ranks, the
lowest label being its offset).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from dprouter.core.errors import Contradiction, DiscoveryError
from dprouter.core.types import DialectName
from dprouter.fleet.targets import Worker


@dataclass(frozen=True)
class Discovered:
    dialect: DialectName
    ranks: int | None  # None: the engine does not say
    rank_offset: int
    dp_attention: bool
    cards: tuple[dict[str, Any], ...]  # the engine's /v1/models entries, as it wrote them
    tp_size: int | None = None
    bootstrap_port: int | None = None  # SGLang prefill
    role: str | None = None  # SGLang's disaggregation_mode, when it says
    weight_version: str | None = None  # SGLang's /model_info says it

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(card["id"] for card in self.cards)


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url) as r:
        return r.status, await r.read()


async def server_info(session: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
    for path in ("/server_info", "/get_server_info"):
        status, body = await _get(session, base + path)
        if status == 200:
            info = orjson.loads(body)
            if isinstance(info, dict) and "dp_size" in info:
                return info
    return None


def engine_series(text: str) -> dict[str, dict[int, float]]:
    """``{series: {engine label: value}}`` for vLLM's per-engine series."""
    out: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            label = s.labels.get("engine")
            if label is not None and label.isdigit():
                per = out.setdefault(s.name, {})
                per[int(label)] = per.get(int(label), 0.0) + s.value
    return out


async def vllm_engines(session: aiohttp.ClientSession, base: str) -> list[int]:
    status, body = await _get(session, base + "/metrics")
    if status != 200:
        return []
    labels: set[int] = set()
    for per in engine_series(body.decode()).values():
        labels.update(per)
    return sorted(labels)


async def models(session: aiohttp.ClientSession, base: str) -> tuple[dict[str, Any], ...]:
    """The engine's model cards (``GET /v1/models``), each with a string ``id``."""
    try:
        status, body = await _get(session, base + "/v1/models")
        data = orjson.loads(body)["data"] if status == 200 else []
        return tuple(m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ()


async def probe(session: aiohttp.ClientSession, worker: Worker) -> Discovered:
    """Raises ``DiscoveryError`` (try again later), ``Contradiction`` (give up),
    or aiohttp / timeout errors (unreachable: try again later)."""
    base = worker.url
    # both signatures, whatever the configuration says: a worker configured as one kind
    # that answers as the other is refused (_settle), not retried forever
    info = await server_info(session, base)
    if info is not None:
        found = sglang_found(base, info, await models(session, base))
        version = await weight_version(session, base)
        return _settle(worker, replace(found, weight_version=version))
    labels = await vllm_engines(session, base)
    if labels:
        if labels != list(range(labels[0], labels[0] + len(labels))):
            raise Contradiction(f"{base}/metrics shows non-contiguous engine labels {labels}")
        found = Discovered("vllm", len(labels), labels[0], False, await models(session, base))
        version = await weight_version(session, base, "/weight_info")
        return _settle(worker, replace(found, weight_version=version))
    if worker.dialect is not None and worker.dp_size is not None:
        # the engine says nothing about its ranks: the configuration stands alone
        return _settle(
            worker, Discovered(worker.dialect, None, 0, False, await models(session, base))
        )
    if worker.dialect == "sglang":
        raise DiscoveryError(f"{base} answers neither /server_info nor /get_server_info")
    raise DiscoveryError(
        f"{base} answers neither /server_info (SGLang) nor /metrics with vLLM engine labels; "
        "set its dialect and dp_size explicitly"
    )


async def weight_version(
    session: aiohttp.ClientSession, base: str, path: str = "/model_info"
) -> str | None:
    """The weights' version: SGLang's ``/model_info`` tells it (``/server_info`` has the
    one it started with, not the one an update set), vLLM's ``/weight_info`` (its RL
    routes, with ``VLLM_SERVER_DEV_MODE=1``; else 404: None)."""
    try:
        status, body = await _get(session, base + path)
        said = orjson.loads(body).get("weight_version") if status == 200 else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return None if said is None else str(said)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def sglang_ranks(base: str, info: dict[str, Any]) -> tuple[int, bool]:
    """Routable ranks behind an SGLang worker, and whether they step in lock-step.

    Two shapes are in use. Older SGLang counts attention-DP ranks in ``dp_size``
    with ``enable_dp_attention: true``. SGLang 0.5.23 moved that count to
    ``attn_dp_size`` (``--attn-dp-size N``; the old flags resolve into it) and
    reports ``dp_size: 1``: ``dp_size`` counts independent replicas again, and
    ``enable_dp_attention`` is kept for old clients as ``attn_dp_size > 1``. A
    body ``routed_dp_rank`` ranges over ``dp_size * attn_dp_size`` (SGLang's
    ``num_dp_ranks``) in both. Anything else is refused with what it said.
    """
    dp: Any = info.get("dp_size")
    attn: Any = info.get("attn_dp_size", 1)
    flag = info.get("enable_dp_attention", False)
    problem = None
    if not (_positive(dp) and _positive(attn) and isinstance(flag, bool)):
        problem = "dp_size and attn_dp_size must be positive integers, enable_dp_attention a bool"
    elif dp > 1 and attn > 1:
        problem = "SGLang runs data-parallel replicas or attention DP, not both"
    elif attn > 1 and "enable_dp_attention" in info and not flag:
        problem = "attention DP over several ranks, yet enable_dp_attention is false"
    if problem is not None:
        names = ("dp_size", "attn_dp_size", "enable_dp_attention")
        seen = ", ".join(f"{k}={info[k]!r}" for k in names if k in info)
        raise Contradiction(f"{base}/server_info reports {seen}: cannot read it ({problem})")
    return dp * attn, flag or attn > 1


def sglang_found(base: str, info: dict[str, Any], served: tuple[dict[str, Any], ...]) -> Discovered:
    ranks, lock_step = sglang_ranks(base, info)
    mode = info.get("disaggregation_mode")
    port = info.get("disaggregation_bootstrap_port")
    tp = info.get("tp_size")
    return Discovered(
        "sglang",
        ranks,
        0,
        lock_step,
        served,
        tp_size=tp if isinstance(tp, int) else None,
        bootstrap_port=port if isinstance(port, int) else None,
        role=mode if mode in ("prefill", "decode") else None,
    )


def _settle(worker: Worker, found: Discovered) -> Discovered:
    if found.role is not None and worker.role != "regular" and found.role != worker.role:
        raise Contradiction(f"{worker.url} is configured as {worker.role} but is a {found.role}")
    prefill = worker.role == "prefill" and found.dialect == "sglang"
    if prefill and worker.bootstrap_port is None and found.bootstrap_port is None:
        raise Contradiction(
            f"{worker.url} is an SGLang prefill worker with no bootstrap port: give it "
            "bootstrap_port=N"
        )
    if worker.dialect is not None and worker.dialect != found.dialect:
        raise Contradiction(
            f"{worker.url} is configured {worker.dialect} but answers as {found.dialect}"
        )
    if worker.dp_size is not None and found.ranks is not None and found.ranks != worker.dp_size:
        raise Contradiction(
            f"{worker.url} is configured with dp_size {worker.dp_size} but the engine reports "
            f"{found.ranks} rank(s); fix dp_size (or drop it to use what the engine reports)"
        )
    return found


def apply(worker: Worker, found: Discovered) -> None:
    worker.dialect = found.dialect
    worker.ranks = found.ranks or worker.dp_size or 1
    if worker.rank_offset is None:
        worker.rank_offset = found.rank_offset
    worker.dp_attention = found.dp_attention
    worker.models = found.models
    worker.cards = {card["id"]: card for card in found.cards}
    worker.tp_size = worker.tp_size or found.tp_size or 1
    if worker.bootstrap_port is None:
        worker.bootstrap_port = found.bootstrap_port
    if found.weight_version is not None:
        worker.weight_version = found.weight_version
