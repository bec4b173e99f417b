"""Property-based tests: the request parser and the policies, on inputs nobody wrote by hand."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from dprouter.core.errors import BadRequest
from dprouter.core.types import Kind
from dprouter.engines import dialects
from dprouter.policies import POLICIES, RequestInfo, make_policy
from dprouter.proxy.parse import AFFINITY_CHARS, parse
from tests.test_policies import fleet

KINDS: tuple[Kind, ...] = ("completion", "chat", "generate")
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = (
    "model",
    "stream",
    "prompt",
    "messages",
    "text",
    "input_ids",
    "max_tokens",
    "max_completion_tokens",
    "sampling_params",
    "user",
    "session_id",
    "routed_dp_rank",
    "data_parallel_rank",
)
# bodies with the fields the router reads, holding anything at all
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
headers = st.dictionaries(
    st.sampled_from(["X-SMG-Routing-Key", "X-Session-ID", "X-data-parallel-rank", "Other"]),
    st.text(max_size=600),
    max_size=3,
)


def parsed_or_refused(raw: bytes, kind: Kind, head: dict[str, str]) -> None:
    refused: BadRequest | None = None
    try:
        incoming = parse(raw, kind, head)
    except BadRequest as exc:  # a clear 4xx naming what is wrong: the only way to refuse
        refused = exc
    if refused is not None:
        assert 400 <= refused.status < 500 and refused.message
        return
    assert isinstance(incoming.body, dict)
    assert incoming.tokens >= 1 and len(incoming.text) <= AFFINITY_CHARS
    assert incoming.key is None or 1 <= len(incoming.key) <= 512


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(KINDS))
def test_any_bytes_parse_or_get_a_clear_400(raw: bytes, kind: Kind) -> None:
    parsed_or_refused(raw, kind, {})


@settings(max_examples=500, deadline=None)
@given(bodies, st.sampled_from(KINDS), headers)
def test_any_json_body_parses_or_gets_a_clear_400(
    body: dict[str, Any], kind: Kind, head: dict[str, str]
) -> None:
    parsed_or_refused(orjson.dumps(body), kind, head)


@settings(max_examples=300, deadline=None)
@given(bodies, headers)
def test_client_rank_fields_never_survive_stripping(
    body: dict[str, Any], head: dict[str, str]
) -> None:
    head, body = dict(head), dict(body)
    dialects.strip_client_rank(head, body)
    assert not {"routed_dp_rank", "data_parallel_rank"} & set(body)
    assert "x-data-parallel-rank" not in {h.lower() for h in head}


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(POLICIES)),
    st.lists(st.integers(1, 8), min_size=1, max_size=4),
    st.lists(st.integers(0, 50), min_size=1, max_size=32),
    st.none() | st.text(min_size=1, max_size=20),
    st.text(max_size=100),
    st.integers(0, 2),
)
def test_every_policy_picks_a_member_of_the_pool(
    name: str, shape: list[int], loads: list[int], key: str | None, text: str, attempt: int
) -> None:
    _, targets = fleet(*shape)
    for target, load in zip(targets, loads * len(targets), strict=False):
        target.outstanding = load
        target.outstanding_tokens = load * 100
    policy = make_policy(name)
    for i in range(len(targets) + 1):
        pool = targets[i % len(targets) :] or targets  # retries see fewer targets
        info = RequestInfo(key=key, text=text, tokens=len(text) + 1, attempt=attempt)
        assert policy.select(pool, info) in pool


@settings(max_examples=300, deadline=None)
@given(headers, bodies)
def test_a_trusted_client_rank_is_an_integer_or_a_clear_400(
    head: dict[str, str], body: dict[str, Any]
) -> None:
    refused: BadRequest | None = None
    try:
        rank = dialects.client_rank(head, body)
    except BadRequest as exc:
        refused = exc
    if refused is not None:
        assert refused.status == 400 and refused.param
        return
    assert rank is None or isinstance(rank, int)
