"""``prefix``: exact choices over literal targets, literal loads and a literal index."""

from __future__ import annotations

import numpy as np
import pytest

from dprouter.core.types import Role
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.keys import prompt_keys
from dprouter.engines.kvevents.lookup import Matcher
from dprouter.engines.kvevents.wire import Stored
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target, Worker
from dprouter.policies import (
    PolicyOptions,
    Prefix,
    QueuedBy,
    RequestInfo,
    make_policy,
    needs_tokens,
)

EVENTS = "tcp://127.0.0.1:5557"


def fleet(
    dp: int, role: Role = "regular", events: tuple[str | None, ...] = (None,)
) -> tuple[Target, ...]:
    """One worker of ``dp`` ranks per entry of ``events`` (its KV-event publisher)."""
    registry = Registry()
    for i, publisher in enumerate(events):
        url = f"http://127.0.0.1:{9000 + i}"
        worker = Worker(id=f"w{i}", url=url, role=role, dialect="vllm", kv_events=publisher)
        w = registry.add(worker)
        w.ranks = dp
        registry.mark_ready(w)
    return registry.snapshot.pool(role)


def load(targets: tuple[Target, ...], *requests: int, tokens: tuple[int, ...] = ()) -> None:
    for i, t in enumerate(targets):
        t.outstanding = requests[i] if i < len(requests) else 0
        t.outstanding_tokens = tokens[i] if i < len(tokens) else 0


def picks(targets: tuple[Target, ...], info: RequestInfo, n: int, **options: float) -> list[str]:
    policy = make_policy("prefix", PolicyOptions(**options))  # type: ignore[arg-type]
    return [policy.select(targets, info).label for _ in range(n)]


def test_it_asks_for_token_ids_and_the_others_do_not() -> None:
    assert needs_tokens(make_policy("prefix"))
    assert not needs_tokens(make_policy("least_load"))
    assert not needs_tokens(make_policy("cache_aware"))


def test_nothing_held_is_load_balancing_with_a_rotating_tie_break() -> None:
    targets = fleet(4)
    assert picks(targets, RequestInfo(), 5) == ["w0/1", "w0/2", "w0/3", "w0/0", "w0/1"]
    load(targets, 2, 0, 1, 0)
    assert picks(targets, RequestInfo(), 3) == ["w0/1", "w0/3", "w0/3"]  # from 1, 2, 3
    assert picks(targets, RequestInfo(prefix=Prefix(8, {})), 2) == ["w0/1", "w0/3"]


def test_the_holder_of_the_longest_prefix_wins_at_equal_load() -> None:
    targets = fleet(4)
    info = RequestInfo(prefix=Prefix(8, {"w0/2": 8, "w0/3": 5}))
    assert picks(targets, info, 3) == ["w0/2", "w0/2", "w0/2"]


def test_a_prefix_being_computed_counts_for_less_than_a_stored_one() -> None:
    """A GRPO group's samples find their prompt pending where the first went: counted at
    0.65 of a stored block, a holder one request busier than the rest loses them sooner."""
    targets = fleet(4)
    # loads 2,1,1,1: mean 1.25; a request costs 1 / 2.25 = 0.44; held whole: bonus 4
    load(targets, 2, 1, 1, 1)
    stored = RequestInfo(prefix=Prefix(8, {"w0/0": 8, "w0/1": 8}, stored={"w0/0": 8, "w0/1": 8}))
    assert picks(targets, stored, 1) == ["w0/1"]  # 4 - 0.44 > 4 - 0.89
    # w0/0 has it stored, w0/1 only pending: 4 - 0.89 = 3.11 > 2.6 - 0.44 = 2.16
    pending = RequestInfo(prefix=Prefix(8, {"w0/0": 8, "w0/1": 8}, stored={"w0/0": 8}))
    assert picks(targets, pending, 1) == ["w0/0"]
    # where nothing is stored yet, the holders' pending blocks are what counts
    both = RequestInfo(prefix=Prefix(8, {"w0/0": 8, "w0/1": 8}, stored={}))
    assert picks(targets, both, 1) == ["w0/1"]


def test_affinity_holds_within_the_formula_then_yields_to_load() -> None:
    targets = fleet(4)
    info = RequestInfo(prefix=Prefix(4, {"w0/0": 4}))
    # at prefix weight 1 (the default before bench prefix): loads 1,0,0,0: mean 0.25;
    # w0/0 scores 1 - 1/1.25 = 0.2 > 0 -> kept
    load(targets, 1)
    assert picks(targets, info, 1, prefix_weight=1.0) == ["w0/0"]
    # loads 2,0,0,0: mean 0.5; 1 - 2/1.5 < 0 -> the idle ones
    load(targets, 2)
    assert picks(targets, info, 2, prefix_weight=1.0) == ["w0/1", "w0/2"]
    # a bigger prefix weight keeps it: 3 - 2/1.5 > 0; so does the default, 4
    assert picks(targets, info, 1, prefix_weight=3.0) == ["w0/0"]
    assert picks(targets, info, 1) == ["w0/0"]


