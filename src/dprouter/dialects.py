"""How each engine kind wants to be told its rank. All wire differences live here.

vLLM takes the header ``X-data-parallel-rank``; SGLang takes the body fields
``routed_dp_rank`` and, for older engines, ``data_parallel_rank``. A target
with no rank gets nothing. Whatever rank a client wrote is removed first,
unless the router is told to trust clients.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from dprouter.targets import DialectName

VLLM_RANK_HEADER = "X-data-parallel-rank"
RANK_HEADERS = ("x-data-parallel-rank",)  # vLLM's and SGLang's spelling, case-folded
RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")


def strip_client_rank(headers: MutableMapping[str, str], body: dict[str, Any]) -> bool:
    """Drop rank headers and fields a client sent; True when the body changed."""
    for name in [h for h in headers if h.lower() in RANK_HEADERS]:
        del headers[name]
    changed = False
    for name in RANK_FIELDS:
        if name in body:
            del body[name]
            changed = True
    return changed


def write_rank(
    dialect: DialectName, rank: int | None, headers: MutableMapping[str, str], body: dict[str, Any]
) -> bool:
    """Write ``rank`` in ``dialect``; True when the body changed."""
    if rank is None:
        return False
    if dialect == "vllm":
        headers[VLLM_RANK_HEADER] = str(rank)
        return False
    body["routed_dp_rank"] = rank
    body["data_parallel_rank"] = rank  # older SGLang engines read only this name
    return True
