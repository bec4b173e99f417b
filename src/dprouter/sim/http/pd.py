"""Prefill and decode roles of the simulated engines, one flow at a time.

A prefill engine runs the prompt (one output token), keeps the KV in its
``KvStore`` under the flow's key and, for vLLM, answers with the
``kv_transfer_params`` its connector would return. A decode engine must be
told where the KV is; it takes it from the prefill engine over HTTP
(``POST /sim/kv/take`` -- the stand-in for NIXL, MoRIIO or SGLang's bootstrap
transfer) before it decodes, and fails clearly when the pairing is wrong.

Keys and where the decode learns them:
- vLLM NIXL: the prefill request id; ``kv_transfer_params`` carry ``remote_host``,
  ``remote_port``, ``remote_engine_id`` (``<engine>_dp<rank>``, as vLLM names each DP
  rank's engine core) and it; ``remote_block_ids`` one list per KV-cache group.
- vLLM Mooncake: ``transfer_id``, which the router makes (a prefill without one keeps
  nothing: vLLM 0.32 logs "Missing transfer_id" and its decode, finding nothing to pull,
  fails the request by default (``kv_load_failure_policy``); the simulated prefill
  refuses it at once, so that the mistake shows where it was made). The decode is told
  ``remote_engine_id`` and ``remote_bootstrap_addr``, asks that server's ``GET /query``
  for the engine's rank and worker address, and pulls from there.
- vLLM MoRIIO: ``transfer_id``; the prefill address is in ``X-Request-Id``
  (``___prefill_addr_<zmq>___decode_addr_<zmq>_<uuid>``), the rank in
  ``remote_dp_rank``.
- SGLang: ``bootstrap_room`` at ``bootstrap_host:bootstrap_port``; the rank is
  ``disagg_prefill_dp_rank``, else ``room % prefill dp_size``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from dprouter.sim.http.kvstore import KvStore
from dprouter.sim.model.config import PdConfig

MORIIO_ID = re.compile(r"^___prefill_addr_(?P<p>.+)___decode_addr_(?P<d>.+)_(?P<uid>[0-9a-f]+)$")


class PdError(ValueError):
    """The request cannot run in this engine's P/D role; the message says why."""


@dataclass(frozen=True)
class Ticket:
    """Where a decode request's KV waits, and what it must match."""

    url: str  # the prefill engine's take endpoint
    key: str
    rank: int | None
    engine: str | None
    claims: dict[str, object] = field(default_factory=dict)  # checked against the prefill's
    bootstrap: str | None = None  # Mooncake: where ``url`` and ``rank`` are found (``/query``)


def zmq_host_port(address: str) -> tuple[str, int]:
    """``host:IP,handshake:PORT,notify:PORT`` -> (IP, handshake port)."""
    parts = dict(p.split(":", 1) for p in address.split(",") if ":" in p)
    try:
        return parts["host"], int(parts["handshake"])
    except (KeyError, ValueError):
        raise PdError(f"bad MoRIIO zmq address {address!r}") from None


def _url(host: str, port: int) -> str:
    host = host.strip("[]")
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/sim/kv/take"


def _kv(body: Mapping[str, Any]) -> dict[str, Any]:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict):
        raise PdError("a decode instance needs kv_transfer_params: send requests to the router")
    return kv


def _need(kv: Mapping[str, Any], *names: str) -> None:
    missing = [n for n in names if kv.get(n) is None]
    if missing:
        raise PdError(f"kv_transfer_params lacks {', '.join(missing)}")


@dataclass(frozen=True)
class Me:
    """What an engine knows of itself that its P/D peer must agree with."""

    dp: int
    tp: int
    address: str  # MoRIIO: its ZMQ address as it registers it


def moriio_peers(headers: Mapping[str, str]) -> tuple[str, str]:
    found = MORIIO_ID.match(headers.get("X-Request-Id", ""))
    if found is None:
        raise PdError("X-Request-Id must carry ___prefill_addr_<zmq>___decode_addr_<zmq>_<id>")
    return found["p"], found["d"]


