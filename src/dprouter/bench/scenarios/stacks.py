"""The stacks study: what the bare HTTP stacks dprouter could be built on cost, and
whether their clients stop the engine when a request is abandoned.

Why it exists: the overhead scenario asks dprouter for at most 1.5x the SGLang
gateway's CPU per plain request (1.0x per stream); the bare aiohttp proxy alone
is already above that. This study measures the same bare proxy on the Python
stacks that could replace aiohttp (granian as server; pyreqwest and pyqwest,
Rust clients, as client) beside the gateway, in the overhead scenario's
harness, and checks each client for the property a router cannot give up: a
cancelled request closes its upstream connection, so a vLLM engine (which has
no abort endpoint) stops generating for a client that left.

The stacks live in a virtual environment of their own, pinned, installed the
first time (``~/.cache/dprouter-bench/stacks``; ``DPROUTER_BENCH_HOME``). Not part
of ``bench all``: it studies the stacks, not dprouter.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import click

from dprouter.bench.harness import peer_routers
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.bench.scenarios.overhead import BARE, LOADS, ROUNDS, Command, measure

PINS = (
    "aiohttp==3.14.5",
    "granian==2.8.7",
    "pyreqwest==0.15.1",
    "pyqwest==0.12.0",
    "uvloop==0.23.0",
)
CLIENTS = ("aiohttp", "pyreqwest", "pyqwest")
SCRIPT = Path(__file__).parents[1] / "harness" / "stack_proxy.py"


def home() -> Path:
    return peer_routers.bench_home() / "stacks"


def python() -> str:
    return str(home() / "bin" / "python")


def ensure() -> str | None:
    """Install the stacks if missing; None when they are there, else why not."""
    if (home() / ".installed").exists():
        return None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(home())], check=True, timeout=120)
        pip = [str(home() / "bin" / "pip"), "install", "--quiet", *PINS]
        subprocess.run(pip, check=True, timeout=900, stdin=subprocess.DEVNULL, capture_output=True)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"the stacks could not be installed: {exc}"
    (home() / ".installed").touch()
    return None


def on_aiohttp(name: str) -> Command:
    def command(port: int, up: str) -> list[str]:
        return [python(), str(SCRIPT), "--port", str(port), "--upstream", up, "--client", name]

    return command


def on_granian(name: str) -> Command:
    def command(port: int, up: str) -> list[str]:
        return [
            *("env", f"UPSTREAM={up}", f"CLIENT={name}", str(home() / "bin" / "granian")),
            *("--interface", "rsgi", "--host", "127.0.0.1", "--port", str(port)),
            *("--workers", "1", "--runtime-threads", "1", "--loop", "uvloop"),
            *("--log-level", "warning", "--working-dir", str(SCRIPT.parent), "stack_proxy:app"),
        ]

    return command


STACKS: dict[str, tuple[str, str, Command]] = {
    "aiohttp + pyreqwest": ("aiohttp", "pyreqwest", on_aiohttp("pyreqwest")),
    "granian + aiohttp": ("granian (RSGI)", "aiohttp", on_granian("aiohttp")),
    "granian + pyreqwest": ("granian (RSGI)", "pyreqwest", on_granian("pyreqwest")),
    "granian + pyqwest": ("granian (RSGI)", "pyqwest", on_granian("pyqwest")),
}


def cancels(name: str) -> str:
    """What the engine saw when a request through client ``name`` was cancelled."""
    done = subprocess.run(
        [python(), str(SCRIPT), "--cancel-check", name],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        return f"check failed: {done.stderr.strip().splitlines()[-1:]}"
    saw: str = json.loads(done.stdout)["engine_saw"]
    return {"disconnect": "yes", "finished": "no: the engine ran to the end"}.get(saw, saw)


def run(quick: bool, out: Path) -> Result:
    why = ensure()
    if why is not None:
        raise click.ClickException(why)
    kinds = ["dprouter", BARE, *STACKS, *peer_routers.available()]
    commands = {name: command for name, (_, _, command) in STACKS.items()}
    seconds, rounds = (1.0, 1) if quick else (6.0, ROUNDS)
    found = asyncio.run(measure(kinds, seconds, rounds, commands))
    cancel = {name: cancels(name) for name in CLIENTS}
    gateway = found.get("sglang-gateway")
    plain, wide, stream = (name for name, _, _ in LOADS)
    parts = {"dprouter": ("aiohttp", "aiohttp"), BARE: ("aiohttp", "aiohttp")}
    parts |= {name: (server, client) for name, (server, client, _) in STACKS.items()}

    def ratio(kind: str, load: str) -> float | None:
        if gateway is None:
            return None
        return found[kind][load]["cpu_ms_per_req"] / gateway[load]["cpu_ms_per_req"]

    rows: list[list[Cell]] = []
    for kind, loads in found.items():
        server, client = parts.get(kind, ("Rust", "Rust"))
        rows.append(
            [
                kind,
                server,
                client,
                cancel.get(client, "-"),
                loads[plain]["cpu_ms_per_req"],
                ratio(kind, plain),
                loads[stream]["cpu_ms_per_req"],
                ratio(kind, stream),
                loads[wide]["p99_ms"],
                int(sum(loads[n]["errors"] for n, _, _ in LOADS)),
            ]
        )
    return Result(
        scenario="stacks",
        title="Stacks: bare proxies on the Python HTTP stacks, beside the SGLang gateway",
        method=(
            "The overhead scenario's harness (every proxy up at once on core 0, trivial "
            f"backend and load on core 1, {seconds:g} s per proxy and load in {rounds} "
            "interleaved round(s)). Bare proxies forward the bytes with no routing logic. "
            "'cancels upstream': a request to an engine that answers after 3 s is "
            "cancelled after 0.3 s; yes = the engine saw the connection close."
        ),
        tables=[
            Table(
                [
                    "proxy",
                    "server",
                    "client",
                    "cancels upstream",
                    "plain CPU ms/req",
                    "x gateway",
                    "stream CPU ms/req",
                    "x gateway",
                    "p99 ms @512",
                    "errors",
                ],
                rows,
            )
        ],
        verdict=verdict(parts, cancel, {k: ratio(k, plain) for k in parts}),
        data={"found": found, "cancels": cancel},
    )


def verdict(
    parts: dict[str, tuple[str, str]], cancel: dict[str, str], plain: dict[str, float | None]
) -> str:
    """The cheapest bare proxy per plain request among the stacks whose client cancels, and
    among all of them."""
    bare = [k for k in parts if k != "dprouter" and plain[k] is not None]
    if not bare:
        return "No gateway to compare with: see the table."

    def cheapest(kinds: list[str]) -> str:
        best = min(kinds, key=lambda k: plain[k] or 0.0)
        return f"{best} ({plain[best]:.2f}x the gateway)"

    safe = [k for k in bare if cancel.get(parts[k][1]) == "yes"]
    return (
        f"Per plain request, the cheapest bare proxy is {cheapest(bare)}; the cheapest whose "
        "client closes an abandoned upstream request is "
        + (cheapest(safe) if safe else "none")
        + "."
    )
