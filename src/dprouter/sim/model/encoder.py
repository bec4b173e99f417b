"""How a simulated engine turns prompts into token ids: its built-in rule, or real files.

By default the CRC rule of ``sim/tokens.py`` (exact, cheap, and what the simulator's
counts have always been). Given a tokenizer directory (``tokenizer.json`` and
``tokenizer_config.json``, e.g. from ``sim/vocab.py``'s ``write_tokenizer``), the engine
encodes as vLLM does -- a completion prompt with special tokens, a chat through the
model's template -- so the token ids in its KV events are those a router computes
from the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dprouter.core.tokenizer import ModelTokenizer
from dprouter.sim.model.tokens import render_chat, tokenize


class Encoder(Protocol):
    real: bool  # tokenizer files, not the built-in rule

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``special``: a prompt gets the model's special tokens (BOS), output text not."""
        ...

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids``, or None when the rule cannot say (the built-in one)."""
        ...


class BuiltinEncoder:
    real = False

    def encode(self, text: str, special: bool = True) -> list[int]:
        return tokenize(text)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return tokenize(render_chat(messages))

    def decode(self, ids: Sequence[int]) -> str | None:
        return None


class FileEncoder:
    real = True

    def __init__(self, directory: Path) -> None:
        self.tokenizer = ModelTokenizer(directory)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat([{"role": r, "content": c} for r, c in messages])

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.tokenizer.decode(ids)


def encoder_for(directory: str | None) -> Encoder:
    """Loaded once, when the engine is built (never on a request)."""
    return BuiltinEncoder() if directory is None else FileEncoder(Path(directory))
