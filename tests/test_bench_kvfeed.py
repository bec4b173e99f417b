"""The offline bench's KV-event feed: the index is what the simulated ranks' events say."""

from __future__ import annotations

from dprouter.bench.harness.sim_router import SimRouter, run_sessions
from dprouter.bench.harness.workloads import ChatSessions
from dprouter.sim.model.config import EngineConfig, RankLimits

U64 = (1 << 64) - 1


def test_the_index_holds_what_every_rank_holds_after_evictions_and_a_flush() -> None:
    limits = RankLimits(max_running=16, prefix_cache_blocks=300)  # evicts: ~100 blocks a turn
    configs = [EngineConfig(dp_size=2, limits=limits)] * 2
    router = SimRouter(configs, "prefix")
    chat = ChatSessions(sessions=40, turns=3, systems=4, system_len=1000, spread=4.0)
    _, sim = run_sessions(configs, router, chat, flushes=[(2.0, [0])])
    feed = router.feed
    assert feed is not None
    feed.deliver(float("inf"))  # what is still on its way
    counts = feed.index.counts
    assert counts.removed > 0 and counts.cleared == 2 and counts.orphans == counts.dropped == 0
    for e, engine in enumerate(sim.cluster.engines):
        for rank in engine.ranks:
            held = feed.index.ranks[(f"e{e}", rank.index)].blocks
            assert set(held) == {h & U64 for h in rank.cache.blocks()}, (e, rank.index)


def test_the_index_learns_only_from_events_delivered_by_the_time_of_a_lookup() -> None:
    configs = [EngineConfig(dp_size=2)]
    router = SimRouter(configs, "prefix")
    _, sim = run_sessions(configs, router, ChatSessions(sessions=4, turns=1, spread=1.0))
    feed = router.feed
    assert feed is not None
    total = sum(len(r.cache) for r in sim.cluster.engines[0].ranks)
    assert 0 < feed.index.size < total  # the last prompt was stored after the last lookup
    feed.deliver(sim.cluster.now + feed.delay)
    assert feed.index.size == total