def prefill_meta(
    pd: PdConfig, body: Mapping[str, Any], headers: Mapping[str, str], me: Me
) -> dict[str, object]:
    """What a MoRIIO prefill was told about its decode peer, kept with the KV."""
    if pd.mode != "vllm-moriio":
        return {}
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict):
        raise PdError("a MoRIIO prefill needs kv_transfer_params")
    _need(kv, "remote_dp_size", "remote_tp_size")
    _, decode_address = moriio_peers(headers)
    return {
        "decode_dp": kv.get("remote_dp_size"),
        "decode_tp": kv.get("remote_tp_size"),
        "decode_address": decode_address,
        "prefill_dp": me.dp,
        "prefill_tp": me.tp,
    }


def decode_ticket(
    pd: PdConfig, body: Mapping[str, Any], headers: Mapping[str, str], me: Me
) -> Ticket:
    if pd.mode == "vllm-nixl":
        kv = _kv(body)
        if kv.get("do_remote_prefill") is not True:
            raise PdError("kv_transfer_params must ask for do_remote_prefill")
        # the keys vLLM 0.32's NIXL metadata requires (``nixl/metadata.py``)
        _need(
            kv,
            "remote_host",
            "remote_port",
            "remote_engine_id",
            "remote_request_id",
            "remote_block_ids",
        )
        return Ticket(
            _url(kv["remote_host"], int(kv["remote_port"])),
            str(kv["remote_request_id"]),
            None,
            str(kv["remote_engine_id"]),
        )
    if pd.mode == "vllm-mooncake":
        kv = _kv(body)
        if kv.get("do_remote_prefill") is not True:
            raise PdError("kv_transfer_params must ask for do_remote_prefill")
        # what vLLM 0.32's Mooncake scheduler needs, else it recomputes the prompt
        _need(kv, "remote_engine_id", "remote_bootstrap_addr", "transfer_id")
        return Ticket(
            "",
            str(kv["transfer_id"]),
            None,
            str(kv["remote_engine_id"]),
            bootstrap=str(kv["remote_bootstrap_addr"]),
        )
    if pd.mode == "vllm-moriio":
        kv = _kv(body)
        _need(kv, "transfer_id", "remote_dp_rank", "remote_dp_size", "remote_tp_size")
        if pd.transfer_mode == "READ":
            _need(kv, "remote_engine_id", "remote_block_ids")
        prefill_address, decode_address = moriio_peers(headers)
        if decode_address != me.address:
            raise PdError(
                f"X-Request-Id names decode {decode_address}, not this engine ({me.address})"
            )
        host, port = zmq_host_port(prefill_address)
        engine = kv.get("remote_engine_id")
        claims = {
            "decode_dp": me.dp,
            "decode_tp": me.tp,
            "decode_address": me.address,
            "prefill_dp": kv.get("remote_dp_size"),
            "prefill_tp": kv.get("remote_tp_size"),
        }
        return Ticket(
            _url(host, port),
            str(kv["transfer_id"]),
            int(kv["remote_dp_rank"]),
            None if engine is None else str(engine),
            claims,
        )
    _need(body, "bootstrap_host", "bootstrap_port", "bootstrap_room")
    rank = body.get("disagg_prefill_dp_rank")
    return Ticket(
        _url(str(body["bootstrap_host"]), int(body["bootstrap_port"])),
        str(body["bootstrap_room"]),
        None if rank is None else int(rank),
        None,
    )


def room_conflict(
    body: Mapping[str, Any], rank: int | None, dp_size: int, dp_attention: bool
) -> str | None:
    """SGLang 0.5.23's prefill under ``follow_bootstrap_room`` (its default with DP): a
    request without ``disagg_prefill_dp_rank`` must sit on the attention-DP rank its room
    implies (``room % dp``). Under plain DP every replica's attention rank is 0, so every
    room that implies another fails, wherever it was dispatched
    (``disaggregation/common/conn.py``): the error, or None."""
    room = body.get("bootstrap_room")
    if dp_size < 2 or body.get("disagg_prefill_dp_rank") is not None or not isinstance(room, int):
        return None
    implied = room % dp_size
    attention = (implied if rank is None else rank) if dp_attention else 0
    if attention == implied:
        return None
    return (
        f"follow_bootstrap_room conflict: dispatched to dp_rank {attention} but bootstrap_room "
        f"{room} implies dp_rank {implied}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"
        "=1 to allow mixed routing."
    )


