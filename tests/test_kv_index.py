"""The engines' KV-event frames decoded, and the index they build (no sockets here)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from dprouter.engines.kvevents import wire
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.keys import chain, prompt_keys, root
from dprouter.engines.kvevents.wire import Cleared, Removed, Stored

TOKENS = list(range(1000, 1048))


def pack(value: object) -> bytes:
    return bytes(msgpack.packb(value))  # three blocks of 16


def vllm_arrays() -> bytes:
    """Older vLLM (msgspec array_like, tag first; trailing defaults omitted)."""
    stored = ["BlockStored", [11, 12, 13], None, TOKENS, 16, None, "GPU", None]
    return pack([1.5, [stored, ["BlockRemoved", [13], "GPU"]], 2])


def vllm_maps() -> bytes:
    """vLLM since mid-2026: the events are maps with a "type" key, so is the batch."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}
    return pack({"ts": 1.5, "events": [stored, removed], "data_parallel_rank": 2})


def sglang() -> bytes:
    """SGLang: one BlockStored per page, chained by parent hash; [ts, events, attn_dp_rank]."""
    pages = [
        ["BlockStored", [11], None, TOKENS[:16], 16, None],
        ["BlockStored", [12], 11, TOKENS[16:32], 16, None],
        ["BlockStored", [13], 12, TOKENS[32:], 16, None],
        ["BlockRemoved", [13]],
    ]
    return pack([1.5, pages, 2])


@pytest.mark.parametrize("payload", [vllm_arrays(), vllm_maps(), sglang()], ids=str)
def test_every_encoding_builds_the_same_index(payload: bytes) -> None:
    batch = wire.batch(payload)
    assert (batch.ts, batch.rank) == (1.5, 2)
    index = KvIndex()
    rank = index.rank("w0", 2)
    index.apply(rank, batch.events)
    assert set(rank.blocks) == {11, 12}
    keys = prompt_keys(np.array(TOKENS), 16)
    assert index.match(keys, 1 << rank.bit) == {rank.bit: 2}
    assert rank.block_size == 16 and index.size == 2


def test_fields_the_router_does_not_use_are_ignored_and_unknown_kinds_skipped() -> None:
    late = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],  # hashes as bytes (ExternalBlockHash)
        "parent_block_hash": None,
        "token_ids": TOKENS[:16],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    batch = wire.batch(msgpack.packb({"ts": 0, "events": [late, {"type": "Future"}]}))
    assert batch.rank is None
    assert batch.events == [Stored([b"\x01" * 32], None, TOKENS[:16], 16, None, "GPU", 0)]
    assert wire.batch(msgpack.packb([0, [["AllBlocksCleared"]]])).events == [Cleared()]


@pytest.mark.parametrize(
    "payload", [b"\xc1", msgpack.packb("x"), msgpack.packb([0, [["BlockStored", [1]]]])]
)
def test_garbage_is_a_bad_frame(payload: bytes) -> None:
    with pytest.raises(wire.BadFrame):
        wire.batch(payload)


def test_sequence_numbers_and_the_replay_end() -> None:
    assert wire.sequence((5).to_bytes(8, "big")) == 5
    assert wire.sequence((-1).to_bytes(8, "big", signed=True)) == -1


def test_keys_of_events_and_of_prompts_agree_in_python_and_numpy() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, 4000)
    whole = prompt_keys(ids, 16)
    assert chain(0, 0, ids.tolist(), 16) == whole
    stepwise: list[int] = []
    for start in range(0, 4000, 16):  # one small block at a time: the Python path
        stepwise += chain(
            stepwise[-1] if stepwise else 0, start, ids[start : start + 16].tolist(), 16
        )
    assert stepwise == whole
    assert chain(whole[9], 160, ids[160:].tolist(), 16) == whole[10:]
    assert prompt_keys(ids[:10], 16) == [] and len(set(whole)) == len(whole)
    assert root(None) == root(0) == 0 and root("adapter") not in (0, root("other"))


