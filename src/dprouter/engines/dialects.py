"""How each engine kind wants to be told its rank: the one place a rank is written.

vLLM takes the header ``X-data-parallel-rank``; SGLang takes the body fields
``routed_dp_rank`` and, for older engines, ``data_parallel_rank``, and in P/D the
decode learns the prefill's rank from ``disagg_prefill_dp_rank``. A target with no
rank gets nothing. Whatever rank a client wrote is removed first, unless the router
is told to trust clients. (MoRIIO's ``kv_transfer_params`` carry the prefill rank as
the connector's own data: ``pd_wire``.)
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from multidict import CIMultiDict

from dprouter.core.errors import BadRequest
from dprouter.core.types import DialectName

VLLM_RANK_HEADER = "X-data-parallel-rank"
RANK_HEADERS = ("x-data-parallel-rank",)  # vLLM's and SGLang's spelling, case-folded
RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")
# SGLang started with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES lets these headers override
# the body: from a client they would pin a rank behind the router's back, rename the
# request the router aborts by rid, or send a decode to fetch KV from another server.
# They are never forwarded (a trusted client pins its rank the documented way).
OVERRIDE_HEADERS = frozenset(
    {
        "x-override-routed-dp-rank",
        "x-override-disagg-prefill-dp-rank",
        "x-override-rid",
        "x-override-bootstrap-host",
        "x-override-bootstrap-port",
        "x-override-bootstrap-room",
    }
)


def client_rank(headers: Mapping[str, str], body: Mapping[str, Any]) -> int | None:
    """The rank a (trusted) client pinned, from the header or the body fields."""
    for name, value in headers.items():
        if name.lower() in RANK_HEADERS:
            try:
                return int(value)
            except ValueError:
                raise BadRequest(f"{name} must be an integer, got {value!r}", name) from None
    for field in RANK_FIELDS[:2]:
        rank = _rank_field(body, field)
        if rank is not None:
            return rank
    return None


def client_prefill_rank(body: Mapping[str, Any]) -> int | None:
    """P/D: the prefill rank a (trusted) client named, in SGLang's field for it."""
    return _rank_field(body, "disagg_prefill_dp_rank")


def _rank_field(body: Mapping[str, Any], field: str) -> int | None:
    rank = body.get(field)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise BadRequest(f"{field} must be an integer, got {rank!r}", field)
    return rank


def strip_client_rank(headers: MutableMapping[str, str], body: dict[str, Any]) -> bool:
    """Drop rank headers and fields a client sent; True when the body changed."""
    if isinstance(headers, CIMultiDict):
        # its ``in`` and ``del`` ignore case and take every repeat: no scan of all the
        # client's headers with a ``lower()`` each (0.88 -> 0.12 us for five, timeit)
        for name in RANK_HEADERS:
            if name in headers:
                del headers[name]
    else:
        for name in [h for h in headers if h.lower() in RANK_HEADERS]:
            if name in headers:  # a repeated name: the first del drops every value
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


def write_prefill_rank(rank: int | None, body: dict[str, Any]) -> None:
    """SGLang P/D: tell the decode which prefill rank holds the KV it is to fetch, and the
    prefill which rank it runs on."""
    if rank is not None:
        body["disagg_prefill_dp_rank"] = rank


def write_rank_header(rank: int | None, headers: MutableMapping[str, str]) -> None:
    """Write ``rank`` as a header for either engine: a form body (audio) cannot take a
    field without being re-encoded, and SGLang's OpenAI endpoints read vLLM's header too
    (``X-Data-Parallel-Rank``, over any body field)."""
    if rank is not None:
        headers[VLLM_RANK_HEADER] = str(rank)
