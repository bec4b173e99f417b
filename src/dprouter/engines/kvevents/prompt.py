"""A request's prompt as its engine tokenises it, then what each target holds of it.

Only for a policy that ``needs_tokens``, and only when some target of the pool
publishes events (else nothing is tokenised). Costs, measured on this project's
loaded two-core machine: ~5-8 us a token to encode, so a 20k-token prompt is 100+ ms
of CPU. Two things keep that off the event loop and mostly off the CPU:

- text is split on the tokenizer's added tokens (``<|im_start|>`` ...), which it never
  merges across, and each piece of 256+ characters is cached by its text: a shared
  system prompt is encoded once, however many requests carry it (checked at load
  against encoding the whole: a tokenizer where the pieces disagree is not split);
- pieces not cached, if long, are encoded in a thread with ``encode_batch``, which
  releases the GIL; a piece already being encoded for another request is awaited, not
  encoded twice.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dprouter.core.tokenizer import ModelTokenizer
from dprouter.core.types import Incoming, Kind

Ids = npt.NDArray[np.int64]
KEPT = 256  # pieces at least this long (characters) are cached
INLINE = 2048  # characters encoded on the event loop at most; longer: in a thread
SAMPLE = [
    {"role": "system", "content": "You are a careful router. Answer briefly, please."},
    {"role": "user", "content": "Hello there: what is 12 + 30? Thank you!\n"},
]


class Tokens:
    """One model's tokenizer, with its cache of encoded pieces."""

    def __init__(self, tokenizer: ModelTokenizer, pool: ThreadPoolExecutor, capacity: int) -> None:
        self.tokenizer, self.pool, self.capacity = tokenizer, pool, capacity
        self.cache: OrderedDict[str, Ids] = OrderedDict()
        self.cached = 0  # tokens in the cache
        self.pending: dict[str, asyncio.Future[dict[str, Ids]]] = {}
        self.added = tokenizer.added_tokens()
        self.split = re.compile("|".join(map(re.escape, sorted(self.added, key=len)[::-1])))
        with_ = tokenizer.encode("a")
        bare = tokenizer.encode("a", special=False)
        at = next((i for i in range(len(with_)) if with_[i : i + len(bare)] == bare), 0)
        self.head, self.tail = with_[:at], with_[at + len(bare) :]
        sample = tokenizer.render_chat(SAMPLE) if tokenizer.has_chat_template else "Hi <s> a"
        if not self.added or self._pieces(sample) != tokenizer.encode(sample, special=False):
            self.added = {}  # the whole text is one piece

    def _pieces(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.pieces(text):
            out += (
                [self.added[piece]]
                if piece in self.added
                else self.tokenizer.encode(piece, special=False)
            )
        return out

    def pieces(self, text: str) -> list[str]:
        if not self.added:
            return [text]
        found, last = [], 0
        for m in self.split.finditer(text):
            found += [text[last : m.start()], m.group()]
            last = m.end()
        found.append(text[last:])
        return [p for p in found if p]

    async def encode(self, text: str, special: bool) -> Ids:
        pieces = self.pieces(text)
        missing = [p for p in dict.fromkeys(pieces) if p not in self.added and p not in self.cache]
        new = [p for p in missing if p not in self.pending]
        got: dict[str, Ids] = {}
        if new and sum(map(len, new)) <= INLINE:
            got = self._fetched(new, self._encode(new))
        elif new:  # its own task: a request that leaves does not cancel it for the others
            fetch = asyncio.ensure_future(self._fetch(new))
            self.pending.update(dict.fromkeys(new, fetch))
        for task in {id(t): t for p in missing if (t := self.pending.get(p))}.values():
            got.update(await asyncio.shield(task))
        parts: list[Sequence[int] | Ids] = [self.head] if special else []
        for p in pieces:
            if p in self.added:
                parts.append([self.added[p]])
            elif p in got:
                parts.append(got[p])
            elif p in self.cache:
                self.cache.move_to_end(p)
                parts.append(self.cache[p])
            else:  # short, so not kept: encoded just now
                parts.append(self._encode([p])[0])
        if special:
            parts.append(self.tail)
        return np.concatenate([np.asarray(p, np.int64) for p in parts])

    async def _fetch(self, pieces: list[str]) -> dict[str, Ids]:
        try:
            loop = asyncio.get_running_loop()
            return self._fetched(
                pieces, await loop.run_in_executor(self.pool, self._encode, pieces)
            )
        finally:
            for p in pieces:
                self.pending.pop(p, None)

    def _fetched(self, pieces: list[str], ids: list[Ids]) -> dict[str, Ids]:
        for p, found in zip(pieces, ids, strict=True):
            self._keep(p, found)
        return dict(zip(pieces, ids, strict=True))

    def _encode(self, pieces: Sequence[str]) -> list[Ids]:
        return [np.asarray(i, np.int64) for i in self.tokenizer.encode_batch(pieces, special=False)]

    def _keep(self, piece: str, ids: Ids) -> None:
        if len(piece) < KEPT:
            return
        self.cache[piece] = ids
        self.cached += len(ids)
        while self.cached > self.capacity and self.cache:
            _, old = self.cache.popitem(last=False)
            self.cached -= len(old)

    async def ids(self, kind: Kind, body: Mapping[str, Any]) -> Ids | None:
        """The prompt's token ids as the engine makes them; None if not a prompt."""
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not self.tokenizer.has_chat_template:
                return None
            try:
                text = self.tokenizer.render_chat(messages)
            except Exception:  # a template's own error: the engine will say
                return None
            return await self.encode(text, special=False)
        prompt = body.get("prompt" if kind == "completion" else "text")
        if kind == "generate" and prompt is None:
            prompt = body.get("input_ids")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: its first prompt stands for it
        if isinstance(prompt, str) and prompt:
            return await self.encode(prompt, special=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return np.asarray(prompt, np.int64)
        return None


TOKENS_KEPT = 8_000_000  # tokens of cached pieces per model, at most (4 MB a million)


def load(
    dirs: Mapping[str | None, Path], pool: ThreadPoolExecutor, capacity: int
) -> dict[str | None, Tokens]:
    return {model: Tokens(ModelTokenizer(d), pool, capacity) for model, d in dirs.items()}


@dataclass(frozen=True)
class Asked:
    """What a request asks of engines of one dialect: the adapter that runs it (None:
    the base model), and the base model, whose tokenizer encodes its prompt."""

    adapter: str | None
    base: str | None


def asked(dialect: str | None, incoming: Incoming, parents: Mapping[str, str | None]) -> Asked:
    """The adapter as the engine picks it. ``parents``: the pool's ``/v1/models`` cards,
    id -> ``parent`` (an adapter's base model; None for a base model).

    - vLLM: ``model`` names a loaded adapter, a card with a parent (0.32.0,
      ``entrypoints/serve/engine/serving.py`` ``_maybe_get_adapters``);
    - SGLang: ``model`` written ``base:adapter``, else the body's ``lora_path`` (a
      batch's first); a bare adapter name in ``model`` runs the base model (0.5.23,
      ``entrypoints/openai/serving_base.py`` ``_parse_model_parameter``)."""
    model = incoming.model
    if dialect != "sglang":
        parent = parents.get(model) if model is not None else None
        if parent is None or parent == model:
            return Asked(None, model)
        return Asked(model, parent)
    if model and ":" in model and parents.get(model, "") is not None:  # not a base's name
        bases = (m for m, p in parents.items() if p is None and model.startswith(m + ":"))
        at = len(next(bases, "")) or model.index(":")  # the served name, else the first colon
        if name := model[at + 1 :].strip():
            return Asked(name, model[:at].strip())
    path = incoming.body.get("lora_path")
    if isinstance(path, list):
        path = path[0] if path else None
    return Asked(path if isinstance(path, str) and path else None, model)


def for_request(
    found: Mapping[str | None, Tokens], incoming: Incoming, base: str | None = None
) -> Tokens | None:
    """The model's own tokenizer, else its base model's (an adapter's), else the default."""
    return found.get(incoming.model) or found.get(base) or found.get(None)
