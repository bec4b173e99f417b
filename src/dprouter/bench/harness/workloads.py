"""Seeded workloads for the offline scenarios.

Token ids stand for text: a turn's prompt is the whole conversation so far
(system prompt, earlier turns, the new message), so an engine's prefix cache
sees what a real one would -- except the answers' own KV, which the simulated
engines do not keep (hit rates here are a little low, for every policy alike).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dprouter.sim.model.request import SimRequest
from dprouter.sim.offline.offline import Arrival


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(24) for _ in range(n)]


@dataclass
class _Session:
    key: str
    context: list[int]
    turns_left: int
    started: float = 0.0
    sent: dict[int, float] = field(default_factory=dict)  # id(arrival) -> time it was sent


@dataclass
class RolloutSessions:
    """RL rollouts: agentic sessions with long, heavy-tailed decodes and no think time.

    Every session runs ``turns`` turns back to back; a turn's output length is
    log-normal (median ``decode_median``, capped), the next prompt adds a tool
    result of 100-600 tokens. ``episodes`` keeps each session's (start, end) -- an
    RL step ends when its last episode does."""

    sessions: int = 128
    turns: int = 6
    decode_median: int = 900
    decode_sigma: float = 0.9
    decode_cap: int = 6000
    system: int = 400
    seed: int = 0
    spread: float = 2.0  # sessions start over this many seconds
    max_context: int = 30_000  # a session ends before its context would outgrow the engines
    episodes: dict[str, tuple[float, float]] = field(default_factory=dict)
    _rng: random.Random = field(init=False)
    _state: dict[str, _Session] = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._state = {}

    def _decode(self) -> int:
        n = int(self._rng.lognormvariate(0, self.decode_sigma) * self.decode_median)
        return max(16, min(self.decode_cap, n))

    def first_turns(self) -> list[Arrival]:
        system = tokens(self._rng, self.system)
        out = []
        for i in range(self.sessions):
            s = _Session(f"rollout-{i}", system + tokens(self._rng, 200), self.turns)
            self._state[s.key] = s
            t = s.started = self._rng.uniform(0, self.spread)
            out.append(
                Arrival(t, list(s.context), self._decode(), key=s.key, limit=self.decode_cap)
            )
        return sorted(out, key=lambda a: a.time)

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None:
        s = self._state[done.key or ""]
        s.turns_left -= 1
        self.episodes[s.key] = (s.started, now)  # the end so far
        if s.turns_left <= 0:
            return None
        s.context = s.context + tokens(self._rng, done.max_tokens + self._rng.randint(100, 600))
        decode = self._decode()
        if len(s.context) + decode > self.max_context:
            return None
        return Arrival(now, list(s.context), decode, key=s.key, limit=self.decode_cap)


@dataclass
class ChatSessions:
    """Multi-turn chat: ``systems`` shared system prompts (0: every session its own, the
    low-sharing control), a few turns each, a pause to read between turns."""

    sessions: int = 400
    turns: int = 4
    systems: int = 8
    system_len: int = 1500
    seed: int = 0
    spread: float = 20.0
    think: float = 2.0
    _rng: random.Random = field(init=False)
    _state: dict[str, _Session] = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._state = {}

    def first_turns(self) -> list[Arrival]:
        shared = [tokens(self._rng, self.system_len) for _ in range(max(self.systems, 1))]
        out = []
        for i in range(self.sessions):
            system = shared[i % len(shared)] if self.systems else tokens(self._rng, self.system_len)
            s = _Session(
                f"chat-{i}", system + tokens(self._rng, self._rng.randint(20, 120)), self.turns
            )
            self._state[s.key] = s
            t = self._rng.uniform(0, self.spread)
            out.append(Arrival(t, list(s.context), self._rng.randint(40, 240), key=s.key))
        return sorted(out, key=lambda a: a.time)

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None:
        s = self._state[done.key or ""]
        s.turns_left -= 1
        if s.turns_left <= 0:
            return None
        s.context = s.context + tokens(self._rng, done.max_tokens + self._rng.randint(20, 120))
        when = now + self._rng.expovariate(1 / self.think)
        return Arrival(when, list(s.context), self._rng.randint(40, 240), key=s.key)


@dataclass
class HotPrompt:
    """One long system prompt shared by every request, ``concurrency`` clients each
    sending its next request as soon as the last is answered, ``requests`` in all: a
    chat product's opening burst."""

    requests: int = 400
    concurrency: int = 64
    system_len: int = 20_000
    seed: int = 0
    _rng: random.Random = field(init=False)
    _system: list[int] = field(init=False)
    _sent: int = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._system = tokens(self._rng, self.system_len)
        self._sent = 0

    def _request(self, client: str, when: float) -> Arrival:
        self._sent += 1
        prompt = self._system + tokens(self._rng, self._rng.randint(20, 120))
        return Arrival(when, prompt, self._rng.randint(40, 240), key=client)

    def first_turns(self) -> list[Arrival]:
        starts = sorted(self._rng.uniform(0, 0.05) for _ in range(self.concurrency))
        return [self._request(f"client-{i}", t) for i, t in enumerate(starts)]

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None:
        if self._sent >= self.requests:
            return None
        return self._request(done.key or "", now)


