"""How many output tokens a request will run to, guessed at admission.

A client's ``max_tokens`` is a cap, not a length: an RL rollout sends the
longest response it allows (12,000, say) and most decodes stop far short of
it. Counting the cap makes every request weigh the same, and hides the one
thing that differs between ranks: which decodes run long. So a request's
output budget is ``min(max_tokens, typical)``, where ``typical`` is a moving
average of the output lengths of the requests this router saw finish (a
stream's events as they pass; a whole answer's ``usage.completion_tokens``,
or SGLang's ``meta_info.completion_tokens``). Until one has finished, the cap
(or ``DEFAULT_OUTPUT`` without one) stands. A decode that runs past its
budget weighs its prompt alone in the router's count; the engine's report of
the tokens it holds (see ``board``) is what shows it then. The averages live on
the board: under ``--processes`` every serving process updates and reads the
same one, so all count a request alike (a process averaging only the answers it
served weighed the same request differently from the other, by up to the cap
before its own first answer).

Two things tell a request's length better than the model's average:
- a request that runs to its cap (``ignore_eos``, or a floor equal to the cap, as
  RL rollouts and benchmarks send) is counted by its cap, exactly;
- a group's history: the samples of one prompt (GRPO sends a group of them at
  once; a prompt recurs across epochs) run to similar lengths, so the lengths the
  router saw a group's requests finish at predict the rest (``Incoming.group``:
  the prompt, or the client's ``X-DPRouter-Group``). The history is bounded
  (``GROUPS``, least recently used out) and kept per serving process.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from dprouter.core.types import Incoming
from dprouter.fleet.board import MODELS, Board
from dprouter.fleet.targets import Outstanding
from dprouter.proxy.parse import DEFAULT_OUTPUT
from dprouter.proxy.relay import was_cut

WEIGHT = 0.05  # of each new length in the average: about the last 20 requests count
GROUPS = 65_536  # groups whose lengths the router remembers, the most recently seen
GROUP_MEMORY = 8  # a group's average weighs about its last 8 lengths
USAGE = b'"completion_tokens":'


def completion_tokens(body: bytes) -> int | None:
    """``completion_tokens`` of a whole JSON answer, found without parsing it all (the
    last one: SGLang's batches list one per prompt, the usage block comes last)."""
    at = body.rfind(USAGE)
    if at < 0:
        return None
    digits = body[at + len(USAGE) : at + len(USAGE) + 12].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None


class OutputEstimate:
    """Typical output lengths, by model (None: requests that name none). On a ``board``,
    the averages are the board's (under ``--processes``, shared memory: every serving
    process updates and reads the one average of a model, under the board lock), so all
    count a request alike; a model whose cell another holds is averaged here alone.
    ``learned`` False (``--output-budget cap``): a request is counted by its cap as sent,
    for clients whose ``max_tokens`` is the length they expect."""

    def __init__(self, learned: bool = True, board: Board | None = None) -> None:
        self.learned = learned
        self.board = board
        self.typical: dict[str | None, float] = {}  # models without a cell on the board
        self._cells: dict[str | None, int] = {}  # a model's cell for its average, -1: none
        self.groups: OrderedDict[int, tuple[float, int]] = OrderedDict()  # (mean, lengths)
        self.listeners: list[Callable[[int], None]] = []  # told of a group's new length

    def cell(self, model: str | None) -> int:
        """The board cell of ``model``'s average (thousandths of a token; 0: none yet), or
        -1: no board, or its cell is another model's."""
        found = self._cells.get(model)
        if found is not None:
            return found
        found = -1
        board = self.board
        if board is not None:
            key = zlib.crc32(str(model).encode()) + 1  # 0 marks a free cell
            at = board.models_base + 2 * (key % MODELS)
            with board.step():
                if board.cells[at] in (0, key):
                    board.cells[at] = key
                    found = at + 1
        self._cells[model] = found
        return found

    def observe(self, generated: int, model: str | None = None, group: int = 0) -> None:
        """A request for ``model`` (of ``group``, 0: none) finished after ``generated``
        output tokens."""
        if group and self.learned:
            self._observe_group(generated, group)
        at = self.cell(model)
        if at < 0:
            t = self.typical.get(model)
            self.typical[model] = float(generated) if t is None else t + WEIGHT * (generated - t)
            return
        board = self.board
        assert board is not None
        with board.step():
            t = board.cells[at] / 1000
            new = float(generated) if not t else t + WEIGHT * (generated - t)
            board.cells[at] = max(1, round(new * 1000))  # 0 is "none yet"

    def _observe_group(self, generated: int, group: int) -> None:
        groups = self.groups
        mean, n = groups.pop(group, (0.0, 0))
        n = min(n + 1, GROUP_MEMORY)
        new = mean + (generated - mean) / n
        groups[group] = (new, n)
        if len(groups) > GROUPS:
            groups.popitem(last=False)
        if n == 1 or round(new) != round(mean):  # a prediction changed: say so
            for listener in self.listeners:
                listener(group)

    def budget(self, limit: int | None, model: str | None = None) -> int:
        """The output tokens to count for a request whose cap is ``limit`` (None: unset)."""
        cap = DEFAULT_OUTPUT if limit is None else limit
        if not self.learned:
            return cap
        at = self.cell(model)
        if at < 0:
            t = self.typical.get(model)
        else:
            assert self.board is not None
            thousandths = self.board.cells[at]
            t = thousandths / 1000 if thousandths else None
        return cap if t is None else min(cap, round(t))

    def predict(self, incoming: Incoming) -> int:
        """The output tokens ``incoming`` will likely run to: its cap when it runs to it,
        else its group's lengths so far, else the model's typical length (within the cap)."""
        limit = incoming.limit
        if incoming.exact and limit is not None:
            return limit
        seen = self.groups.get(incoming.group) if self.learned and incoming.group else None
        if seen is None:
            return self.budget(limit, incoming.model)
        return round(seen[0]) if limit is None else min(limit, round(seen[0]))

    def apply(self, incoming: Incoming) -> None:
        """Count ``incoming`` by its budget: prompt + its predicted output, for each of its
        ``n`` samples."""
        incoming.output = self.predict(incoming) * incoming.samples
        incoming.tokens = incoming.prompt_tokens + incoming.output


def learn(
    estimate: OutputEstimate, answer: web.StreamResponse, counted: Outstanding, incoming: Incoming
) -> None:
    """What a good answer tells of output lengths: a whole answer its usage, a stream
    the events that went by."""
    if answer.status != 200 or was_cut(answer):
        return
    if isinstance(answer, web.Response):
        body = answer.body
        found = completion_tokens(body) if isinstance(body, bytes) else None
        if isinstance(body, bytes) and found is not None:
            # OpenAI's usage sums the n samples (each ran about as long); SGLang answers n
            # samples with a list, one object each, the last one's count its own
            each = found if body[:64].lstrip()[:1] == b"[" else found // incoming.samples
            estimate.observe(each, incoming.model, incoming.group)
    elif counted.seen:
        estimate.observe(counted.seen // incoming.samples, incoming.model, incoming.group)
