"""The RL rollout bursts of the makespan benchmark, seeded: the same requests for every
system within a round.

``rollout``: ``n`` independent prompts sent at once, as a rollout step sends its batch.
``grpo``: ``prompts`` prompts x ``samples`` samples each (GRPO's group), the samples of
one prompt sharing its tokens and having similar lengths (a prompt's own length, times
a small per-sample spread).

Lengths are log-normal and clipped: decode (median 32, sigma 1.0, in [4, 384]) and
prompt (median 64, in [8, 600]). Prompts are token ids (SGLang's ``input_ids``), so a
prompt's length is exact whatever the tokenizer; every request runs to its length
(``ignore_eos``, temperature 0), so a round is deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from dprouter.sim.calibrate import VOCABULARY  # token ids a tiny model's vocabulary holds

DECODE_MEDIAN, DECODE_SIGMA, DECODE_CLIP = 32, 1.0, (4, 384)
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP = 64, 1.0, (8, 600)
GROUP_SPREAD = 0.25  # sigma of a sample's length around its prompt's (GRPO)


@dataclass(frozen=True, slots=True)
class Burst:
    """One round's requests: ``prompts[i]`` with ``lengths[i]`` output tokens;
    ``groups[i]``: the index of its prompt's group (its own index outside GRPO)."""

    prompts: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    groups: tuple[int, ...]

    def body(self, i: int) -> dict[str, Any]:
        """SGLang's ``/generate`` body of request ``i``."""
        return {
            "input_ids": list(self.prompts[i]),
            "sampling_params": {
                "max_new_tokens": self.lengths[i],
                "ignore_eos": True,
                "temperature": 0,
            },
        }

    def __len__(self) -> int:
        return len(self.lengths)


def _lognormal(rng: random.Random, median: float, sigma: float, clip: tuple[int, int]) -> int:
    value = round(median * math.exp(rng.gauss(0.0, sigma)))
    return max(clip[0], min(clip[1], value))


def _prompt(rng: random.Random) -> tuple[int, ...]:
    n = _lognormal(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP)
    return tuple(rng.randrange(*VOCABULARY) for _ in range(n))


def rollout(seed: int, n: int = 48) -> Burst:
    """``n`` independent prompts, each with its own length."""
    rng = random.Random(f"rollout-{seed}")
    prompts = tuple(_prompt(rng) for _ in range(n))
    lengths = tuple(_lognormal(rng, DECODE_MEDIAN, DECODE_SIGMA, DECODE_CLIP) for _ in range(n))
    return Burst(prompts, lengths, tuple(range(n)))


def grpo(seed: int, prompts: int = 12, samples: int = 8) -> Burst:
    """``prompts`` x ``samples``: a group shares its prompt and a typical length; the
    requests are sent interleaved (one of each group, then the next), as a rollout
    worker that submits groups as it builds them would not -- the harder order."""
    rng = random.Random(f"grpo-{seed}")
    shared = [_prompt(rng) for _ in range(prompts)]
    typical = [_lognormal(rng, DECODE_MEDIAN, DECODE_SIGMA, DECODE_CLIP) for _ in range(prompts)]
    order = [(g, s) for s in range(samples) for g in range(prompts)]
    lengths = tuple(_lognormal(rng, typical[g], GROUP_SPREAD, DECODE_CLIP) for g, _ in order)
    return Burst(tuple(shared[g] for g, _ in order), lengths, tuple(g for g, _ in order))


def warmup(n: int = 8) -> Burst:
    """``n`` requests of the mean length, sent before a system's first round."""
    rng = random.Random("warmup")
    mean = round(DECODE_MEDIAN * math.exp(DECODE_SIGMA**2 / 2))
    prompts = tuple(_prompt(rng) for _ in range(n))
    return Burst(prompts, (mean,) * n, tuple(range(n)))


def lower_bound(lengths: tuple[int, ...], slots: int) -> int:
    """No routing needs fewer busiest-rank decode steps than this: the longest decode, or
    every decode spread over all ``slots`` (a request's first token comes from prefill:
    ``length - 1`` decode steps)."""
    steps = [max(0, n - 1) for n in lengths]
    return max(max(steps), math.ceil(sum(steps) / slots))