def test_shared_blocks_removal_clear_and_a_dropped_rank() -> None:
    index = KvIndex()
    a, b = index.rank("w0", 0), index.rank("w0", 1)
    index.apply(a, [Stored([1, 2, 3], None, TOKENS, 16)])
    index.apply(b, [Stored([7, 8], None, TOKENS[:32], 16)])  # another seed, same tokens
    keys = prompt_keys(np.array(TOKENS + [5] * 16), 16)
    both = 1 << a.bit | 1 << b.bit
    assert index.match(keys, both) == {a.bit: 3, b.bit: 2}
    assert index.match(keys, 1 << b.bit) == {b.bit: 2}
    index.apply(a, [Removed([2])])  # a hole: only the leading run counts
    assert index.match(keys, both) == {a.bit: 1, b.bit: 2}
    index.apply(b, [Cleared()])
    assert index.match(keys, both) == {a.bit: 1}
    assert len(index.entries) == 2 and index.size == 2
    index.drop("w0", 0)
    assert index.entries == {} and index.size == 0 and index.match(keys, both) == {}
    assert index.rank("w1", 0).bit == a.bit  # its bit is reused


def test_children_chain_to_their_parent_and_orphans_wait() -> None:
    index = KvIndex()
    a = index.rank("w0", 0)
    index.apply(a, [Stored([2], 1, TOKENS[16:32], 16)])  # parent 1 never seen
    assert a.orphans == 1 and index.size == 0
    index.apply(a, [Stored([1], None, TOKENS[:16], 16), Stored([2, 3], 1, TOKENS[16:], 16)])
    keys = prompt_keys(np.array(TOKENS), 16)
    assert index.match(keys, 1 << a.bit) == {a.bit: 3}


def test_other_media_groups_and_adapters_do_not_count() -> None:
    index = KvIndex()
    a = index.rank("w0", 0)
    index.apply(
        a,
        [
            Stored([1], None, TOKENS[:16], 16, medium="CPU"),
            Stored([2], None, TOKENS[:16], 16, group=1),
            Stored([3], None, TOKENS[:16], 16, lora=5),
        ],
    )
    assert index.counts.ignored == 2 and index.size == 1
    assert index.match(prompt_keys(np.array(TOKENS), 16), 1 << a.bit) == {}


def test_capacity_bounds_what_is_indexed() -> None:
    index = KvIndex(capacity=2)
    a = index.rank("w0", 0)
    index.apply(a, [Stored([1, 2, 3], None, TOKENS, 16)])
    assert index.size == 2 and index.counts.dropped == 1
    assert index.match(prompt_keys(np.array(TOKENS), 16), 1 << a.bit) == {a.bit: 2}


PROMPT = list(range(500, 564))  # 4 blocks of 16


def pending_setup(ttl: float = 10.0) -> tuple[KvIndex, list[int], int]:
    """Rank 0 holds the prompt's first block (so its block size is known); the whole
    prompt was sent to it at t=100."""
    index = KvIndex(ttl=ttl)
    rank = index.rank("w0", 0)
    index.apply(rank, [Stored([1], None, PROMPT[:16], 16)])
    keys = prompt_keys(np.array(PROMPT), 16)
    index.expect(rank, keys, 100.0)
    return index, keys, 1 << rank.bit


def test_pending_blocks_count_as_held_and_as_queued_prefill() -> None:
    index, keys, mask = pending_setup()
    rank = index.ranks[("w0", 0)]
    assert index.match(keys, mask) == {rank.bit: 4}
    assert index.queued(rank) == 3 * 16  # the held first block is not pending
    assert index.size == 1  # nothing claimed as stored


def test_one_walk_says_what_is_held_and_what_of_it_is_stored() -> None:
    """Rank 0 stores the prompt's first block and has the rest pending; rank 1 stores two
    blocks: held 4 and 2, stored 1 and 2 (what ``prefix`` counts in full)."""
    index, keys, mask = pending_setup()
    zero, one = index.ranks[("w0", 0)], index.rank("w0", 1)
    index.apply(one, [Stored([7, 8], None, PROMPT[:32], 16)])
    stored: dict[int, int] = {}
    both = mask | 1 << one.bit
    assert index.match(keys, both, stored) == {zero.bit: 4, one.bit: 2}
    assert stored == {zero.bit: 1, one.bit: 2}
    assert index.match(keys, both) == {zero.bit: 4, one.bit: 2}  # without: the same held


def test_pending_blocks_expire_after_the_ttl() -> None:
    index, keys, mask = pending_setup(ttl=2.0)
    rank = index.ranks[("w0", 0)]
    index.expire(101.9)
    assert index.match(keys, mask) == {rank.bit: 4}
    index.expire(102.0)
    assert index.match(keys, mask) == {rank.bit: 1}
    assert index.queued(rank) == 0 and not index.pending


