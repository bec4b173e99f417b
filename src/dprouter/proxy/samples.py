"""A request sampling n sequences from one prompt (OpenAI's ``n``, SGLang's
``sampling_params.n``: a GRPO group sent as one request), routed as its n samples would
be if sent one by one, then answered as one.

Why: an engine runs a request's n sequences on the one rank it lands on, so a group sent
as one request piles onto that rank while its siblings idle, and under DP attention the
whole engine steps at that rank's pace. The policy picks a target for each sample in
turn, each counted where it goes and its prompt pending there, so the prefix policy
weighs the prompt saved against the queue built exactly as for separate samples; then
one request goes to each target reached, with n its share, and the answers are merged:
``choices`` renumbered in order, ``usage`` with the prompt once and every sample's output;
SGLang's ``/generate`` list joined.

Split only under ``--samples split``; the default keeps a request's samples together,
as the engine runs them. What a split buys (``bench samples``, GRPO groups of n = 8 on
DP-attention engines, four runs): under ``prefix`` a group reaches about 2 ranks and
the busiest rank's decode steps fall from 1.51 to 1.12-1.19 times the mean, for fewer
prompt hits (75-77 % against 89 %), 35-55 ms more mean TTFT, and a p90 group latency
within run-to-run noise of together's; under a cache-blind policy each rank the samples
reach computes the prompt again (``least_load``: 0-19 % prompt hits, p90 +7-14 %).
Not split, even then, where splitting would change the answer: a streamed request (its
chunks would need renumbering on the fly), one with a ``seed`` (each part would draw
the same samples), a batch of prompts, a session's (a routing key: it sticks), a pinned
rank, or a pool of one target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson

from dprouter.core.types import Incoming, Kind
from dprouter.fleet.targets import Target

SPLITTABLE: tuple[Kind, ...] = ("completion", "chat", "generate")


def splittable(incoming: Incoming, kind: Kind, pool: Sequence[Target], pinned: int | None) -> bool:
    """Whether ``incoming``'s samples may go to several targets and come back as one."""
    if incoming.samples < 2 or incoming.stream or kind not in SPLITTABLE or len(pool) < 2:
        return False
    if incoming.key is not None or pinned is not None:
        return False
    body = incoming.body
    if kind == "generate":
        params = body.get("sampling_params") or {}
        one = isinstance(body.get("text"), str) or _ids(body.get("input_ids"))
        return one and params.get("sampling_seed") is None
    if body.get("seed") is not None:
        return False
    return kind == "chat" or isinstance(body.get("prompt"), str) or _ids(body.get("prompt"))


def _ids(value: object) -> bool:
    """One prompt as token ids (a list of ints), not a batch."""
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


def one_sample(incoming: Incoming) -> Incoming:
    """What one of ``incoming``'s samples weighs: the prompt and one sample's output."""
    output = incoming.output // incoming.samples
    return replace(incoming, samples=1, output=output, tokens=incoming.prompt_tokens + output)


def shares(chosen: Sequence[Target]) -> list[tuple[Target, int]]:
    """The samples each target was chosen for, in the order the targets were first chosen."""
    counts: dict[Target, int] = {}
    for target in chosen:
        counts[target] = counts.get(target, 0) + 1
    return list(counts.items())


def part(incoming: Incoming, kind: Kind, n: int, k: int) -> Incoming:
    """``incoming``'s part ``k``, asking for ``n`` of its samples, weighed as that many."""
    body = dict(incoming.body)
    if kind == "generate":
        body["sampling_params"] = {**(body.get("sampling_params") or {}), "n": n}
        rid = body.get("rid")
        if isinstance(rid, str):  # each part its own id: two on one engine must differ
            body["rid"] = f"{rid}-{k}"
    else:
        body["n"] = n
    each = one_sample(incoming).output
    return replace(
        incoming, body=body, samples=n, output=each * n, tokens=incoming.prompt_tokens + each * n
    )


def merge(kind: Kind, answers: Sequence[bytes]) -> bytes:
    """One answer from the parts' answers, in order."""
    found = [orjson.loads(a) for a in answers]
    if kind == "generate":  # SGLang: a list for n > 1, an object for one
        joined: list[Any] = []
        for answer in found:
            joined.extend(answer if isinstance(answer, list) else [answer])
        return orjson.dumps(joined)
    first = found[0]
    choices: list[dict[str, Any]] = []
    completion = 0
    cached = 0
    for answer in found:
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": len(choices)})
        use = answer.get("usage") or {}
        completion += int(use.get("completion_tokens") or 0)
        details = use.get("prompt_tokens_details") or {}
        cached = max(cached, int(details.get("cached_tokens") or 0))
    merged = {**first, "choices": choices}
    use = first.get("usage")
    if isinstance(use, dict):
        prompt = int(use.get("prompt_tokens") or 0)
        merged["usage"] = {
            **use,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if isinstance(use.get("prompt_tokens_details"), dict):
            merged["usage"]["prompt_tokens_details"] = {
                **use["prompt_tokens_details"],
                "cached_tokens": cached,
            }
    return orjson.dumps(merged)