def test_by_default_a_conversation_keeps_its_rank_over_a_one_request_difference() -> None:
    targets = fleet(4)
    # w0/0 holds the conversation (1,800 of 2,000 tokens), w0/1 its system prompt only
    info = RequestInfo(tokens=2000, prefix=Prefix(2000, {"w0/0": 1800, "w0/1": 1500}))
    load(targets, 3, 2, 2, 2)  # mean 2.25: one request costs 1 / 3.25 = 0.31
    # weight 1: 0.9 - 3/3.25 = -0.02 < 0.75 - 2/3.25 = 0.13 -> it leaves (bench prefix)
    assert picks(targets, info, 1, prefix_weight=1.0, token_weight=0.0) == ["w0/1"]
    # weight 4: 3.6 - 0.92 = 2.68 > 3.0 - 0.62 = 2.38 -> it stays
    assert picks(targets, info, 1, token_weight=0.0) == ["w0/0"]


def test_prefill_queued_on_a_target_sends_a_prompt_to_be_computed_elsewhere() -> None:
    targets = fleet(2)
    # w0/0 has one request fewer but 2,000 tokens of prefill queued; the prompt's 1,000:
    # w0/0 costs 0 + 2000/1001 = 2.0, w0/1 1/1.5 = 0.67 (tokens in flight equal)
    load(targets, 0, 1)
    info = RequestInfo(tokens=1000, prefix=Prefix(1000, {}, QueuedBy({"w0/0": 2000})))
    assert picks(targets, info, 2, token_weight=0.0) == ["w0/1", "w0/1"]
    assert picks(targets, info, 2, token_weight=0.0, queue_weight=0.0) == ["w0/0", "w0/0"]
    # a held prompt outweighs a short queue: 4 x 0.9 - 200/1001 > -0.67
    queued = QueuedBy({"w0/0": 200})
    held = RequestInfo(tokens=1000, prefix=Prefix(1000, {"w0/0": 900}, queued))
    assert picks(targets, held, 1, token_weight=0.0) == ["w0/0"]


def test_queued_tokens_weigh_against_the_prompts_tokens_not_a_short_estimate() -> None:
    """The estimate counts a prompt's characters / 4; a chat's 1,000 tokens estimated at
    500 would weigh each queued token twice against a held one."""
    targets = fleet(2)
    queued = QueuedBy({"w0/0": 1500})
    # w0/0 holds 600 of 1,000 tokens: 4 x 0.6 = 2.4 > 1500 / 1001 = 1.5 -> it stays
    # (over the estimate it was 1500 / 501 = 3.0 > 2.4: it left)
    short = RequestInfo(tokens=500, prefix=Prefix(1000, {"w0/0": 600}, queued))
    assert picks(targets, short, 2, token_weight=0.0) == ["w0/0", "w0/0"]
    # an estimate past the prompt (its output) is kept: 3000 / 2001 = 1.5 < 2.4
    long = RequestInfo(tokens=2000, prefix=Prefix(1000, {"w0/0": 600}, QueuedBy({"w0/0": 3000})))
    assert picks(targets, long, 2, token_weight=0.0) == ["w0/0", "w0/0"]
    # and a queue past the held prefix's worth still sends it elsewhere: 2600 / 1001 > 2.4
    past = RequestInfo(tokens=500, prefix=Prefix(1000, {"w0/0": 600}, QueuedBy({"w0/0": 2600})))
    assert picks(targets, past, 2, token_weight=0.0) == ["w0/1", "w0/1"]


def test_over_a_prefill_pool_the_queue_stands_for_requests_and_tokens_in_flight() -> None:
    """A prefill rank's work ahead is its queued prefill; its turns in flight count the
    same prompts again, and swing with each arrival."""
    targets = fleet(4, "prefill", (EVENTS,))
    # two turns on w0/0, the other ranks idle (bound 1.5 x 1.5 = 2.25: its prefix counts);
    # the conversation's 600 of 1,000 tokens are on w0/0, its system prompt's 200 on w0/1
    load(targets, 2, 0, 0, 0, tokens=(1200, 0, 0, 0))
    queued = QueuedBy({"w0/0": 400})
    info = RequestInfo(tokens=1000, prefix=Prefix(1000, {"w0/0": 600, "w0/1": 200}, queued))
    # 4 x 0.6 - 400 / 1001 = 2.0 > 4 x 0.2 = 0.8: it stays (a regular pool adds
    # 2 / 1.5 + 1200 / 1301 = 2.26 to w0/0's cost and sends it to w0/1)
    assert picks(targets, info, 2) == ["w0/0", "w0/0"]
    regular = fleet(4)
    load(regular, 2, 0, 0, 0, tokens=(1200, 0, 0, 0))
    assert picks(regular, info, 1) == ["w0/1"]
    # with the queue term off, load is all a prefill pool has to go by
    assert picks(targets, info, 1, queue_weight=0.0) == ["w0/1"]
    # with nothing looked up (its engines publish nothing) it balances load
    assert picks(targets, RequestInfo(tokens=1000), 3) == ["w0/1", "w0/2", "w0/3"]


