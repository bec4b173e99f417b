"""What each P/D flow writes, and how pairs are chosen: pure, exact."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from dprouter.core.types import Role
from dprouter.engines import dialects, pd_wire
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import RequestInfo, make_policy
from dprouter.proxy.pd.pairing import Pairing
from dprouter.sim.http.pd import MORIIO_ID

CLIENT = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
}


def target(role: Role, n: int, dp: int, rank: int | None, **kw: Any) -> Target:
    w = Worker(
        id=f"{role[0]}{n}", url=f"http://10.0.0.{n + 1}:{8000 + n}", role=role, dialect="vllm", **kw
    )
    w.ranks, w.tp_size = dp, 8 if dp == 1 else 1
    return Target(w, rank)


def test_nixl_prefill_asks_for_remote_decode_and_one_token() -> None:
    body = pd_wire.nixl_prefill({**CLIENT, "max_completion_tokens": 8})
    assert (body["max_tokens"], body["max_completion_tokens"], body["stream"]) == (1, 1, False)
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert CLIENT["max_tokens"] == 8  # the client's body is left alone
    kv = {"remote_engine_id": "e-dp3", "remote_block_ids": [1, 2], "anything": {"x": 1}}
    assert pd_wire.nixl_decode(CLIENT, kv) == {**CLIENT, "kv_transfer_params": kv}


def test_moriio_fields_and_request_id() -> None:
    p = target("prefill", 0, 8, 5, zmq_address="host:10.0.0.1,handshake:7000,notify:7001")
    d = target("decode", 1, 1, None, zmq_address="host:10.0.0.2,handshake:7100,notify:7101")
    rid = pd_wire.moriio_request_id(p, d)
    found = MORIIO_ID.match(rid)
    assert found is not None
    assert (found["p"], found["d"]) == (p.worker.zmq_address, d.worker.zmq_address)
    pre = pd_wire.moriio_prefill(CLIENT, "tx-1", d)
    assert pre["kv_transfer_params"]["transfer_id"] == "tx-1"
    assert (
        pre["kv_transfer_params"]["remote_dp_size"],
        pre["kv_transfer_params"]["remote_tp_size"],
    ) == (1, 8)
    read = pd_wire.moriio_decode(
        CLIENT,
        "tx-1",
        p,
        {"remote_engine_id": "e", "remote_block_ids": [7], "remote_hosts": ["a", "b"]},
    )
    kv = read["kv_transfer_params"]
    assert (kv["do_remote_prefill"], kv["remote_dp_rank"], kv["remote_dp_size"]) == (True, 5, 8)
    assert (kv["remote_block_ids"], kv["remote_hosts"], read["max_tokens"]) == ([7], ["a", "b"], 7)
    write = pd_wire.moriio_decode(CLIENT, "tx-1", p, None)
    assert "remote_block_ids" not in write["kv_transfer_params"]
    omitted = {k: v for k, v in CLIENT.items() if k != "max_tokens"}
    assert "max_tokens" not in pd_wire.moriio_decode(omitted, "tx", p, None)  # left to the engine
    assert pd_wire.moriio_decode({**CLIENT, "max_tokens": 1}, "tx", p, None)["max_tokens"] == 1


@pytest.mark.parametrize(("dp", "rank"), [(8, 0), (8, 5), (3, 2), (1, None)])
def test_sglang_room_agrees_with_follow_bootstrap_room(dp: int, rank: int | None) -> None:
    p = target("prefill", 0, dp, rank, bootstrap_port=8998)
    d = target("decode", 1, 4, 3)
    rng = random.Random(1)
    for _ in range(200):
        room = pd_wire.sglang_room(p, rng)
        assert 0 <= room < 1 << 63
        if rank is not None:
            assert room % dp == rank
    pre, dec = pd_wire.sglang_bodies(CLIENT, p, room)
    for leg in (pre, dec):
        assert (leg["bootstrap_host"], leg["bootstrap_port"], leg["bootstrap_room"]) == (
            "10.0.0.1",
            8998,
            room,
        )
        assert not set(leg) & set(dialects.RANK_FIELDS)  # ranks are the dialect's to write
    # as the SGLang flow then writes them, leg by leg
    dialects.write_rank("sglang", p.rank, {}, pre)
    dialects.write_rank("sglang", d.rank, {}, dec)
    dialects.write_prefill_rank(p.rank, dec)
    assert dec["routed_dp_rank"] == dec["data_parallel_rank"] == 3
    if rank is not None:
        assert pre["routed_dp_rank"] == dec["disagg_prefill_dp_rank"] == rank
    else:
        assert "routed_dp_rank" not in pre and "disagg_prefill_dp_rank" not in dec


@pytest.mark.parametrize(("p_slots", "d_slots"), [(2, 2), (2, 4), (3, 2), (1, 8), (16, 1), (4, 6)])
def test_pairs_cover_every_combination_and_each_side_evenly(p_slots: int, d_slots: int) -> None:
    pairing = Pairing(make_policy("round_robin"), make_policy("round_robin"))
    prefills = [target("prefill", 0, p_slots, i) for i in range(p_slots)]
    decodes = [target("decode", 1, d_slots, i) for i in range(d_slots)]
    n = 2 * p_slots * d_slots
    pairs = [pairing.choose(prefills, decodes, RequestInfo()) for _ in range(n)]
    assert set(Counter(pairs).values()) == {2}  # every (prefill, decode) pair, twice
    assert set(Counter(p for p, _ in pairs).values()) == {2 * d_slots}
    assert set(Counter(d for _, d in pairs).values()) == {2 * p_slots}


def test_sglang_batches_get_a_room_per_item() -> None:
    p = target("prefill", 0, 4, 3, bootstrap_port=8998)
    rng = random.Random(2)
    assert isinstance(pd_wire.sglang_rooms({"text": "one"}, p, rng), int)
    rooms = pd_wire.sglang_rooms({"text": ["a", "b", "c"]}, p, rng)
    assert isinstance(rooms, list) and len(rooms) == 3 and len(set(rooms)) == 3
    assert all(room % 4 == 3 for room in rooms)
    assert len(pd_wire.sglang_rooms({"input_ids": [[1, 2], [3]]}, p, rng)) == 2  # type: ignore[arg-type]


def test_mooncake_legs_meet_on_the_transfer_id_and_the_prefill_ends_by_length() -> None:
    """vLLM 0.32's Mooncake prefill keeps the KV only for a request capped by length: an
    EOS or a stop string as its one token would free it before the decode pulls."""
    client = {**CLIENT, "stop": ["\n"], "stop_token_ids": [2]}
    pre = pd_wire.mooncake_prefill(client, "tx-1")
    assert (pre["max_tokens"], pre["stream"], pre["ignore_eos"]) == (1, False, True)
    assert "stop" not in pre and "stop_token_ids" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert pre["kv_transfer_params"]["transfer_id"] == "tx-1"
    p = target("prefill", 2, 2, 1)
    bootstrap = pd_wire.mooncake_bootstrap(p)
    assert bootstrap == "http://10.0.0.3:8998"  # vLLM's default port
    p.worker.bootstrap_port = 9100
    assert pd_wire.mooncake_bootstrap(p) == "http://10.0.0.3:9100"
    dec = pd_wire.mooncake_decode(client, "tx-1", "e_dp1", bootstrap)
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e_dp1",
        "remote_bootstrap_addr": bootstrap,
        "transfer_id": "tx-1",
    }
    assert (dec["max_tokens"], dec["stop"]) == (8, ["\n"])  # the decode runs the client's


def test_mooncake_bootstrap_answers_are_read_strictly() -> None:
    listed = {"0": {"engine_id": "a", "worker_addr": {}}, "1": {"engine_id": "b"}}
    assert pd_wire.mooncake_engines(listed) == {0: "a", 1: "b"}
    bad_ones: list[Any] = [[], {"x": {"engine_id": "a"}}, {"0": {"engine_id": 7}}, {"0": "a"}]
    for bad in bad_ones:
        with pytest.raises(ValueError, match=r"not a map|engine_id"):
            pd_wire.mooncake_engines(bad)