@dataclass
class GrpoGroups:
    """GRPO rollouts: ``groups`` prompts, each sent as ``samples`` concurrent requests
    (one group every ``gap`` seconds, open loop), a prompt of about ``prompt_len``
    tokens each; outputs log-normal (median ``decode_median``). ``group`` of an
    arrival's prompt object: its group's index."""

    groups: int = 16
    samples: int = 8
    prompt_len: int = 4500
    gap: float = 1.0
    decode_median: int = 256
    decode_cap: int = 1024
    seed: int = 0
    group: dict[int, int] = field(default_factory=dict)  # id(prompt_ids) -> group
    arrivals: list[Arrival] = field(init=False)  # every sample, in arrival order

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.arrivals = []
        for g in range(self.groups):
            prompt = tokens(rng, self.prompt_len + rng.randint(-300, 300))
            self.group[id(prompt)] = g
            for _ in range(self.samples):
                n = int(rng.lognormvariate(0, 0.6) * self.decode_median)
                self.arrivals.append(
                    Arrival(g * self.gap, prompt, max(32, min(self.decode_cap, n)))
                )

    def first_turns(self) -> list[Arrival]:
        return self.arrivals

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None:
        return None  # open loop: every sample is sent at its group's time


@dataclass
class SharedGroups:
    """Groups of prompts sharing a system prompt, sent in order by ``concurrency``
    closed-loop clients: ``groups`` system prompts of ``system_len`` tokens, each with
    ``per_group`` questions of ``question`` tokens, answers of exactly ``output``; each
    request carries its group as its routing key."""

    groups: int = 16
    per_group: int = 32
    system_len: int = 4096
    question: int = 128
    output: int = 256
    concurrency: int = 64
    seed: int = 0
    group: dict[int, int] = field(default_factory=dict)  # id(prompt_ids) -> group
    _queue: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._queue = []
        for g in range(self.groups):
            system = tokens(rng, self.system_len)
            for _ in range(self.per_group):
                prompt = system + tokens(rng, self.question)
                self.group[id(prompt)] = g
                self._queue.append(prompt)
        self._queue.reverse()  # popped from the end: in order

    def _next(self, when: float) -> Arrival | None:
        if not self._queue:
            return None
        prompt = self._queue.pop()
        return Arrival(when, prompt, self.output, key=f"group-{self.group[id(prompt)]}")

    def first_turns(self) -> list[Arrival]:
        first = (self._next(0.0) for _ in range(self.concurrency))
        return [a for a in first if a is not None]

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None:
        return self._next(now)