def prefill_key(pd: PdConfig, body: Mapping[str, Any], rid: str) -> str:
    """The key the prefill engine keeps its KV under."""
    if pd.mode == "vllm-nixl":
        return rid
    if pd.mode in ("vllm-moriio", "vllm-mooncake"):
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv.get("transfer_id"):
            flow = "MoRIIO" if pd.mode == "vllm-moriio" else "Mooncake"
            raise PdError(f"a {flow} prefill needs kv_transfer_params.transfer_id")
        return str(kv["transfer_id"])
    room = body.get("bootstrap_room")
    if not isinstance(room, int) or isinstance(room, bool):
        raise PdError("an SGLang prefill needs an integer bootstrap_room")
    return str(room)


def prefill_answer(
    pd: PdConfig,
    store: KvStore,
    key: str,
    rank: int,
    host: str,
    port: int,
    prompt_tokens: int,
    tp_size: int,
) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a vLLM prefill answers with (SGLang: none)."""
    blocks = list(range(max(1, -(-prompt_tokens // 16))))
    common = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": blocks,
        "remote_engine_id": store.engine_name(rank),
        "tp_size": tp_size,
    }
    if pd.mode == "vllm-nixl":  # as vLLM 0.32's NIXL pull scheduler answers
        return {
            **common,
            "remote_block_ids": [blocks],  # one list per KV-cache group (one here)
            "remote_request_id": key,
            "remote_host": host,
            "remote_port": port,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
        }
    if pd.mode == "vllm-moriio":
        return {**common, "transfer_id": key}
    return None  # SGLang, and vLLM's Mooncake prefill (``kv_transfer_params: null``)


def mooncake_query(store: KvStore, host: str, port: int) -> dict[str, Any]:
    """A Mooncake bootstrap server's ``GET /query``: each DP rank's engine id and its
    workers' addresses by TP and PP rank (the simulated transfer runs over HTTP, so the
    address is the engine's HTTP address)."""
    return {
        str(rank): {
            "engine_id": store.engine_name(rank),
            "worker_addr": {"0": {"0": f"{host}:{port}"}},
        }
        for rank in range(store.dp_size)
    }


Located = dict[str, tuple[str, int]]  # a Mooncake decode's engines found: id -> (url, rank)


async def _locate(session: aiohttp.ClientSession, ticket: Ticket, found: Located) -> Ticket:
    """Mooncake: the ticket's engine found on its bootstrap server, as vLLM's decode does:
    it asks a server it has not asked, or again for an engine it does not know, and keeps
    every engine the answer lists."""
    assert ticket.bootstrap is not None and ticket.engine is not None
    if ticket.engine not in found:
        try:
            async with session.get(ticket.bootstrap + "/query") as r:
                listed = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            why = f"cannot reach the bootstrap server {ticket.bootstrap}: {exc}"
            raise PdError(why) from None
        for rank, entry in listed.items() if isinstance(listed, dict) else ():
            try:
                host, _, port = str(entry["worker_addr"]["0"]["0"]).rpartition(":")
                found[str(entry["engine_id"])] = (_url(host, int(port)), int(rank))
            except (KeyError, TypeError, ValueError):
                raise PdError(f"{ticket.bootstrap}/query lists {entry!r}: no address") from None
    if ticket.engine not in found:
        raise PdError(
            f"remote engine_id {ticket.engine} not found from bootstrap server {ticket.bootstrap}"
        )
    url, rank = found[ticket.engine]
    return replace(ticket, url=url, rank=rank)


async def take(
    session: aiohttp.ClientSession, ticket: Ticket, digest: int, wait: float, found: Located
) -> int:
    """Take the KV from the prefill engine; returns its prompt tokens or raises PdError.
    ``found``: the Mooncake engines this decode located so far."""
    if ticket.bootstrap is not None:
        ticket = await _locate(session, ticket, found)
    payload = {
        "key": ticket.key,
        "rank": ticket.rank,
        "engine": ticket.engine,
        "digest": digest,
        "wait": wait,
        "claims": ticket.claims,
    }
    try:
        async with session.post(ticket.url, json=payload) as r:
            answer = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise PdError(f"cannot reach the prefill engine at {ticket.url}: {exc}") from None
    if r.status != 200:
        raise PdError(str(answer.get("error", answer)))
    return int(answer["prompt_tokens"])
