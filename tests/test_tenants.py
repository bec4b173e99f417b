"""The ``--tenants`` file as an operator writes it: what it reads (numbers as YAML 1.1
leaves them too), and a precise error for each mistake, never quoting a key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dprouter.core.errors import ConfigError
from dprouter.core.tenants import Limits, Tenants, digest

CLASSES = ("high", "normal", "low")


def load(tmp_path: Path, text: str, **environ: str) -> Tenants:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return Tenants.load(path, CLASSES, environ)


def test_a_file_reads_as_written_and_numbers_yaml_leaves_as_text_count(tmp_path: Path) -> None:
    tenants = load(
        tmp_path,
        """
default: {class: low, limits: {requests_per_second: 2}}
tenants:
  batch:
    keys: [sk-batch-1, sk-batch-2]
    weight: 3
    limits: {requests_per_second: 1e3, tokens_per_second: 1.5e6, burst: 2, in_flight: 64}
  ops:
    key_env: [OPS_KEY]
    access: admin
    class: high
    set_class: true
""",
        OPS_KEY="sk-ops",
    )
    batch = tenants.listed["batch"]
    # 1e3 and 1.5e6 are strings to PyYAML (YAML 1.1 wants 1.0e+3): read as numbers
    assert batch.limits == Limits(1000.0, 1.5e6, 2.0, 64)
    assert (batch.weight, batch.access) == (3.0, "user")
    assert batch.priority == 2  # no class of its own: the default's (low)
    assert tenants.by_key("sk-batch-2") is batch
    ops = tenants.by_key("sk-ops")
    assert ops is not None and (ops.name, ops.access, ops.priority, ops.set_class) == (
        "ops",
        "admin",
        0,
        True,
    )
    assert tenants.by_key("sk-unknown") is None
    stranger = tenants.named("someone")  # a JWT's tenant not listed: the default's terms
    assert (stranger.priority, stranger.limits.requests_per_second) == (2, 2.0)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"keys": ["k"], "colour": "red"}, "tenant t: unknown field(s) colour"),
        ({"keys": ["k"], "access": "root"}, "access must be user or admin, got 'root'"),
        ({"keys": ["k"], "class": "urgent"}, "class 'urgent' is not one of --classes"),
        ({"keys": ["k"], "weight": 0}, "weight must be a number > 0, got 0"),
        ({"keys": ["k"], "weight": "heavy"}, "weight must be a number > 0, got 'heavy'"),
        ({"keys": ["k"], "limits": {"rps": 1}}, "limits takes burst, in_flight"),
        ({"keys": ["k"], "limits": {"burst": -1}}, "limits.burst must be a number >= 0"),
        ({"keys": ["k"], "limits": {"burst": 0}}, "limits.burst must be > 0 seconds"),
        ({"keys": ["k"], "limits": {"in_flight": 2.5}}, "limits.in_flight must be a whole"),
        ({"keys": ["k"], "limits": {"in_flight": True}}, "limits.in_flight must be a number"),
        ({"keys": ["k"], "limits": {"requests_per_second": "nan"}}, "must be a number >= 0"),
        ({"keys": "sk-one"}, None),  # one key as text: taken whole
        ({"keys": [""]}, "tenant t: keys must be a list of text"),
        ({"key_env": ["MISSING"]}, "the environment variable MISSING holds no key"),
        ({"key_sha256": ["abcd"]}, "key_sha256 abcd... is not a SHA-256 digest"),
    ],
)
def test_each_mistake_is_named(tmp_path: Path, entry: dict[str, Any], said: str | None) -> None:
    text = yaml.safe_dump({"tenants": {"t": entry}})
    if said is None:
        tenants = load(tmp_path, text)
        assert tenants.by_key("sk-one") is not None and tenants.by_key("s") is None
        return
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert said in str(caught.value)


def test_two_tenants_sharing_a_key_or_a_malformed_file_are_refused(tmp_path: Path) -> None:
    hexed = digest("sk-shared").hex()
    shared = {"tenants": {"a": {"keys": ["sk-shared"]}, "b": {"key_sha256": [hexed]}}}
    with pytest.raises(ConfigError, match="b and a share a key") as caught:
        load(tmp_path, yaml.safe_dump(shared))
    assert "sk-shared" not in str(caught.value)
    for text, said in (
        ("tenants: [a, b]", "tenants must map names to tenants"),
        ("users: {}", "expected the keys tenants and default"),
        ("tenants: {a: {keys: [k]}", "cannot read --tenants"),
    ):
        with pytest.raises(ConfigError, match=said):
            load(tmp_path, text)
