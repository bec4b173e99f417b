"""The one validation step: defaults that follow from each other, contradictions that fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from dprouter.config import RouterConfig, load_file, validate
from dprouter.core.errors import ConfigError
from dprouter.fleet.worker_spec import WorkerSpec, parse_worker


def test_sessions_with_no_policy_mean_manual_with_min_load() -> None:
    config = validate(RouterConfig(sessions=True))
    assert (config.policy, config.assignment) == ("manual", "min_load")
    named = validate(RouterConfig(sessions=True, policy="consistent_hash"))
    assert (named.policy, named.assignment) == ("consistent_hash", None)
    assert validate(RouterConfig()).policy_name == "round_robin"


def test_assignment_alone_implies_manual_but_contradicts_other_policies() -> None:
    assert validate(RouterConfig(assignment="min_group")).policy == "manual"
    with pytest.raises(ConfigError, match="drop --assignment or use --policy manual"):
        validate(RouterConfig(policy="round_robin", assignment="min_load"))


def test_dp_aware_off_warns_loudly_and_refuses_rank_policies() -> None:
    config = validate(RouterConfig(dp_aware="off"))
    assert any("DP-aware routing is OFF" in w for w in config.warnings)
    assert validate(RouterConfig()).warnings == ()
    with pytest.raises(ConfigError, match="min_tokens balances the ranks"):
        validate(RouterConfig(dp_aware="off", policy="min_tokens"))


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ((WorkerSpec("ftp://host:1"),), "must be http"),
        # a bare word is a mistake, not port 80 of a host by that name
        ((WorkerSpec("notaurl"),), r"'notaurl' must be http\(s\)://host:port"),
        ((WorkerSpec("h:port"),), "must be http"),
        ((WorkerSpec("http://h:1"), WorkerSpec("http://h:1/")), "listed twice"),
        ((WorkerSpec("http://h:1", dp_size=0),), "dp_size must be at least 1"),
        ((WorkerSpec("http://user:pw@h:1"),), "must not carry credentials"),
        ((WorkerSpec("http://h:1", role="leader"),), "role must be one of"),  # type: ignore[arg-type]
    ],
)
def test_bad_workers_fail_with_what_to_change(
    workers: tuple[WorkerSpec, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(RouterConfig(workers=workers))


def test_urls_are_normalised_and_ipv6_stays_bracketed() -> None:
    written = ("[::1]:8000/", "h:9", "http://h", "https://h")  # a scheme: its port implied
    config = validate(RouterConfig(workers=tuple(WorkerSpec(w) for w in written)))
    assert [w.url for w in config.workers] == [
        "http://[::1]:8000",
        "http://h:9",
        "http://h",
        "https://h",
    ]


def test_worker_option_syntax() -> None:
    spec = parse_worker("http://[::1]:8000,dialect=vllm,dp_size=8,id=big,rank_offset=8")
    assert spec == WorkerSpec(
        "http://[::1]:8000", id="big", dialect="vllm", dp_size=8, rank_offset=8
    )
    assert parse_worker("http://h:1,dialect=auto").dialect is None
    with pytest.raises(ConfigError, match="dp_size must be an integer"):
        parse_worker("http://h:1,dp_size=eight")
    with pytest.raises(ConfigError, match="unknown worker keys"):
        parse_worker("http://h:1,colour=red")


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        'policy = "least_load"\n'
        "port = 9001\n"
        "[[workers]]\n"
        'url = "http://127.0.0.1:8000"\n'
        'dialect = "vllm"\n'
        "dp_size = 8\n"
        "[[workers]]\n"
        'url = "http://127.0.0.1:9000"\n'
        'dialect = "sglang"\n'
        'role = "regular"\n'
        'model = "m"\n'
    )
    config = validate(RouterConfig(**load_file(path)))
    assert (config.policy, config.port) == ("least_load", 9001)
    assert [(w.dialect, w.dp_size, w.model) for w in config.workers] == [
        ("vllm", 8, None),
        ("sglang", None, "m"),
    ]
    path.write_text("polcy = 'x'\n")
    with pytest.raises(ConfigError, match="unknown options \\['polcy'\\]"):
        load_file(path)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (RouterConfig(dp_aware="Off"), "dp_aware must be auto or off"),  # type: ignore[arg-type]
        (RouterConfig(sessions="no"), "sessions must be bool"),  # type: ignore[arg-type]
        (RouterConfig(port="80"), "port must be int"),  # type: ignore[arg-type]
        (RouterConfig(attempts=True), "attempts must be int"),
        (RouterConfig(workers=(WorkerSpec("http://h:1", dp_size=2.5),)), "dp_size must be int"),  # type: ignore[arg-type]
        (RouterConfig(workers=(WorkerSpec(5),)), "url must be a string"),  # type: ignore[arg-type]
        (RouterConfig(workers=(WorkerSpec("http://h:1", role="prefill"),)), "need a P/D flow"),
        (RouterConfig(pd="sglang", workers=(WorkerSpec("http://h:1"),)), "every worker is"),
        (
            RouterConfig(pd="vllm-moriio", workers=(WorkerSpec("http://h:1", role="decode"),)),
            "register themselves over ZMQ",
        ),
        (RouterConfig(pd="nixl"), "--pd must be one of"),  # type: ignore[arg-type]
        # what the command line checks by its option types, a file must not slip past
        (RouterConfig(connect_timeout=-1.0), "connect_timeout must be > 0"),
        (RouterConfig(read_timeout=-5.0), "read_timeout must be >= 0"),
        (RouterConfig(backlog=0), "backlog must be > 0"),
        (RouterConfig(key_ttl=-1.0), "key_ttl must be >= 0"),
        (RouterConfig(pd="sglang", dp_aware="off"), "drop --dp-aware off"),
    ],
)
def test_wrong_types_and_values_name_the_field(config: RouterConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(config)


def test_pd_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "pd.toml"
    path.write_text(
        'pd = "sglang"\n'
        'decode_policy = "least_load"\n'
        "[[workers]]\n"
        'url = "http://127.0.0.1:8100"\n'
        'role = "prefill"\n'
        "bootstrap_port = 8998\n"
        "[[workers]]\n"
        'url = "http://127.0.0.1:8200"\n'
        'role = "decode"\n'
    )
    config = validate(RouterConfig(**load_file(path)))
    assert (config.pd, config.role_policy("prefill"), config.role_policy("decode")) == (
        "sglang",
        "round_robin",
        "least_load",
    )
    assert [(w.role, w.bootstrap_port) for w in config.workers] == [
        ("prefill", 8998),
        ("decode", None),
    ]


def test_a_metrics_port_is_its_own_and_a_metrics_host_needs_one() -> None:
    assert validate(RouterConfig(port=8080, metrics_port=9090)).metrics_port == 9090
    assert validate(RouterConfig(port=0, metrics_port=0)).metrics_port == 0  # two free ports
    with pytest.raises(ConfigError, match="--metrics-port 8080 is --port"):
        validate(RouterConfig(port=8080, metrics_port=8080))
    with pytest.raises(ConfigError, match="--metrics-host needs --metrics-port"):
        validate(RouterConfig(metrics_host="0.0.0.0"))
