"""The package's faces: ``dprouter`` is the router's API, ``dprouter.sim`` the simulator's;
the router and ``dprouter serve`` load neither the simulator nor the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import dprouter
import dprouter.sim

HEAVY = ("dprouter.sim", "dprouter.bench", "matplotlib", "tqdm", "rich")  # rich: dprouter top


def loaded_after(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has imported after running ``code``."""
    report = f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    probe = f"{code}\nimport json, sys\n{report}"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def test_public_names() -> None:
    assert sorted(dprouter.__all__) == ["Router", "RouterConfig", "WorkerSpec", "build_app"]


def test_simulator_names() -> None:
    assert sorted(dprouter.sim.__all__) == [
        "Arrival",
        "Cluster",
        "CostModel",
        "EngineConfig",
        "Faults",
        "KvEventsConfig",
        "OfflineSim",
        "RankLimits",
        "SimCluster",
        "SimReport",
        "SimServer",
        "fleet",
    ]


@pytest.mark.parametrize(
    "code",
    [
        "import dprouter; print(dprouter.Router)",
        "import dprouter.config",
        "import dprouter.cli.serve",
        "import dprouter.cli.launch",
        # the command line as `dprouter serve --help` runs it
        "import sys\nfrom dprouter.cli import main\nsys.argv = ['dprouter', 'serve', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass",
    ],
    ids=["dprouter", "config", "serve", "launch", "serve --help"],
)
def test_the_router_loads_neither_simulator_nor_benchmarks(code: str) -> None:
    assert loaded_after(code) == []


def test_the_face_loads_its_names_when_asked() -> None:
    """``import dprouter`` (and the command's own package) loads no router module: the
    command sets its SIGTERM handling up before they load (tests/test_serve_startup.py)."""
    probe = (
        "import sys, dprouter.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('dprouter.')))\n"
        "from dprouter import Router\n"
        "print(Router.__module__, 'dprouter.server.router' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines() == ["['dprouter.cli']", "dprouter.server.router True"]
    assert dprouter.Router.__name__ == "Router" and "build_app" in dir(dprouter)
    with pytest.raises(AttributeError, match="no attribute 'Rooter'"):
        dprouter.Rooter  # noqa: B018


def test_the_bench_command_loads_its_extra_only_when_it_runs() -> None:
    assert loaded_after("import dprouter.bench.command") == ["dprouter.bench"]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["serve", "--help"],
        ["bench", "--help"],
        ["register", "--help"],
        ["top", "--help"],
    ],
)
def test_help(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dprouter", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: ")
    if args == ["--help"]:
        listed = [line.split()[0] for line in done.stdout.split("Commands:\n")[1].splitlines()]
        assert listed == ["bench", "demo", "launch", "register", "serve", "sim", "top"]
