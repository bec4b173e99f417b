"""``dprouter sim calibrate``: measure a running SGLang engine's step costs and write a
persona file that ``dprouter sim --persona-file`` loads.

The engine must log each decode step (``--decode-log-interval 1``): a rank's ``Decode
batch`` line gives its batch size and the throughput since that rank's previous line,
so batch / throughput is the step's wall time, free of HTTP and dispatch. Measured:

- decode step time against batch size: ``b`` requests of one length on every rank at
  once (pinned by ``routed_dp_rank``), b = 1 .. the per-rank cap; the median of the
  steps whose batch was ``b``, fitted as ``step_base + decode_per_seq * b``;
- the KV read: the cap's batch again with long prompts (``decode_per_kv_token``, >= 0);
- prefill against prompt length: one 1-token request per rank, its answer's wall time,
  for three lengths; the slope is ``prefill_per_token`` (the intercept, HTTP and
  dispatch included, is recorded, not modelled). Every rank computes its prompt at
  once, so under DP attention the slope holds the gathered MLP share as well
  (``gathered_share``: summed over the ranks, split over as many GPUs).

Each decode burst's lines are counted per rank as well: ``N`` output tokens cost a
rank ``N - 1`` decode steps, which is what the simulator counts. The shape and limits
(ranks, lock-step, running cap per rank, KV tokens, chunked-prefill budget, page) are
read from ``/server_info``. On shared CPU cores the times vary by tens of percent
between runs: every point is a median over ``repeats`` bursts.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits

LINE = re.compile(
    r"\[[\d-]+ [\d:]+(?: DP(?P<rank>\d+))?(?: TP\d+)?\] Decode batch, "
    r"#running-req: (?P<running>\d+), #token: (?P<tokens>\d+),.*?"
    r"gen throughput \(token/s\): (?P<rate>[0-9.]+)"
)
VOCABULARY = (10, 900)  # token ids every model's vocabulary holds, past its specials
SETTLE = 0.5  # seconds for the last step's line to reach the log after the answers


@dataclass(frozen=True)
class DecodeLine:
    rank: int
    running: int
    tokens: int  # KV tokens the rank holds
    seconds: float  # since the rank's previous line: the step, and a prefill before it


def decode_lines(text: str) -> list[DecodeLine]:
    out = []
    for m in LINE.finditer(text):
        rate = float(m["rate"])
        if rate > 0:
            running = int(m["running"])
            out.append(DecodeLine(int(m["rank"] or 0), running, int(m["tokens"]), running / rate))
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


@dataclass
class Shape:
    """What ``/server_info`` says of the engine."""

    info: dict[str, Any]

    @property
    def lockstep(self) -> bool:
        return int(self.info.get("attn_dp_size") or 1) > 1

    @property
    def ranks(self) -> int:
        return int(self.info.get("attn_dp_size") or 1) * int(self.info.get("dp_size") or 1)

    @property
    def cap(self) -> int:
        states = self.info.get("internal_states") or [{}]
        per_rank = states[0].get("effective_max_running_requests_per_dp")
        return int(per_rank or self.info["max_running_requests"])

    def config(self, cost: CostModel) -> EngineConfig:
        i = self.info
        context = int(i.get("max_req_input_len", 2047)) + 1
        kv = int(i["max_total_num_tokens"])
        limits = RankLimits(
            max_running=self.cap,
            kv_tokens=kv,
            block_size=int(i.get("page_size") or 1),
            max_model_len=min(context, kv),
        )
        return EngineConfig(
            persona="sglang",
            dp_size=self.ranks,
            tp_size=int(i.get("tp_size") or 1),
            dp_attention=self.lockstep,
            dispatch=i.get("load_balance_method") or None,
            mixed_chunk=bool(i.get("enable_mixed_chunk")),
            limits=limits,
            cost=cost,
        )


@dataclass
class Decode:
    """The decode steps of bursts of one batch size."""

    seconds: list[float] = field(default_factory=list)  # of the steps at that batch size
    tokens: list[int] = field(default_factory=list)  # KV tokens held at those steps
    lines: list[int] = field(default_factory=list)  # a rank's decode lines in a burst

    def add(self, lines: list[DecodeLine], batch: int, ranks: int) -> None:
        full = [line for line in lines if line.running == batch]
        self.seconds += [line.seconds for line in full]
        self.tokens += [line.tokens for line in full]
        per_rank = Counter(line.rank for line in lines)
        self.lines += [per_rank[r] for r in range(ranks)]

    @property
    def step(self) -> float:
        return statistics.median(self.seconds)

    @property
    def held(self) -> float:
        return statistics.fmean(self.tokens)


class Calibration:
    def __init__(self, url: str, log: Path, repeats: int, decode_tokens: int) -> None:
        self.url = url.rstrip("/")
        self.log = log
        self.repeats = repeats
        self.decode_tokens = decode_tokens
        self.rng = random.Random("calibrate")  # fresh prompts: no prefix-cache hits
        self.session: aiohttp.ClientSession
        self.shape: Shape

    def body(self, rank: int, prompt: int, tokens: int) -> dict[str, Any]:
        ids = [self.rng.randrange(*VOCABULARY) for _ in range(prompt)]
        sampling = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}
        return {"input_ids": ids, "sampling_params": sampling, "routed_dp_rank": rank}

    async def one(self, body: dict[str, Any]) -> float:
        start = time.perf_counter()
        async with self.session.post(self.url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"/generate answered {r.status}: {(await r.text())[:200]}")
            await r.read()
        return time.perf_counter() - start

    async def burst(self, per_rank: int, prompt: int, tokens: int) -> tuple[list[float], str]:
        """``per_rank`` requests on every rank at once: their wall times, the log meanwhile."""
        bodies = [
            self.body(rank, prompt, tokens)
            for _ in range(per_rank)
            for rank in range(self.shape.ranks)
        ]
        mark = self.log.stat().st_size
        times = await asyncio.gather(*(self.one(b) for b in bodies))
        await asyncio.sleep(SETTLE)
        with self.log.open("rb") as f:
            f.seek(mark)
            return list(times), f.read().decode(errors="replace")

    async def decode(self, batches: list[int], prompt: int) -> dict[int, Decode]:
        """Bursts of each batch size in turn, ``repeats`` rounds (slow spells of a shared
        machine then touch every size alike)."""
        found = {b: Decode() for b in batches}
        for _ in range(self.repeats):
            for b in batches:
                _, text = await self.burst(b, prompt, self.decode_tokens)
                found[b].add(decode_lines(text), b, self.shape.ranks)
        if not all(d.seconds for d in found.values()):
            raise RuntimeError(f"no Decode batch lines in {self.log}: --decode-log-interval 1?")
        return found

    async def prefill(self, prompts: list[int]) -> dict[int, float]:
        """Median wall seconds of a 1-token request per rank, by prompt length."""
        times: dict[int, list[float]] = {p: [] for p in prompts}
        for _ in range(self.repeats):
            for p in prompts:
                times[p] += (await self.burst(1, p, 1))[0]
        return {p: statistics.median(t) for p, t in times.items()}

    async def run(self) -> tuple[EngineConfig, dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as self.session:
            async with self.session.get(self.url + "/server_info") as r:
                self.shape = Shape(await r.json())
            cap = self.shape.cap
            for b in range(1, cap + 1):  # warm-up: each batch shape once
                await self.burst(b, 16, 8)
            short, n = 32, self.decode_tokens
            batches = list(range(1, cap + 1))
            decode = await self.decode(batches, short)
            step_base, per_seq = fit([float(b) for b in batches], [decode[b].step for b in batches])
            kv = int(self.shape.info["max_total_num_tokens"])
            chunk = int(self.shape.info.get("chunked_prefill_size") or 2048)
            long = min(max(short + 1, int(kv * 0.85) // cap - n), chunk)
            full = (await self.decode([cap], long))[cap]
            held = full.held - decode[cap].held
            per_kv = max(0.0, (full.step - decode[cap].step) / held) if held > 0 else 0.0
            lengths = [32, chunk // 2, chunk - 64]
            prefill = await self.prefill(lengths)
            overhead, per_token = fit([float(p) for p in lengths], list(prefill.values()))
        cost = CostModel(
            step_base=round(max(step_base, 0.0), 6),
            decode_per_seq=round(max(per_seq, 0.0), 7),
            prefill_per_token=round(max(per_token, 0.0), 8),
            decode_per_kv_token=round(per_kv, 10),
            max_batched_tokens=chunk,
        )
        info = self.shape.info
        measured = {
            "date": time.strftime("%Y-%m-%d"),
            "engine": {k: info.get(k) for k in ENGINE_KEYS},
            "repeats": self.repeats,
            "decode_step_seconds": {b: round(decode[b].step, 5) for b in batches},
            "decode_kv_tokens_held": {b: round(decode[b].held) for b in batches},
            f"decode_step_seconds_at_{cap}_holding_{round(full.held)}_tokens": round(full.step, 5),
            f"decode_lines_per_rank_per_burst_of_{n}_tokens": {
                b: sorted(set(decode[b].lines)) for b in batches
            },
            "prefill_request_seconds": {p: round(s, 5) for p, s in prefill.items()},
            "prefill_request_overhead_seconds": round(overhead, 5),
        }
        return self.shape.config(cost), measured


ENGINE_KEYS = (
    "version",
    "tp_size",
    "dp_size",
    "attn_dp_size",
    "max_running_requests",
    "max_total_num_tokens",
    "chunked_prefill_size",
    "schedule_policy",
    "enable_mixed_chunk",
    "disable_overlap_schedule",
    "load_balance_method",
)
