"""The peers dprouter is compared with: the SGLang gateway, in its current release and
in its lean January build, and vllm-router.

All three are Rust binaries inside Python wheels: ``smg`` 1.13.0 (the current SGLang
gateway, kind ``smg``), ``sglang-router`` 0.3.2 (its January build, kind
``sglang-gateway``; its binary is called ``smg`` too) and ``vllm-router`` 0.1.17,
installed, pinned, into virtual environments of their own the first time a scenario
needs them (``~/.cache/dprouter-bench/peers``, and ``.../smg`` for smg 1.13.0, whose
binary would clash; ``DPROUTER_BENCH_HOME``). Command lines, as run:

    smg launch --host 127.0.0.1 --port P --worker-urls URL... --policy POLICY
        [--dp-aware] --prometheus-host 127.0.0.1 --prometheus-port M   (both gateways)
    vllm-router --host 127.0.0.1 --port P --worker-urls URL... --policy POLICY
        [--intra-node-data-parallel-size N] --worker-startup-check-interval 1
        --prometheus-host 127.0.0.1 --prometheus-port M

Known limits: the gateway's ``--dp-aware`` needs ``/server_info`` (SGLang only),
it pins ranks with the body field ``data_parallel_rank``, and its ``/health``
answers before workers are registered; vllm-router pins with the header
``X-data-parallel-rank`` and binds its port only once every worker is healthy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from dprouter.bench.harness.procs import Proc, free_port

# kind -> (its environment under the bench home, the pinned package, its binary)
PEERS = {
    "smg": ("smg", "smg==1.13.0", "smg"),
    "sglang-gateway": ("peers", "sglang-router==0.3.2", "smg"),
    "vllm-router": ("peers", "vllm-router==0.1.17", "vllm-router"),
}
KINDS = tuple(PEERS)
GATEWAYS = ("smg", "sglang-gateway")  # the SGLang gateway's releases: `smg launch`


def bench_home() -> Path:
    env = os.environ.get("DPROUTER_BENCH_HOME")
    return Path(env) if env else Path.home() / ".cache" / "dprouter-bench"


def home(kind: str = "vllm-router") -> Path:
    return bench_home() / PEERS[kind][0]


def binary(kind: str) -> Path:
    return home(kind) / "bin" / PEERS[kind][2]


def ensure() -> str | None:
    """Install the peers if missing; None when they are there, else why not."""
    for kind in KINDS:
        if binary(kind).exists():
            continue
        env, pin, _ = PEERS[kind]
        pins = [p for e, p, _ in PEERS.values() if e == env]
        try:
            venv = bench_home() / env
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "--quiet", *pins],
                check=True,
                timeout=900,
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            return f"peers could not be installed ({pin}): {exc}"
    return None


def available() -> list[str]:
    return [] if ensure() is not None else list(KINDS)


def router(
    kind: str,
    workers: list[str],
    port: int,
    cpus: str | None = None,
    policy: str = "round_robin",
    dp_size: int = 1,
    dp_aware: bool = False,
    extra: tuple[str, ...] = (),
) -> Proc:
    """``extra``: more of the peer's own flags (e.g. smg's ``--dp-minimum-tokens-scheduler``)."""
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        *metrics,
    ]
    if kind in GATEWAYS:
        return Proc(
            [str(binary(kind)), "launch", *common, *(["--dp-aware"] if dp_aware else []), *extra],
            cpus=cpus,
        )
    flags = ["--intra-node-data-parallel-size", str(dp_size)] if dp_size > 1 else []
    return Proc(
        [str(binary(kind)), *common, *flags, *extra, "--worker-startup-check-interval", "1"],
        cpus=cpus,
    )


class Exited(RuntimeError):
    """The process stopped before it served."""


async def start_on_free_port(
    build: Callable[[int], Proc], seconds: float = 60, model: str = "bench", tries: int = 3
) -> tuple[Proc, str]:
    """Start a peer that binds the port it is given (``build(port)``) and wait until it
    serves; returns it and its URL. The port was free when drawn but another process may
    bind it first: then the peer exits before serving, and it starts again on another."""
    for attempt in range(1, tries + 1):
        port = free_port()
        proc = build(port)
        await proc.start()
        url = f"http://127.0.0.1:{port}"
        try:
            await until_serving(url, seconds, model, proc)
        except Exited:
            if attempt == tries:
                raise
            continue
        except BaseException:
            await proc.stop()
            raise
        return proc, url
    raise AssertionError("unreachable")


async def until_serving(
    url: str,
    seconds: float = 60,
    model: str = "bench",
    proc: Proc | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Wait until a real completion succeeds (a router's /health may say yes too early);
    raise ``Exited`` if ``proc``, the server, stops first."""
    body = {"model": model, "prompt": "ready?", "max_tokens": 1}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with asyncio.timeout(seconds):
            while True:
                if proc is not None and proc.exited:
                    raise Exited(f"{proc.argv} exited:\n{''.join(proc.lines[-20:])}")
                try:
                    sent = session.post(url + "/v1/completions", json=body, headers=headers)
                    async with sent as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
