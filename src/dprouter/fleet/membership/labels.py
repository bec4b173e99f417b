"""Equality-based label selectors, ``k=v,k==v,k!=v``: what ``--selector`` takes.

The API server applies ``--selector`` itself; the router applies the P/D
selectors to the pods it gets, with the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping

Selector = tuple[tuple[str, str, bool], ...]  # (key, value, equal)


def parse_selector(text: str) -> Selector:
    """``ValueError`` names the term that is not ``key=value`` (or ``==``, ``!=``)."""
    terms = []
    for term in (t.strip() for t in text.split(",")):
        if not term:
            continue
        op = "!=" if "!=" in term else "==" if "==" in term else "="
        key, sep, value = term.partition(op)
        if not sep or not key.strip() or any(c in value for c in "=!"):
            raise ValueError(f"label selector {text!r}: expected key=value, got {term!r}")
        terms.append((key.strip(), value.strip(), op != "!="))
    if not terms:
        raise ValueError(f"label selector {text!r} is empty")
    return tuple(terms)


def matches(selector: Selector, labels: Mapping[str, str]) -> bool:
    return all((labels.get(k) == v) == equal for k, v, equal in selector)
