"""One DP rank: waiting queue, running batch, KV budget, prefix cache.

A step is planned (admission, chunked prefill, decode batch, cost) when it
starts and committed when it ends; requests that arrive or are aborted while a
step runs take effect at the next step, as in a real engine's busy loop.

Mixed (vLLM), a step decodes every running sequence and fills what is left of
the token budget with prefill chunks. Unmixed (SGLang without
``--enable-mixed-chunk``), a step with prefill work runs it alone and first;
the decodes wait for the next step, so a request of N output tokens costs its
rank N - 1 decode steps, its first token coming from the prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dprouter.sim.model.config import CostModel, RankLimits
from dprouter.sim.model.decode import DecodeBatch
from dprouter.sim.model.prefix import PrefixCache, block_hashes
from dprouter.sim.model.request import Phase, SimRequest
from dprouter.sim.model.stats import RankStats

KV_RUN = 32  # longest multi-step run when KV reads make each step cost more than the last


@dataclass
class RankPlan:
    cost: float  # seconds of the first step
    growth: float  # added per step: the batch's KV grows by one token per sequence
    decode: list[SimRequest]  # decoding requests, listed only when tokens are tracked
    n_decode: int
    chunks: list[tuple[SimRequest, int]]
    steps: int  # > 1 only for decode-only work: steps until the first request finishes
    waiting: int  # queue length once admission is done
    running: int  # batch size once admission is done
    prefill_tokens: int = 0
    gathered: float = 0.0  # of ``cost``: the prompt tokens' share in layers every rank gathers


@dataclass
class StepEvents:
    first: list[SimRequest] = field(default_factory=list)  # first token this step
    tokens: list[SimRequest] = field(default_factory=list)  # any token this step
    finished: list[SimRequest] = field(default_factory=list)


class Rank:
    """``track_tokens`` lists every decoding request in each step's events (the HTTP
    simulator streams them); the offline simulator only needs first and last tokens."""

    def __init__(
        self,
        index: int,
        limits: RankLimits,
        cost: CostModel,
        slow: float = 1.0,
        track_tokens: bool = True,
        record_events: bool = False,
        mixed: bool = True,
        cache_on_schedule: bool = True,
    ) -> None:
        self.index = index
        self.limits = limits
        self.cost = cost
        self.slow = slow
        self.track_tokens = track_tokens
        self.mixed = mixed
        self.cache_on_schedule = cache_on_schedule  # vLLM's way; SGLang caches once computed
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding = DecodeBatch()
        self.kv_reserved = 0  # sum of footprints of running requests: admission bound
        self.kv_used = 0  # tokens actually held: prompt + generated of running requests
        self.cache = PrefixCache(limits.cache_blocks, limits.block_size, record_events)
        self.stats = RankStats()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.limits.kv_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def enqueue(self, req: SimRequest) -> None:
        if req.footprint > self.limits.max_model_len:
            raise ValueError(f"request {req.rid} needs {req.footprint} tokens, over max_model_len")
        req.rank = self.index
        if self.num_running + len(self.waiting) >= self.limits.max_running:
            self.stats.queued += 1  # no running slot left for it, counting those ahead
        self.waiting.append(req)

    def plan(self, now: float, max_steps: int = 1) -> RankPlan | None:
        """Plan the next step; with ``max_steps`` > 1 a decode-only batch may run
        several identical steps at once (the offline simulator's fast path)."""
        n_decode = len(self.decoding)
        budget = self.cost.max_batched_tokens - (n_decode if self.mixed else 0)
        chunks: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        for req in self.prefilling:  # admitted before: they go first
            if budget <= 0:
                break
            n = min(req.prompt_len - req.computed, budget)
            chunks.append((req, n))
            budget -= n
            prefill_tokens += n
            if self.cache_on_schedule:
                self._cache(req, req.computed + n)
        # then admission, FCFS, while the step has tokens left: a request it cannot
        # start stays waiting, as in both engines' schedulers, and meets the prefix
        # cache as it is when it is admitted
        while budget > 0:
            admitted = self._admit(now)
            if admitted is None:
                break
            n = min(admitted.prompt_len - admitted.computed, budget)
            chunks.append((admitted, n))  # n 0: its KV came from a prefill engine
            budget -= n
            prefill_tokens += n
            if self.cache_on_schedule:
                self._cache(admitted, admitted.computed + n)
        if prefill_tokens and not self.mixed:
            n_decode = 0  # the prefill batch runs alone (KV sent by a prefill engine does not)
        if not n_decode and not chunks:
            return None
        c = self.cost
        cost = c.step_base + c.decode_per_seq * n_decode + c.prefill_per_token * prefill_tokens
        cost += c.decode_per_kv_token * self.kv_used
        steps = 1
        growth = c.decode_per_kv_token * n_decode * self.slow
        if max_steps > 1 and not chunks:
            steps = min(max_steps, self.decoding.steps_to_next_finish())
            if growth > 0:
                steps = min(steps, KV_RUN)  # a step's cost drifts as the KV grows
        decode = list(self.decoding.members.values()) if self.track_tokens and n_decode else []
        return RankPlan(
            cost * self.slow,
            growth,
            decode,
            n_decode,
            chunks,
            steps,
            len(self.waiting),
            self.num_running,
            prefill_tokens,
            c.prefill_per_token * prefill_tokens * c.gathered_share * self.slow,
        )

    def step_cost(self, plan: RankPlan, steps: int) -> float:
        """Mean cost of ``steps`` steps of ``plan`` (exact: the cost grows linearly)."""
        return plan.cost + plan.growth * (steps - 1) / 2

    def _admit(self, now: float) -> SimRequest | None:
        """The head of the queue into the running batch, if the batch and the KV budget
        take it (FCFS: the head blocks the queue until KV frees up)."""
        limits = self.limits
        if not self.waiting or self.num_running >= limits.max_running:
            return None
        req = self.waiting[0]
        if self.kv_reserved + req.footprint > limits.kv_tokens:
            return None
        self.waiting.popleft()
        if req.block_hashes is None:
            req.block_hashes = block_hashes(req.prompt_ids, limits.block_size, req.lora)
        # the last prompt token is always computed, so at most (len-1) tokens hit
        limit = (req.prompt_len - 1) // limits.block_size
        if req.remote_kv:  # transferred from a prefill engine: nothing to compute
            req.computed = req.prompt_len
        else:
            req.cached_tokens = self.cache.match(req.block_hashes, limit) * limits.block_size
            req.computed = req.cached_tokens
            self.stats.prefix_queries += req.prompt_len
            self.stats.prefix_hits += req.cached_tokens
        req.phase = Phase.PREFILL
        req.admitted_at = now
        self.kv_reserved += req.footprint
        self.kv_used += req.prompt_len
        self.prefilling.append(req)
        return req

    def _cache(self, req: SimRequest, computed: int) -> None:
        """The prompt's full blocks up to ``computed`` enter the prefix cache: vLLM
        caches a block when it schedules it (a request scheduled after it in the same
        step hits it), SGLang once the chunk is computed (``cache_unfinished_req``)."""
        full = computed // self.limits.block_size
        if full and req.block_hashes:
            self.cache.insert(req.block_hashes[:full], req.prompt_ids, req.lora)

    def commit(self, plan: RankPlan, now: float, events: StepEvents) -> None:
        stats = self.stats
        steps = plan.steps
        stats.busy_time += self.step_cost(plan, steps) * steps
        stats.steps += steps
        stats.prefill_steps += 1 if plan.prefill_tokens else 0
        decoding = self.decoding
        if plan.n_decode and decoding:
            stats.decode_steps += steps
            # requests aborted during the step have already left the batch
            self.kv_used += steps * len(decoding)
            stats.generation_tokens += steps * len(decoding)
            finished = decoding.advance(steps)
            for req in plan.decode:
                if req.phase is Phase.DECODE:
                    req.generated = decoding.generated(req)
                    events.tokens.append(req)
            for req in finished:
                self._finish(req, now, events)
        for req, n in plan.chunks:
            if req.phase is not Phase.PREFILL:
                continue
            req.computed += n
            if req.computed < req.prompt_len:
                if not self.cache_on_schedule:
                    self._cache(req, req.computed)
                continue
            self.prefilling.remove(req)
            if not self.cache_on_schedule:  # vLLM cached its blocks when it scheduled them
                self._cache(req, req.computed)
            stats.prompt_tokens += req.prompt_len
            req.phase = Phase.DECODE
            decoding.add(req)
            self.kv_used += 1
            stats.generation_tokens += 1
            req.first_token_at = now
            stats.ttft.observe(now - req.arrival)
            events.first.append(req)
            events.tokens.append(req)
            if req.max_tokens <= 1:
                decoding.remove(req)
                self._finish(req, now, events)

    def _release(self, req: SimRequest) -> None:
        self.kv_used -= req.prompt_len + req.generated
        self.kv_reserved -= req.footprint

    def _finish(self, req: SimRequest, now: float, events: StepEvents) -> None:
        self._release(req)
        req.phase = Phase.FINISHED
        req.finished_at = now
        self.stats.success += 1
        events.finished.append(req)

    def abort(self, req: SimRequest, now: float) -> None:
        """Drop a request wherever it is; its KV is freed at once."""
        if req.phase is Phase.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                return
        elif req.phase is Phase.PREFILL:
            self.prefilling.remove(req)
            self._release(req)
        elif req.phase is Phase.DECODE:
            self.decoding.remove(req)
            self._release(req)
        else:
            return
        req.phase = Phase.ABORTED
        req.finished_at = now
        self.stats.aborted += 1