def test_a_prompt_sent_again_is_pending_from_its_last_sending() -> None:
    index, keys, mask = pending_setup(ttl=2.0)
    index.expect(index.ranks[("w0", 0)], keys, 101.0)
    index.expire(102.5)
    assert index.match(keys, mask) == {index.ranks[("w0", 0)].bit: 4}
    index.expire(103.0)
    assert index.match(keys, mask) == {index.ranks[("w0", 0)].bit: 1}


def test_events_replace_pending_blocks() -> None:
    index, keys, mask = pending_setup()
    rank = index.ranks[("w0", 0)]
    index.apply(rank, [Stored([2, 3], 1, PROMPT[16:48], 16)])
    assert rank.pending == {keys[3]: 110.0}  # the stored two are held, not pending
    assert index.queued(rank) == 16
    assert index.match(keys, mask) == {rank.bit: 4}
    index.expire(111.0)  # the stored ones stay when the pending time is up
    assert index.match(keys, mask) == {rank.bit: 3}


def test_a_flush_a_removal_or_the_ranks_end_clears_pending_blocks() -> None:
    index, keys, mask = pending_setup()
    rank = index.ranks[("w0", 0)]
    index.apply(rank, [Cleared()])
    assert index.match(keys, mask) == {} and index.queued(rank) == 0 and not index.pending

    index, keys, mask = pending_setup()
    rank = index.ranks[("w0", 0)]
    index.apply(rank, [Stored([2], 1, PROMPT[16:32], 16), Removed([2])])
    assert index.match(keys, mask) == {rank.bit: 1}  # block 2 gone: the chain ends there
    assert set(rank.pending) == set(keys[2:])

    index, keys, mask = pending_setup()
    index.drop("w0", 0)
    assert not index.pending
    again = index.rank("w0", 0)  # the same bit, nothing pending on it
    assert again.bit == 0 and index.match(keys, mask) == {} and not again.pending


def test_pending_blocks_are_per_rank() -> None:
    index, keys, mask = pending_setup()
    other = index.rank("w0", 1)
    index.apply(other, [Stored([7], None, PROMPT[:16], 16)])
    both = mask | 1 << other.bit
    assert index.match(keys, both) == {0: 4, other.bit: 1}
    index.expect(other, keys[:2], 100.5)
    assert index.match(keys, both) == {0: 4, other.bit: 2}
    index.apply(other, [Cleared()])
    assert index.match(keys, both) == {0: 4}


def test_no_ttl_keeps_nothing_pending() -> None:
    index, keys, mask = pending_setup(ttl=0.0)
    assert index.match(keys, mask) == {index.ranks[("w0", 0)].bit: 1} and not index.pending


def test_the_queue_row_follows_pending_blocks_by_rank_bit() -> None:
    index, _, _ = pending_setup()
    rank = index.ranks[("w0", 0)]
    assert index.queue[rank.bit] == 48 and index.queue[-1] == 0
    index.apply(rank, [Stored([2], 1, PROMPT[16:32], 16)])
    assert index.queue[rank.bit] == 32
    index.apply(rank, [Cleared()])
    assert index.queue[rank.bit] == 0


def test_a_configured_block_size_makes_pending_blocks_count_before_any_event() -> None:
    """kv_block_size: the first burst on a prefix, before any rank has published, still
    sees what the router sent (without it nothing could be pending on a silent rank)."""
    index = KvIndex()
    index.expect_size("w0", 16)
    silent = index.rank("w0", 0)
    assert silent.block_size == 16 and not silent.blocks
    keys = prompt_keys(np.array(PROMPT), 16)
    index.expect(silent, keys, 100.0)
    assert index.match(keys, 1 << silent.bit) == {silent.bit: 4}
    assert index.queued(silent) == 4 * 16


def test_one_ranks_first_event_sizes_its_siblings_and_overrides_the_configured_size() -> None:
    index = KvIndex()
    index.expect_size("w0", 32)
    a, b, c = index.rank("w0", 0), index.rank("w0", 1), index.rank("w1", 0)
    assert (a.block_size, b.block_size, c.block_size) == (32, 32, 0)
    index.apply(a, [Stored([1], None, PROMPT[:16], 16)])  # the engine says 16
    assert (a.block_size, b.block_size, c.block_size) == (16, 16, 0)
    assert index.rank("w0", 2).block_size == 16  # a rank listed later takes it too
    index.expect_size("w0", 64)  # configured again: an event's word stands
    assert b.block_size == 16
