"""SGLang's admin endpoints, as it marks them: a handler marked ``admin`` is one that
SGLang 0.5.23 declares "admin optional" (its engine commands, ``/abort_request``). An
engine started with ``--admin-api-key`` takes that key alone there, and its other
endpoints take only the API key (``SimServer``'s guard)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

H = TypeVar("H", bound=Callable[..., Any])


def admin(handler: H) -> H:
    """Mark ``handler`` as an SGLang admin endpoint."""
    handler.admin = True  # type: ignore[attr-defined]
    return handler


def is_admin(handler: object) -> bool:
    return bool(getattr(handler, "admin", False))
