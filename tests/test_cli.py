"""The ``dprouter`` command as a user runs it: a real process, stopped by its PID."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import click
import pytest

from dprouter.cli.demo import run_demo
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster


async def test_sim_command_serves_engines_and_stops_on_sigterm(
    http: aiohttp.ClientSession,
) -> None:
    """Two SGLang engines with their keys (one from the environment): the API key opens
    the API, and SGLang's admin endpoints take the admin key alone."""
    cmd = [
        sys.executable,
        "-m",
        "dprouter",
        "sim",
        "--persona",
        "sglang",
        "--engines",
        "2",
        "--dp-size",
        "2",
        "--dp-attention",
        "--port",
        "0",
        "--api-key",
        "user-key",
    ]
    env = {**os.environ, "DPROUTER_SIM_ADMIN_API_KEY": "admin-key"}
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    )
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(2)]
        assert [line.split()[:3] for line in lines] == [
            ["sglang-0", "sglang", "dp_size=2"],
            ["sglang-1", "sglang", "dp_size=2"],
        ]
        urls = [line.split()[-1] for line in lines]
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and urls[0] != urls[1]
        user, admin = ({"Authorization": f"Bearer {k}"} for k in ("user-key", "admin-key"))
        async with http.get(urls[1] + "/server_info") as r:
            assert r.status == 401
        async with http.get(urls[1] + "/server_info", headers=user) as r:
            info = await r.json()
        answered = []
        for headers in (user, admin):
            abort = {"rid": "x"}
            async with http.post(urls[0] + "/abort_request", json=abort, headers=headers) as r:
                answered.append(r.status)
        assert answered == [401, 200]
        # SGLang 0.5.23's shape: attention-DP ranks in attn_dp_size
        assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "--dispatch", "round_robin"], "the vllm persona dispatches by load score"),
        (
            ["sim", "--slow-rank", "3"],
            "Invalid value for --slow-rank: '3': expected RANK=FACTOR, e.g. 3=4.0",
        ),
        (["sim", "--slow-rank", "3=fast"], "'3=fast': expected RANK=FACTOR"),
        (["sim", "--admin-api-key", "k"], "--admin-api-key is SGLang's: give --persona sglang"),
        (["serve", "--dp-aware", "on", "--worker", "http://127.0.0.1:1"], "'auto', 'off'"),
        (["serve", "--worker", "http://127.0.0.1:1/v1"], "has a path (/v1): give the engine's"),
        (["serve", "--worker", "ftp://x:1"], "worker URL 'ftp://x:1' must be http(s)://host:port"),
        (["serve", "--worker", "notaurl"], "worker URL 'notaurl' must be http(s)://host:port"),
        (["serve", "--worker", "http://127.0.0.1:1,dp_size=two"], "dp_size must be an integer"),
    ],
)
def test_bad_options_fail_with_a_message(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dprouter", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_every_serve_option_says_what_it_does() -> None:
    from dprouter.cli.serve import serve

    silent = [o.name for o in serve.params if isinstance(o, click.Option) and not o.help]
    assert silent == []


async def _serve(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dprouter",
        "serve",
        "--port",
        "0",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


async def listening(proc: asyncio.subprocess.Process) -> tuple[str, str]:
    """Read ``serve``'s log until it says where it listens: (its URL, that line)."""
    assert proc.stderr is not None
    line = ""
    while "dprouter on" not in line:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "serve exited early"
    found = re.search(r"dprouter on (http://\S+): policy", line)
    assert found is not None, line
    return found[1], line


async def test_serve_routes_and_stops_on_sigterm(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2), EngineConfig(dp_size=2)])
    proc = await _serve(*(a for u in cluster.urls for a in ("--worker", u)))
    try:
        base, line = await listening(proc)
        assert "4 target(s)" in line
        ranks = set()
        for _ in range(4):
            async with http.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
                ranks.add((r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"]))
        assert len(ranks) == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0


async def test_serve_refuses_a_misconfigured_dp_size(start_cluster: StartCluster) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    proc = await _serve("--worker", f"{engine.url},dp_size=4")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    # said once, with its reason, then named in the exit message
    assert err.count(b"configured with dp_size 4 but the engine reports 2 rank(s)") == 1
    assert b"refusing to start with misconfigured workers: w0" in err


def test_serve_rejects_contradictory_options() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dprouter",
            "serve",
            "--worker",
            "http://127.0.0.1:1",
            "--policy",
            "round_robin",
            "--assignment",
            "min_load",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "drop --assignment or use --policy manual" in result.stderr


async def test_demo_uses_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    await run_demo(requests=60, concurrency=12)
    out = capsys.readouterr().out
    assert "ranks used: DP-aware 20/20" in out
    assert "outstanding after the runs: 0" in out
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/dashboard ", out, re.MULTILINE)
    lines = out.splitlines()
    rows = [line.split() for line in lines if line.startswith("sim-")]
    assert len(rows) == 20 + 3  # one line per engine, then one per rank
    assert all(int(row[2]) == 3 for row in rows[3:])  # 60 requests over 20 ranks
    # each column named apart: a group over its two columns, the target's column below
    header = next(i for i, line in enumerate(lines) if line.startswith("target"))
    groups, columns = lines[header - 1], lines[header]
    assert groups.split(maxsplit=2) == ["DP-aware", "router", "engines pick"]
    assert columns.split() == ["target", "requests", "TTFT", "p90", "requests", "TTFT", "p90"]
    # the routers' warnings come under the line that says why they are expected
    said = [line for line in lines if line.startswith("  log: ")]
    assert any("no --tenants keys" in line for line in said)
    assert sum("DP-aware routing is OFF" in line for line in said) == 1 + 3  # config, workers
    for line in said:
        above = lines[: lines.index(line)]
        heading = next(h for h in reversed(above) if not h.startswith("  log: "))
        assert "expected" in heading, (heading, line)


async def test_serve_pd_from_the_command_line(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    prefill, decode = (
        await start_cluster(
            [
                EngineConfig(
                    persona="sglang", dp_size=2, pd=PdConfig(mode="sglang", role="prefill")
                ),
                EngineConfig(
                    persona="sglang", dp_size=2, pd=PdConfig(mode="sglang", role="decode")
                ),
            ]
        )
    ).servers
    proc = await _serve(
        "--pd",
        "sglang",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--decode-policy",
        "least_load",
    )
    try:
        base, line = await listening(proc)
        assert "4 target(s)" in line
        async with http.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 200
            assert r.headers["x-dprouter-prefill"].startswith("p0/")
            assert r.headers["x-dprouter-target"].startswith("d0/")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0