def test_a_prefill_pool_partly_followed_still_counts_load() -> None:
    """A prefill worker that publishes no events reads 0 queued: with load not counted it
    would look free to every prompt. In a pool where one does, load counts as anywhere."""
    targets = fleet(1, "prefill", (EVENTS, None))  # w0 followed, w1 not
    load(targets, 0, 3, tokens=(0, 3000))
    info = RequestInfo(tokens=1000, prefix=Prefix(1000, {}, QueuedBy({"w0": 500})))
    assert picks(targets, info, 1) == ["w0"]  # w1's three prompts in flight count
    followed = fleet(1, "prefill", (EVENTS, EVENTS))
    load(followed, 0, 3, tokens=(0, 3000))
    assert picks(followed, info, 1) == ["w1"]  # its queue is known: nothing there


def test_the_bound_spreads_a_hot_prefix_whatever_its_weight() -> None:
    targets = fleet(4)
    info = RequestInfo(prefix=Prefix(4, {"w0/0": 4, "w0/1": 4}))
    # loads 4,3,0,0: mean 1.75; bound 1.5 x 2.75 = 4.125: both holders count
    load(targets, 4, 3)
    assert picks(targets, info, 1, prefix_weight=100.0) == ["w0/1"]
    # loads 6,5,0,0: mean 2.75; bound 5.625: w0/0 (6) is past it, w0/1 (5) is not
    load(targets, 6, 5)
    assert picks(targets, info, 1, prefix_weight=100.0) == ["w0/1"]
    # loads 7,7,0,0: mean 3.5; bound 6.75: neither counts -> the idle ranks take it
    load(targets, 7, 7)
    assert picks(targets, info, 3, prefix_weight=100.0) == ["w0/2", "w0/2", "w0/3"]


def test_tokens_in_flight_weigh_against_the_prompt_size() -> None:
    targets = fleet(2)
    # equal requests; w0/0 holds 1,000 more tokens: 1000 / (500 + 100 + 1) away
    load(targets, 1, 1, tokens=(1000, 0))
    assert picks(targets, RequestInfo(tokens=100), 1) == ["w0/1"]
    half = RequestInfo(tokens=100, prefix=Prefix(2, {"w0/0": 1}))
    assert picks(targets, half, 1, prefix_weight=1.0) == ["w0/1"]  # 0.5 - 1000/601 < 0
    # 0.5 - 0.42 > 0; and at the default prefix weight 4: 2 - 1.66 > 0
    assert picks(targets, half, 1, prefix_weight=1.0, token_weight=0.25) == ["w0/0"]
    assert picks(targets, half, 1) == ["w0/0"]


def test_a_literal_index_feeds_the_choice() -> None:
    targets = fleet(4)
    index = KvIndex()
    prompt = list(range(100, 164))  # 4 blocks of 16
    index.apply(index.rank("w0", 1), [Stored([1, 2, 3, 4], None, prompt, 16)])
    index.apply(index.rank("w0", 3), [Stored([9, 8], None, prompt[:32], 16)])
    keys = prompt_keys(np.array([*prompt, 7, 7, 7]), 16)
    among = sum(1 << index.ranks[("w0", r)].bit for r in (1, 3))
    held = index.match(keys, among)
    by_bit = {r.bit: f"{name}/{rank}" for (name, rank), r in index.ranks.items()}
    prefix = Prefix(len(keys), {by_bit[bit]: n for bit, n in held.items()})
    assert prefix == Prefix(4, {"w0/1": 4, "w0/3": 2})
    assert picks(targets, RequestInfo(prefix=prefix), 2) == ["w0/1", "w0/1"]


@pytest.mark.parametrize("dp", [1, 2])
def test_one_target_is_the_answer(dp: int) -> None:
    targets = fleet(dp)[:1]
    assert picks(targets, RequestInfo(prefix=Prefix(1, {"x": 1})), 1) == [targets[0].label]


def test_a_prompt_sent_is_pending_on_its_target_for_the_next_lookup() -> None:
    targets = fleet(4)
    index = KvIndex()
    prompt = list(range(100, 164))  # 4 blocks of 16
    for r in range(4):  # every rank has stored something: block sizes known
        index.apply(index.rank("w0", r), [Stored([50 + r], None, [r] * 16, 16)])
    matcher = Matcher(index)
    ids = np.array(prompt)
    found = matcher.match(targets, ids, 1.0)
    assert found.prefix == Prefix(64, {})  # nothing pending anywhere
    policy = make_policy("prefix")
    first = policy.select(targets, RequestInfo(tokens=64, prefix=found.prefix))
    matcher.sent(found, first, 1.0)
    again = matcher.match(targets, ids, 2.0).prefix
    assert again.held == {first.label: 64} and again.queued is not None
    assert again.queued.of(targets).tolist() == [64 if t is first else 0 for t in targets]
    assert (
        again.queued.of(targets[::-1]).tolist() == [64 if t is first else 0 for t in targets][::-1]
    )
    assert matcher.match(targets, ids, 1.0 + index.ttl).prefix == Prefix(64, {})
