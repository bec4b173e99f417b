"""A model's own tokenizer, loaded from its local files: token ids as the engine makes them.

Prefix routing on the engines' KV events needs the prompt's token ids exactly as the
engine computes them. vLLM renders a chat request with the model's chat template
(``tokenizer_config.json``) and encodes the result without adding special tokens (the
template writes them); a completion prompt is encoded with them. Both are done here
with the files the engine loads — ``tokenizer.json`` through the ``tokenizers`` library,
the template through a sandboxed Jinja2 environment set up as Hugging Face's is — read
once at start-up, never from a hub.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from dprouter.core.errors import TokenizerError


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string or an AddedToken map."""
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list joined by new
    lines (what vLLM does for a "string" content format)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


class ModelTokenizer:
    """Encode prompts and chat messages as a model's engine does."""

    def __init__(self, directory: Path) -> None:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{directory}: no tokenizer.json")
        self.directory = directory
        self._tokenizer = Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        template = config.get("chat_template")
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.special = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self._template: jinja2.Template | None = None
        if isinstance(template, str):
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def encode_batch(self, texts: Sequence[str], *, special: bool = True) -> list[list[int]]:
        """Several texts at once. Unlike ``encode`` it releases the GIL (measured: a
        20k-token ``encode`` held it for ~170 ms; with ``encode_batch`` in a thread the event
        loop still ran every few ms), so it is the one to call from a thread."""
        found = self._tokenizer.encode_batch(list(texts), add_special_tokens=special)
        return [list(e.ids) for e in found]

    def added_tokens(self) -> dict[str, int]:
        """Added tokens by content, when none strips the space beside it (else {}): the
        tokenizer splits text on them before anything else, so the text between two of
        them encodes the same alone as in the whole."""
        added = self._tokenizer.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return {}
        return {t.content: i for i, t in added.items() if t.content}

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat prompt text, with the generation prompt added (as the engines do)."""
        if self._template is None:
            raise TokenizerError(f"{self.directory}: no chat template")
        flat = [{**m, "content": content_text(m.get("content"))} for m in messages]
        return self._template.render(messages=flat, add_generation_prompt=True, **self.special)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), special=False)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))
