"""The Python examples of the README and the docs, run as written: each block is saved as
a script and run by a fresh interpreter, which is how a reader pastes it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def example(page: str) -> str:
    """The page's one Python block."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (ROOT / page).read_text(), re.M | re.S)
    assert len(blocks) == 1, f"{page}: {len(blocks)} Python blocks"
    return str(blocks[0])


def run(code: str, where: Path) -> list[str]:
    """The script's printed lines; it must end well, on its own."""
    script = where / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=where,  # the installed package, not the checkout's files beside the script
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("page", ["README.md", "docs/router.md"])
def test_the_router_example_routes_to_every_target(page: str, tmp_path: Path) -> None:
    """Two simulated DP4 engines behind a router: eight requests, one on each target, each
    answered with the engine's text."""
    lines = run(example(page), tmp_path)
    served = [re.fullmatch(r"(engine-\d) rank (\d):(.+)", line) for line in lines]
    assert all(served), lines
    targets = {(m[1], int(m[2])) for m in served if m}
    assert targets == {(f"engine-{e}", r) for e in (0, 1) for r in range(4)}
    assert all(len(m[3].split()) == 8 for m in served if m)  # max_tokens 8


def test_the_simulator_example_restarts_an_engine_on_its_port(tmp_path: Path) -> None:
    first, restarted = run(example("docs/simulator.md"), tmp_path)
    urls = ast.literal_eval(first)  # the list as printed: two engines, a port each
    assert len(urls) == 2 and urls[0] != urls[1]
    assert all(u.startswith("http://127.0.0.1:") for u in urls)
    assert restarted == urls[0]
