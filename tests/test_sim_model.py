"""The engine model in virtual time: admission, step costs, prefix cache, lock-step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits
from dprouter.sim.model.engine import Engine
from dprouter.sim.model.prefix import PrefixCache, block_hashes
from dprouter.sim.model.request import Phase, SimRequest
from dprouter.sim.offline.offline import Arrival, Cluster, OfflineSim

COST = CostModel()


def req(
    rid: str, prompt: int, max_tokens: int, rank: int | None = None, t: float = 0.0, base: int = 0
) -> SimRequest:
    return SimRequest(rid, list(range(base, base + prompt)), max_tokens, t, rank)


def ttft(r: SimRequest) -> float:
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def run(engine: Engine) -> float:
    """Step every stepper of ``engine`` until idle; returns the last end time."""
    end = 0.0
    for stepper in engine.steppers:
        t = 0.0
        while (plan := stepper.begin(t)) is not None:
            t = plan.end
            engine.end(plan, t)
        end = max(end, t)
    return end


def test_kv_budget_admits_only_what_fits_and_frees_on_finish() -> None:
    limits = RankLimits(kv_tokens=1000, max_model_len=500)
    engine = Engine(EngineConfig(limits=limits))
    reqs = [req(f"r{i}", 300, 100, rank=0, base=1000 * i) for i in range(3)]
    for r in reqs:
        engine.add(r, 0.0)
    stepper = engine.steppers[0]
    plan = stepper.begin(0.0)
    assert plan is not None
    assert [r.phase for r in reqs] == [Phase.PREFILL, Phase.PREFILL, Phase.WAITING]
    assert engine.ranks[0].kv_reserved == 800  # footprints: prompt + max_tokens
    engine.end(plan, plan.end)
    assert engine.ranks[0].kv_used == 602  # two prompts and their first tokens
    run(engine)
    assert all(r.phase is Phase.FINISHED and r.generated == 100 for r in reqs)
    assert reqs[2].admitted_at == reqs[0].finished_at  # admitted once KV was freed
    assert engine.ranks[0].kv_used == 0 and engine.ranks[0].kv_reserved == 0


def test_chunked_prefill_costs_uncached_tokens_within_the_step_budget() -> None:
    engine = Engine(EngineConfig())
    r = req("long", 20_000, 2, rank=0)
    engine.add(r, 0.0)
    run(engine)
    chunks = [8192, 8192, 20_000 - 2 * 8192]
    prefill = sum(COST.step_base + COST.prefill_per_token * n for n in chunks)
    assert r.first_token_at == pytest.approx(prefill)
    decode = COST.step_base + COST.decode_per_seq
    assert r.finished_at == pytest.approx(prefill + decode)


def test_prefix_hit_is_whole_blocks_short_of_the_last_token_and_lowers_ttft() -> None:
    engine = Engine(EngineConfig())
    first = req("a", 1000, 4, rank=0)
    engine.add(first, 0.0)
    run(engine)
    again = req("b", 1000, 4, rank=0)
    engine.add(again, 0.0)
    run(engine)
    assert first.cached_tokens == 0
    assert again.cached_tokens == (999 // 16) * 16  # 992: the last token is always computed
    assert ttft(again) < ttft(first) / 5
    stats = engine.ranks[0].stats
    assert (stats.prefix_queries, stats.prefix_hits) == (2000, 992)


def test_prefix_cache_evicts_least_recently_used_blocks() -> None:
    cache = PrefixCache(capacity_blocks=4)
    a = block_hashes(list(range(32)), 16)
    b = block_hashes(list(range(100, 132)), 16)
    c = block_hashes(list(range(200, 232)), 16)
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a, 2) == 2  # touches a: b is now the oldest
    cache.insert(c)
    assert (cache.match(a, 2), cache.match(b, 2), cache.match(c, 2)) == (2, 0, 2)


def test_block_hashes_chain_so_a_shared_prefix_matches_only_up_to_the_first_difference() -> None:
    x = block_hashes([1] * 48, 16)
    y = block_hashes([1] * 16 + [2] * 16 + [1] * 16, 16)
    assert x[0] == y[0] and x[1] != y[1] and x[2] != y[2]
    assert len(block_hashes(list(range(47)), 16)) == 2  # a partial tail block is not cached


def _lone_request_tpot(dp_attention: bool) -> float:
    config = EngineConfig(dp_size=2, dp_attention=dp_attention)
    load = [Arrival(0.0, list(range(i * 100, i * 100 + 64)), 200) for i in range(100)]
    lone = Arrival(0.5, list(range(90_000, 90_064)), 50)
    result: dict[str, SimRequest] = {}

    def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
        return 0, (1 if a is lone else 0)

    def finished(a: Arrival, r: SimRequest) -> None:
        if a is lone:
            result["lone"] = r

    OfflineSim([config], route, on_finish=finished).run([*load, lone])
    r = result["lone"]
    assert r.finished_at is not None and r.first_token_at is not None
    return (r.finished_at - r.first_token_at) / (r.generated - 1)


def test_dp_attention_lock_step_makes_a_lone_request_wait_for_the_loaded_rank() -> None:
    alone = _lone_request_tpot(dp_attention=False)
    locked = _lone_request_tpot(dp_attention=True)
    assert alone == pytest.approx(COST.step_base + COST.decode_per_seq)
    assert locked == pytest.approx(COST.step_base + 100 * COST.decode_per_seq)  # rank 0's step
    assert locked > 2 * alone


def _prefill_time(dp_attention: bool, ranks: list[int]) -> float:
    """How long one 4,000-token prompt takes, sent at once to each of ``ranks``."""
    engine = Engine(EngineConfig(persona="sglang", dp_size=4, dp_attention=dp_attention))
    sent = [req(f"r{i}", 4000, 1, rank=rank) for i, rank in enumerate(ranks)]
    for r in sent:
        engine.add(r, 0.0)
    run(engine)
    return max(ttft(r) for r in sent)


def test_under_dp_attention_a_prompt_computed_on_more_ranks_costs_the_engine_more() -> None:
    """SGLang gathers every attention-DP rank's tokens for the MLP (``dp_gather``) and
    splits that work over all the engine's GPUs: the same prompt computed on four ranks at
    once takes longer than on one, though each rank computes only its own."""
    p, share = COST.prefill_per_token * 4000, COST.gathered_share
    one = _prefill_time(True, [0])
    four = _prefill_time(True, [0, 1, 2, 3])
    assert one == pytest.approx(COST.step_base + p * (1 - share) + p * share / 4)
    assert four == pytest.approx(COST.step_base + p)
    assert four > 1.5 * one
    # without DP attention each rank has its own GPUs: four at once cost what one does
    assert _prefill_time(False, [0, 1, 2, 3]) == pytest.approx(_prefill_time(False, [0]))
    assert _prefill_time(False, [0]) == pytest.approx(COST.step_base + p)


def test_vllm_dispatch_sends_a_burst_inside_one_stats_interval_to_one_rank() -> None:
    engine = Engine(EngineConfig(dp_size=4))
    burst = [req(f"b{i}", 10, 4, t=0.001 * i) for i in range(8)]
    for r in burst:
        engine.add(r, r.arrival)
    assert [r.rank for r in burst] == [0] * 8
    later = req("later", 10, 4, t=0.2)  # the next snapshot shows rank 0's queue
    engine.add(later, 0.2)
    assert later.rank == 1


def test_vllm_dispatch_with_local_reservation_spreads_a_burst() -> None:
    engine = Engine(EngineConfig(dp_size=4, reserve_locally=True))
    burst = [req(f"b{i}", 10, 4) for i in range(8)]
    for r in burst:
        engine.add(r, 0.0)
    assert [r.rank for r in burst] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_sglang_dispatch_modes() -> None:
    rr = Engine(EngineConfig(persona="sglang", dp_size=3))
    placed = [rr.add(r, 0.0) and r.rank for r in (req(f"r{i}", 8, 2) for i in range(6))]
    assert placed == [0, 1, 2, 0, 1, 2]

    legacy = EngineConfig(persona="sglang", legacy_sglang=True, dp_size=3)
    sq = Engine(replace(legacy, dispatch="shortest_queue"))
    for i in range(3):
        sq.add(req(f"p{i}", 8, 2, rank=0), 0.0)
    sq.add(req("p3", 8, 2, rank=2), 0.0)
    free = req("free", 8, 2)
    sq.add(free, 0.0)
    assert free.rank == 1

    # SGLang 0.5.23's balancers by load: the counts read at the first pick (here: rank 0
    # holds 3, rank 2 holds 1), plus one request per pick until the next read
    for method in ("total_requests", "total_tokens"):
        budget = Engine(EngineConfig(persona="sglang", dp_size=3, dispatch=method))
        for i in range(3):
            budget.add(req(f"p{i}", 8, 2, rank=0), 0.0)
        budget.add(req("p3", 8, 2, rank=2), 0.0)
        burst = [req(f"b{i}", 8, 2) for i in range(5)]
        for r in burst:
            budget.add(r, 0.001)
        assert [r.rank for r in burst] == [1, 1, 2, 1, 2], method
    with pytest.raises(ValueError, match="sglang dispatch must be one of"):
        EngineConfig(persona="sglang", dispatch="shortest_queue")  # gone in 0.5.23

    room = Engine(EngineConfig(persona="sglang", dp_size=4, dispatch="follow_bootstrap_room"))
    r = req("room", 8, 2)
    r.bootstrap_room = 4 * 1_000_003 + 3
    room.add(r, 0.0)
    assert r.rank == 3
    with pytest.raises(ValueError, match="bootstrap_room should not be None"):
        room.add(req("no-room", 8, 2), 0.0)


def test_abort_frees_kv_and_counts() -> None:
    engine = Engine(EngineConfig())
    r = req("x", 100, 50, rank=0)
    engine.add(r, 0.0)
    stepper = engine.steppers[0]
    plan = stepper.begin(0.0)
    assert plan is not None
    engine.end(plan, plan.end)
    engine.abort(r, plan.end)
    assert r.phase is Phase.ABORTED
    rank = engine.ranks[0]
    assert (rank.kv_used, rank.kv_reserved, rank.num_running, rank.stats.aborted) == (0, 0, 0, 1)
    assert stepper.begin(plan.end) is None


def test_multi_step_fast_path_gives_the_same_timeline_as_single_steps() -> None:
    configs = [EngineConfig(dp_size=4), EngineConfig(dp_size=4, dp_attention=True)]
    arrivals = [
        Arrival(0.003 * i, list(range(i % 7 * 50, i % 7 * 50 + 40 + i % 13 * 31)), 5 + i % 29)
        for i in range(400)
    ]

    def timeline(max_steps: int) -> list[tuple[float, float]]:
        seen: list[tuple[float, float]] = []
        count = iter(range(10**9))

        def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
            n = next(count)
            return n % 2, (n // 2) % 4 if n % 3 else None

        def finished(a: Arrival, r: SimRequest) -> None:
            seen.append((round(r.first_token_at or 0, 9), round(r.finished_at or 0, 9)))

        OfflineSim(configs, route, on_finish=finished, max_steps=max_steps).run(arrivals)
        return sorted(seen)

    assert timeline(1) == timeline(1 << 20)


def test_kv_read_costs_grow_each_step_and_the_fast_path_keeps_up() -> None:
    kv = CostModel(decode_per_kv_token=2e-7)
    configs = [
        EngineConfig(dp_size=2, cost=kv),
        EngineConfig(dp_size=2, cost=kv, dp_attention=True),
    ]
    arrivals = [
        Arrival(0.002 * i, list(range(i * 7, i * 7 + 300 + i % 5 * 200)), 40 + i % 9 * 30)
        for i in range(120)
    ]

    def finishes(max_steps: int) -> list[float]:
        seen: list[float] = []
        count = iter(range(10**9))

        def route(cluster: Cluster, a: Arrival) -> tuple[int, int | None]:
            n = next(count)
            return n % 2, n // 2 % 2

        def finished(a: Arrival, r: SimRequest) -> None:
            seen.append(r.finished_at or 0.0)

        OfflineSim(configs, route, on_finish=finished, max_steps=max_steps).run(arrivals)
        return sorted(seen)

    exact, fast = finishes(1), finishes(1 << 20)
    assert max(abs(a - b) / a for a, b in zip(exact, fast, strict=True)) < 0.01
    plain = Engine(EngineConfig(cost=kv))
    r = req("kv", 1000, 3, rank=0)
    plain.add(r, 0.0)
    run(plain)
    # prefill, then two decode steps that read 1001 and 1002 tokens of KV
    prefill = COST.step_base + COST.prefill_per_token * 1000 + 2e-7 * 1000
    decode = [COST.step_base + COST.decode_per_seq + 2e-7 * k for k in (1001, 1002)]
    assert r.finished_at == pytest.approx(prefill + sum(decode))


@pytest.mark.parametrize(("persona", "computed"), [("vllm", 1), ("sglang", 3)])
def test_a_group_sent_together_computes_its_prompt_as_the_engine_does(
    persona: str, computed: int
) -> None:
    """Four requests of one 3,000-token prompt at once on one rank: vLLM caches a block when
    it schedules it, so the rest hit it from the same step on; SGLang caches it once
    computed, so the three the first prefill batch takes (8,192 tokens: the third as a
    first chunk) compute it, and the last, admitted after, hits it."""
    engine = Engine(EngineConfig(persona=persona))  # type: ignore[arg-type]
    prompt = list(range(3000))
    for i in range(4):
        engine.add(SimRequest(f"r{i}", prompt, 4, 0.0), 0.0)
    now, finished = 0.0, list[SimRequest]()
    while len(finished) < 4:
        plan = engine.steppers[0].begin(now)
        assert plan is not None
        now = plan.end
        finished += engine.end(plan, now).finished
    hits = [r.cached_tokens for r in sorted(finished, key=lambda r: r.rid)]
    full = (len(prompt) - 1) // 16 * 16
    assert hits.count(0) == computed
    assert hits[computed:] == [full] * (4 - computed)
