"""Simulated prefill and decode engines: each flow's semantics, and wrong pairing caught."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from dprouter.core.types import PdMode
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster

RANK = "X-data-parallel-rank"
BODY = {"prompt": "a shared prompt for prefill and decode", "max_tokens": 4}
NIXL_ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def pd(mode: PdMode, role: Literal["prefill", "decode"], dp: int = 2, **kw: Any) -> EngineConfig:
    config = PdConfig(mode=mode, role=role, **kw)
    return EngineConfig(persona=config.persona, dp_size=dp, pd=config)


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[int, dict[str, Any]]:
    async with http.post(url + path, json=body, headers=headers or {}) as r:
        return r.status, await r.json()


async def test_nixl_prefill_hands_kv_to_decode_once(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    p, d = (await start_cluster([pd("vllm-nixl", "prefill"), pd("vllm-nixl", "decode")])).servers
    prefill = {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_ASK}
    status, answer = await post(http, p.url, prefill, {RANK: "1"})
    assert status == 200
    kv = answer["kv_transfer_params"]
    assert kv["remote_engine_id"] == f"{p.engine_id}_dp1"
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.port)
    assert kv["do_remote_prefill"] is True and kv["remote_block_ids"]
    status, out = await post(http, d.url, {**BODY, "kv_transfer_params": kv}, {RANK: "0"})
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    assert d.engine.ranks[0].stats.prompt_tokens == out["usage"]["prompt_tokens"]
    status, again = await post(http, d.url, {**BODY, "kv_transfer_params": kv})
    assert status == 500 and "already consumed" in again["error"]["message"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_request_id": "cmpl-never"}, "was never produced"),
        ({"remote_engine_id": "engine-0_dp0"}, "belongs to engine-0_dp1, not engine-0_dp0"),
        ({"prompt": "another prompt entirely"}, "holds a different prompt"),
    ],
)
async def test_nixl_decode_refuses_kv_it_cannot_have(
    start_cluster: StartCluster,
    http: aiohttp.ClientSession,
    change: dict[str, Any],
    message: str,
) -> None:
    p, d = (
        await start_cluster(
            [pd("vllm-nixl", "prefill", kv_wait=0.1), pd("vllm-nixl", "decode", kv_wait=0.1)]
        )
    ).servers
    prefill = {**BODY, "max_tokens": 1, "kv_transfer_params": NIXL_ASK}
    _, answer = await post(http, p.url, prefill, {RANK: "1"})
    kv = {**answer["kv_transfer_params"], **{k: v for k, v in change.items() if k != "prompt"}}
    body = {**BODY, "prompt": change.get("prompt", BODY["prompt"]), "kv_transfer_params": kv}
    status, out = await post(http, d.url, body)
    assert status == 500
    assert message in out["error"]["message"] and out["error"]["type"] == "KVTransferError"


async def test_decode_without_transfer_params_is_sent_to_the_router(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (d,) = (await start_cluster([pd("vllm-nixl", "decode")])).servers
    status, out = await post(http, d.url, BODY)
    assert status == 400 and "send requests to the router" in out["error"]["message"]


def moriio_id(p: SimServer, d: SimServer) -> str:
    assert p.pd is not None and d.pd is not None
    pz, dz = p.pd.registration()["zmq_address"], d.pd.registration()["zmq_address"]
    return f"___prefill_addr_{pz}___decode_addr_{dz}_{uuid.uuid4().hex}"


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
async def test_moriio_transfer_and_wrong_rank(
    start_cluster: StartCluster, http: aiohttp.ClientSession, mode: str
) -> None:
    p, d = (
        await start_cluster(
            [
                pd("vllm-moriio", "prefill", transfer_mode=mode, kv_wait=2),
                pd("vllm-moriio", "decode", transfer_mode=mode, kv_wait=2),
            ]
        )
    ).servers
    ok, wrong = "tx-" + uuid.uuid4().hex, "tx-" + uuid.uuid4().hex
    for tid in (ok, wrong):
        ask = {
            "do_remote_decode": True,
            "transfer_id": tid,
            "remote_dp_size": 2,
            "remote_tp_size": 1,
        }  # the decode's shape
        prefill = {**BODY, "max_tokens": 1, "kv_transfer_params": ask}
        headers = {RANK: "1", "X-Request-Id": moriio_id(p, d)}
        decode_kv = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_dp_rank": 1 if tid == ok else 0,
            "remote_dp_size": 2,  # the prefill's shape
            "remote_tp_size": 1,
        }
        if mode == "READ":  # sequential: the decode carries what the prefill answered
            _, answer = await post(http, p.url, prefill, headers)
            got = answer["kv_transfer_params"]
            decode_kv |= {k: got[k] for k in ("remote_engine_id", "remote_block_ids")}
            status, out = await post(
                http, d.url, {**BODY, "kv_transfer_params": decode_kv}, headers
            )
        else:  # concurrent: the decode waits for the KV the prefill writes
            (status, out), _ = await asyncio.gather(
                post(http, d.url, {**BODY, "kv_transfer_params": decode_kv}, headers),
                post(http, p.url, prefill, headers),
            )
        if tid == ok:
            assert status == 200, out
        else:
            assert status == 500
            assert "was produced on rank 1, not rank 0" in out["error"]["message"]


async def test_moriio_engines_send_registration_heartbeats() -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    engine = SimServer(
        pd(
            "vllm-moriio",
            "decode",
            dp=4,
            transfer_mode="WRITE",
            registration=f"tcp://127.0.0.1:{port}",
            heartbeat=0.05,
        )
    )
    await engine.start()
    try:
        beats = []
        for _ in range(2):
            _, raw = await asyncio.wait_for(sock.recv_multipart(), 5)
            beats.append(msgpack.unpackb(raw))
    finally:
        await engine.stop()
        sock.close(0)
        ctx.term()
    assert (
        beats[0]
        == beats[1]
        == {
            "type": "D",
            "http_address": f"127.0.0.1:{engine.port}",
            "zmq_address": f"host:127.0.0.1,handshake:{engine.port},notify:{engine.port}",
            "dp_size": 4,
            "tp_size": 1,
            "transfer_mode": "WRITE",
        }
    )


async def test_sglang_prefill_and_decode_meet_on_the_bootstrap_room(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    p, d = (
        await start_cluster(
            [pd("sglang", "prefill", dp=4, kv_wait=0.3), pd("sglang", "decode", dp=2, kv_wait=0.3)]
        )
    ).servers
    async with http.get(p.url + "/server_info") as r:
        info = await r.json()
    assert info["disaggregation_mode"] == "prefill"
    port = info["disaggregation_bootstrap_port"]
    assert isinstance(port, int) and port != p.port

    def bodies(room: int, p_rank: int, claimed: int | None) -> tuple[dict[str, Any], ...]:
        common = {
            **BODY,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": room,
        }
        decode = {**common, "routed_dp_rank": 1}
        if claimed is not None:
            decode["disagg_prefill_dp_rank"] = claimed
        # a plain-DP prefill must be told its rank (below: what it says otherwise)
        return {**common, "routed_dp_rank": p_rank, "disagg_prefill_dp_rank": p_rank}, decode

    prefill, decode = bodies(4 * 1000 + 2, 2, 2)
    (ds, dout), (ps, _) = await asyncio.gather(
        post(http, d.url, decode), post(http, p.url, prefill)
    )
    assert (ps, ds) == (200, 200) and dout["usage"]["completion_tokens"] == 4
    # no disagg_prefill_dp_rank: the decode expects room % prefill dp_size, as SGLang does
    prefill, decode = bodies(4 * 1000 + 3, 3, None)
    (ds, _), _ = await asyncio.gather(post(http, d.url, decode), post(http, p.url, prefill))
    assert ds == 200
    prefill, decode = bodies(4 * 1000 + 1, 1, 0)  # told the wrong prefill rank
    (ds, dout), _ = await asyncio.gather(post(http, d.url, decode), post(http, p.url, prefill))
    assert ds == 500 and "produced on rank 1, not rank 0" in dout["message"]  # SGLang's shape
    prefill, _ = bodies(4 * 1000 + 3, 3, None)
    del prefill["disagg_prefill_dp_rank"]  # SGLang 0.5.23 refuses it, as on the real pair
    ps, pout = await post(http, p.url, prefill)
    assert ps == 500 and pout["message"].startswith(
        "follow_bootstrap_room conflict: dispatched to dp_rank 0 but bootstrap_room 4003 "
        "implies dp_rank 3."
    )
    _, decode = bodies(777, 1, 1)  # the prefill never comes
    ds, dout = await post(http, d.url, decode)
    assert ds == 500 and "was never produced" in dout["message"]
