"""Deterministic tokenisation of the simulated engines.

The rule: a token is a run of word characters or a single other non-space
character (regex ``\\w+|[^\\w\\s]``); its id is the CRC-32 of its UTF-8 bytes.
Chat messages render as ``<role>: <content>`` lines followed by ``assistant:``.
Output token i of a request is a word picked by CRC-32 of (prompt digest, i),
written with a leading space, so re-tokenising an answer gives back exactly
one token per generated token and multi-turn prompts extend earlier ones.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from functools import lru_cache

_TOKEN = re.compile(r"\w+|[^\w\s]")
WORDS: tuple[str, ...] = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "amber",
    "basil",
    "cedar",
    "dune",
    "ember",
    "fern",
)


@lru_cache(maxsize=65536)
def _token_id(token: str) -> int:
    return zlib.crc32(token.encode())


def tokenize(text: str) -> list[int]:
    return [_token_id(t) for t in _TOKEN.findall(text)]


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    lines = [f"{role}: {content}" for role, content in messages]
    lines.append("assistant:")
    return "\n".join(lines)


def prompt_digest(ids: Sequence[int]) -> int:
    # hashing a tuple of ints is stable across processes (no hash randomisation)
    return hash(tuple(ids)) & 0xFFFFFFFF


def output_token(digest: int, index: int) -> str:
    word = WORDS[zlib.crc32(index.to_bytes(4, "little"), digest) % len(WORDS)]
    return " " + word
