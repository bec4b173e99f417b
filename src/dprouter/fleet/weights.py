"""Weights' versions, as RL frameworks name them: any string (SGLang's default is
``default``), compared as numbers when both are numbers. A request asks for ``latest``
(the newest any ready worker serves) or at least N (``X-DPRouter-Weight-Version``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dprouter.core.errors import ConfigError


def _number(version: str) -> float | None:
    try:
        return float(version)
    except ValueError:
        return None


def at_least(version: str | None, floor: str) -> bool:
    """``version`` is ``floor`` or newer: as numbers when both are, else only when equal."""
    if version is None:
        return False
    have, want = _number(version), _number(floor)
    if have is not None and want is not None:
        return have >= want
    return version == floor


def newest(versions: Iterable[str | None]) -> str | None:
    """The newest of ``versions``: the largest number, a name counting as older than any
    (SGLang starts at ``default``: the first update's number is newer); names alone, the
    last in the order given."""
    known = [v for v in versions if v is not None]
    numbers = [v for v in known if _number(v) is not None]
    if numbers:
        return max(numbers, key=lambda v: _number(v) or 0.0)
    return known[-1] if known else None


@dataclass(frozen=True)
class Wanted:
    """What a request asks of the weights that serve it: ``latest`` or at least ``floor``."""

    floor: str | None = None  # None: latest

    @staticmethod
    def parse(header: str) -> Wanted:
        text = header.strip()
        if text == "latest":
            return Wanted()
        if text.startswith(">="):
            text = text[2:].strip()
        if not text:
            raise ConfigError("X-DPRouter-Weight-Version must be latest, N or >=N")
        return Wanted(text)

    def serves(self, version: str | None, latest: str | None) -> bool:
        floor = self.floor if self.floor is not None else latest
        return floor is None or at_least(version, floor)
