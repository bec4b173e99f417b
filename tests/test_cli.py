"""The ``dprouter`` command as a user runs it: a real process, stopped by its PID."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp

import dprouter


def test_public_names() -> None:
    assert sorted(dprouter.__all__) == [
        "Arrival",
        "Cluster",
        "CostModel",
        "EngineConfig",
        "Faults",
        "OfflineSim",
        "RankLimits",
        "SimCluster",
        "SimReport",
        "SimServer",
        "fleet",
    ]


async def test_sim_command_serves_engines_and_stops_on_sigterm(
    http: aiohttp.ClientSession,
) -> None:
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
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
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
        async with http.get(urls[1] + "/server_info") as r:
            info = await r.json()
        assert (info["dp_size"], info["enable_dp_attention"]) == (2, True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0


def test_bad_options_fail_with_a_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dprouter", "sim", "--dispatch", "shortest_queue"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "the vllm persona dispatches by load score" in result.stderr
