"""What the SGLang persona reports of itself: ``/server_info``, ``/v1/loads``, ``/get_load``."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.model.rank import Rank

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

VERSION = "0.1.0-sim"


def pending_tokens(rank: Rank) -> int:
    return sum(r.prompt_len for r in rank.waiting)


def load_entry(rank: Rank) -> dict[str, Any]:
    """One rank's entry of SGLang 0.5.23's ``/v1/loads`` (its core fields that the
    model knows; a waiting prompt counts as uncached until it is scheduled)."""
    stats = rank.stats
    queries = stats.prefix_queries
    pending = pending_tokens(rank)
    return {
        "timestamp": time.time(),
        "dp_rank": rank.index,
        "num_running_reqs": rank.num_running,
        "num_waiting_reqs": rank.num_waiting,
        "num_waiting_uncached_tokens": pending,
        "num_used_tokens": rank.kv_used,
        "num_total_tokens": rank.kv_used + pending,
        "max_total_num_tokens": rank.limits.kv_tokens,
        "max_running_requests": rank.limits.max_running,
        "token_usage": rank.kv_usage,
        "cache_hit_rate": stats.prefix_hits / queries if queries else 0.0,
    }


def server_args(config: EngineConfig, bootstrap_port: int | None) -> dict[str, Any]:
    """What ``/server_info`` says of the engine's shape, in the SGLang version imitated.

    SGLang 0.5.23 counts attention-DP ranks in ``attn_dp_size`` and reports ``dp_size: 1``
    for them (``enable_dp_attention`` kept for old clients); older SGLang counted them in
    ``dp_size`` with ``enable_dp_attention`` and had no ``attn_dp_size``.
    """
    c = config
    if c.legacy_sglang:
        shape: dict[str, Any] = {"dp_size": c.dp_size, "enable_dp_attention": c.dp_attention}
    elif c.dp_attention:
        shape = {"dp_size": 1, "attn_dp_size": c.dp_size, "enable_dp_attention": c.dp_size > 1}
    else:
        shape = {"dp_size": c.dp_size, "attn_dp_size": 1, "enable_dp_attention": False}
    # model_path and tokenizer_path are left out on purpose: peers that see them
    # try to download a tokenizer from a model hub
    return {
        "served_model_name": c.model,
        "tp_size": c.tp_size,
        **shape,
        "load_balance_method": c.dispatch_mode,
        "disaggregation_mode": c.pd.role if c.pd else "null",
        "disaggregation_bootstrap_port": bootstrap_port,
        "page_size": c.limits.block_size,
        # the engine's --max-running-requests: split among attention-DP ranks (each
        # reports its share), whole for each replica of plain DP (SGLang 0.5.23)
        "max_running_requests": c.limits.max_running * (c.dp_size if c.dp_attention else 1),
        "chunked_prefill_size": c.cost.max_batched_tokens,
        "enable_mixed_chunk": c.mixes_chunks,
    }


def server_info(server: SimServer) -> dict[str, Any]:
    c = server.config
    args = server_args(c, server.pd.bootstrap_port if server.pd else None)
    states = [  # one per rank, in rank order (the real engine's carry no dp_rank)
        {
            **args,
            "last_gen_throughput": 0.0,
            "memory_usage": {"token_capacity": r.limits.kv_tokens},
            "effective_max_running_requests_per_dp": r.limits.max_running,
        }
        for r in server.engine.ranks
    ]
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": c.limits.kv_tokens,
        "max_req_input_len": c.limits.max_model_len - 1,
        "internal_states": states,
        "version": VERSION,
        "kv_events_config": kv_events_config(server),
        "kv_events": kv_events(server),
    }


def kv_events_config(server: SimServer) -> str | None:
    """SGLang's server arg as given: the ``--kv-events-config`` JSON string, ``None``
    without one (``server_args.resolved_dict()`` in ``utils/common.py``'s
    ``build_server_info``); the sim's resolves a port 0 to the ports it bound. A config
    given but off says ``"publisher": "null"``, as SGLang publishes nothing then."""
    config = server.config.kv_events
    if server.kv is not None:
        given = server.kv.given()
    elif config != KvEventsConfig():
        given = config.wire()
    else:
        return None
    return json.dumps({k: v for k, v in given.items() if v is not None})


def kv_events(server: SimServer) -> dict[str, Any] | None:
    """SGLang's ``describe_kv_events_publisher`` (``runtime_context.py``): the base ports
    a router adds each rank to; ``None`` with events off."""
    kv = server.kv
    if kv is None:
        return None
    host = kv.config.endpoint.removeprefix("tcp://").rpartition(":")[0]
    out: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": host,
        "endpoint_port_base": kv.base,
        "topic": kv.config.topic,
        "block_size": server.config.limits.block_size,
        "dp_size": server.config.dp_size,
    }
    if kv.replay_base is not None:
        out["replay_endpoint_port_base"] = kv.replay_base
    return out


def loads(server: SimServer, ranks: list[Rank]) -> dict[str, Any]:
    """SGLang 0.5.23's ``/v1/loads`` answer for ``ranks``."""
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": VERSION,
        "accelerator": None,
        "num_accelerators": server.config.tp_size,
        "loads": [load_entry(r) for r in ranks],
    }


def old_loads(ranks: list[Rank]) -> list[dict[str, Any]]:
    """An older SGLang's ``/get_load``."""
    return [
        {
            "dp_rank": r.index,
            "num_reqs": r.num_running + r.num_waiting,
            "num_waiting_reqs": r.num_waiting,
            "num_tokens": r.kv_used + pending_tokens(r),
            "num_pending_tokens": pending_tokens(r),
            "ts_tic": time.perf_counter(),
        }
        for r in ranks
    ]
