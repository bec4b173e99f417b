"""The SGLang router's launch line run as dprouter (``python -m dprouter.launch_router``,
``dprouter launch``): the lines miles and slime build start a router of the same meaning
(workers, policy, DP ranks, P/D pools with their bootstrap ports, metrics on the
Prometheus port), and an argument dprouter cannot honour is a usage error naming it."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dprouter.cli.launch import config_of
from dprouter.cli.launch_args import REFUSED, parser
from dprouter.config import RouterConfig
from dprouter.core.errors import ConfigError
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster, reserve_port

SGLANG_DP2 = EngineConfig(persona="sglang", dp_size=2, dp_attention=True)
DOCS = Path(__file__).parent.parent / "docs" / "rl.md"


def line(*args: str) -> RouterConfig:
    return config_of(parser("launch").parse_args(list(args)))


def test_miles_and_slime_lines_mean_the_same_router() -> None:
    # miles (router_manager.start_router): node address, a free port and metrics port,
    # warn, its request timeout, the session server's policy, DP ranks under DP attention
    miles = line(
        *("--host", "10.0.0.3", "--port", "3517", "--prometheus-port", "4123"),
        *("--log-level", "warn", "--request-timeout-secs", "14400"),
        *("--policy", "manual", "--assignment-mode", "min_load", "--dp-aware"),
    )
    assert (miles.host, miles.port, miles.metrics_port) == ("10.0.0.3", 3517, 4123)
    assert (miles.policy, miles.assignment, miles.dp_aware) == ("manual", "min_load", "auto")
    assert miles.total_timeout == miles.read_timeout == 14400
    assert miles.workers == () and miles.pd is None
    # slime (rollout._start_router) turns the breaker and the health checks off, P/D on
    slime = line(
        *("--host", "10.0.0.3", "--port", "3517", "--prometheus-port", "4123"),
        *("--disable-circuit-breaker", "--disable-health-check", "--pd-disaggregation"),
    )
    assert (slime.breaker_failures, slime.health_interval, slime.pd) == (0, 0.0, "sglang")
    assert slime.policy == "cache_aware"  # the gateway's default policy, as it would run
    # the launcher's own example: prefills with and without a bootstrap port
    pd = line(
        *("--pd-disaggregation", "--prefill", "http://p1:8000", "9000"),
        *("--prefill", "http://p2:8000", "none", "--decode", "http://d1:8001"),
        *("--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"),
    )
    assert pd.workers == (
        WorkerSpec("http://p1:8000", role="prefill", bootstrap_port=9000),
        WorkerSpec("http://p2:8000", role="prefill"),
        WorkerSpec("http://d1:8001", role="decode"),
    )
    assert (pd.prefill_policy, pd.decode_policy) == ("cache_aware", "power_of_two")
    defaults = line()
    assert (defaults.host, defaults.port, defaults.metrics_port) == ("0.0.0.0", 30000, None)


def test_limits_retries_and_discovery_map_to_their_own() -> None:
    config = line(
        *("--max-concurrent-requests", "-1", "--queue-size", "0", "--queue-timeout-secs", "5"),
        *("--retry-max-retries", "4", "--retry-initial-backoff-ms", "50"),
        *("--cb-failure-threshold", "7", "--cb-timeout-duration-secs", "30"),
        *("--health-check-interval-secs", "60", "--health-check-timeout-secs", "3"),
        *("--health-failure-threshold", "4", "--health-success-threshold", "1"),
        *("--max-payload-size", "1024", "--max-idle-secs", "60", "--cache-threshold", "0.3"),
        *("--policy", "consistent_hashing", "--request-id-headers", "X-Request-Id"),
        *("--service-discovery", "--selector", "app=sglang", "tier=rollout"),
    )
    assert (config.max_concurrent, config.queue_size, config.queue_timeout) == (0, 0, 5)
    assert (config.attempts, config.retry_backoff) == (4, 0.05)
    assert (config.breaker_failures, config.breaker_cooldown) == (7, 30)
    assert (config.health_interval, config.health_timeout) == (60, 3)
    assert (config.health_failures, config.health_successes) == (4, 1)
    assert (config.max_body, config.key_ttl, config.cache_threshold) == (1024, 60, 0.3)
    assert config.policy == "consistent_hash"
    assert (config.discovery, config.selector, config.pod_port) == (
        "k8s",
        "app=sglang,tier=rollout",
        80,  # the gateway's --service-discovery-port default
    )
    assert line("--disable-retries", "--retry-max-retries", "5").attempts == 1
    metrics = line("--prometheus-host", "127.0.0.1")  # the gateway's port, 29000, there
    assert (metrics.metrics_host, metrics.metrics_port) == ("127.0.0.1", 29000)
    with pytest.raises(ConfigError, match=r"--pod-port only with --discovery k8s"):
        line("--service-discovery-port", "8000")  # not dropped: refused without discovery
    with pytest.raises(ConfigError, match=r"--prefill and --decode need --pd-disaggregation"):
        line("--decode", "http://d:1")
    with pytest.raises(ConfigError, match=r"does not support --policy prefix_hash"):
        line("--policy", "prefix_hash")
    with pytest.raises(ConfigError, match=r"--health-check-endpoint /ready \(dprouter: /health\)"):
        line("--health-check-endpoint", "/ready")


def test_every_taken_argument_is_in_the_docs_table() -> None:
    text = DOCS.read_text()
    table = text[text.index("| SGLang router argument |") :]
    table = table[: table.index("\n\n")]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", table))
    taken = {flag for action in parser("x")._actions for flag in action.option_strings}
    assert taken - {"-h", "--help"} <= documented
    assert not documented & set(REFUSED), "a refused flag documented as taken"


@asynccontextmanager
async def launched(
    *args: str, via: Sequence[str] = ("-m", "dprouter.launch_router")
) -> AsyncIterator[tuple[str, str]]:
    """The launch line run as a framework runs it, on ports held for it: (its URL, its
    metrics URL) once it answers; stopped with SIGTERM, which it must take cleanly."""
    holders = [reserve_port(), reserve_port()]
    port, metrics = (h.getsockname()[1] for h in holders)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *via,
        *("--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics)),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for _ in range(300):  # up to 30 s for an interpreter to start beside others
                assert proc.returncode is None, "the launch line exited"
                try:
                    async with http.get(url + "/health") as r:
                        if r.status in (200, 503):  # listening (503: no ready worker yet)
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the launch line never listened")
        for holder in holders:
            holder.close()
        yield url, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        for holder in holders:
            holder.close()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()


async def workers_when(http: aiohttp.ClientSession, url: str, count: int) -> list[dict[str, Any]]:
    """``GET /workers`` once ``count`` workers are healthy (10 s at most)."""
    listed: list[dict[str, Any]] = []
    for _ in range(100):
        async with http.get(url + "/workers") as r:
            listed = (await r.json())["workers"]
        if sum(1 for w in listed if w["is_healthy"]) == count:
            return listed
        await asyncio.sleep(0.1)
    raise AssertionError(f"workers never healthy: {listed}")


async def test_mileses_line_routes_sessions_to_ranks_and_serves_metrics_on_its_port(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    one, two = (await start_cluster([SGLANG_DP2, SGLANG_DP2])).servers
    async with launched(
        *("--log-level", "warn", "--request-timeout-secs", "14400", "--dp-aware"),
        *("--policy", "manual", "--assignment-mode", "min_load", "--worker-urls", one.url),
    ) as (url, metrics):
        # miles registers each engine itself, from this host, with no token
        body = {"url": two.url, "worker_type": "regular", "bootstrap_port": None}
        async with http.post(url + "/workers?wait=5", json=body) as r:
            assert r.status == 201, await r.text()
        listed = await workers_when(http, url, 2)
        assert sorted(w["url"] for w in listed) == sorted([one.url, two.url])
        assert all(w["dp_size"] == 2 for w in listed)
        placed: dict[str, tuple[str, str]] = {}
        for turn in range(3):  # min_load: four sessions on four ranks, each one sticking
            for session in ("a", "b", "c", "d"):
                request = {"text": session, "sampling_params": {"max_new_tokens": 2}}
                headers = {"X-SMG-Routing-Key": session}
                async with http.post(url + "/generate", json=request, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    target = (r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"])
                assert placed.setdefault(session, target) == target, turn
        assert len(set(placed.values())) == 4
        ranks = {rec.rank for server in (one, two) for rec in server.received}
        assert ranks == {0, 1}  # the router named each rank (DP-aware)
        async with http.get(metrics) as r:
            assert r.status == 200
            assert "dprouter_requests_total" in await r.text()


async def test_the_pd_line_runs_sglang_pd_with_the_given_bootstrap_port(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    configs = [
        EngineConfig(persona="sglang", dp_size=2, pd=PdConfig(mode="sglang", role=role))
        for role in ("prefill", "decode")
    ]
    prefill, decode = (await start_cluster(configs)).servers
    assert prefill.pd is not None
    bootstrap = prefill.pd.bootstrap_port
    async with launched(
        *("--pd-disaggregation", "--prefill", prefill.url, str(bootstrap)),
        *("--decode", decode.url, "--policy", "round_robin", "--dp-aware"),
        via=("-m", "dprouter", "launch"),
    ) as (url, metrics):
        listed = {w["worker_type"]: w for w in await workers_when(http, url, 2)}
        assert listed["prefill"]["url"] == prefill.url
        assert listed["prefill"]["bootstrap_port"] == bootstrap
        assert listed["decode"]["url"] == decode.url
        for _ in range(2):
            request = {"text": "pd", "sampling_params": {"max_new_tokens": 2}}
            async with http.post(url + "/generate", json=request) as r:
                assert r.status == 200, await r.text()
        sent = [rec.body for rec in decode.received]
        assert len(sent) == 2 and {b["bootstrap_port"] for b in sent} == {bootstrap}
        assert {rec.rank for rec in prefill.received} == {0, 1}  # round robin over ranks
        async with http.get(metrics) as r:
            assert r.status == 200


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--mini-lb"], "--mini-lb (SGLang's debugging balancer; dprouter is the router)"),
        (["--history-backend", "memory", "--log-json"], "--history-backend (the gateway's"),
        (["--policy", "prefix_hash"], "--policy prefix_hash"),
        (["--cors-allowed-origins", "http://a", "http://b"], "--cors-allowed-origins"),
        (["--made-up-flag", "1"], "--made-up-flag"),
    ],
)
async def test_an_argument_dprouter_cannot_honour_is_a_usage_error_naming_it(
    args: list[str], named: str
) -> None:
    for via in (("-m", "dprouter.launch_router"), ("-m", "dprouter", "launch")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *via,
            *("--worker-urls", "http://127.0.0.1:9", *args),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2, err.decode()
        said = err.decode()
        assert "error: dprouter does not support" in said and named in said, said
