"""The models' own tokenizer files: the simulator's vocabulary and the router's loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dprouter.core.errors import TokenizerError
from dprouter.core.tokenizer import ModelTokenizer
from dprouter.sim.model.tokens import WORDS
from dprouter.sim.model.vocab import write_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = write_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes()


def test_simulator_words_are_one_token_each(model_dir: Path) -> None:
    tok = ModelTokenizer(model_dir)
    assert all(len(tok.encode(" " + w)) == 1 for w in WORDS)


def test_chat_renders_with_the_template_and_no_extra_specials(model_dir: Path) -> None:
    tok = ModelTokenizer(model_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a router."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
    ]
    text = tok.render_chat(messages)
    assert (
        text == "<s><|system|>\nYou are a router.</s>\n<|user|>\nhello\nworld</s>\n<|assistant|>\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1  # <s> once: the template writes it, encode adds none
    assert tok.decode(ids) == text


def test_a_longer_conversation_extends_the_shorter_ones_ids(model_dir: Path) -> None:
    tok = ModelTokenizer(model_dir)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two"}]
    later = [*first, {"role": "assistant", "content": "three"}, {"role": "user", "content": "four"}]
    short = tok.encode_chat(first)[:-3]  # up to the end of the user's turn, before the prompt
    assert tok.encode_chat(later)[: len(short)] == short


def test_missing_files_and_templates_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        ModelTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    bare = ModelTokenizer(tmp_path)
    assert not bare.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "hi"}])
    assert bare.encode("hello world") == ModelTokenizer(model_dir).encode("hello world")
