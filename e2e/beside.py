"""dprouter installed into an engine's own environment, as an RL framework that imports it
would install it there: ``pip install`` of this checkout.

An engine's environment holds what the engine requires. These CPU environments are
installed from locks without dependencies and lack a few of them (SGLang's numba, say),
so the install is held to what the environment holds and to the exact versions its
packages require (``constraints``): the state a full install of the engine would be in.
``install`` records what the environment held before and after, and what ``pip check``
said before and after (the CPU builds' stand-ins for CUDA packages are missing from the
start). ``embedded`` runs ``Router`` from there, with the environment's own interpreter
(``e2e/embedded_router.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
SCRIPT = Path(__file__).with_name("embedded_router.py")


@dataclass(frozen=True)
class Installed:
    changed: dict[str, tuple[str, str]]  # package -> (before, after): must stay empty
    added: dict[str, str]  # packages the environment lacked: dprouter and what it needs
    new_problems: list[str]  # lines of ``pip check`` after that were not there before


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # never the test venv's packages
    env.pop("PIP_CONSTRAINT", None)
    return env


def _freeze(python: Path) -> dict[str, str]:
    done = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
        timeout=120,
    )
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(done.stdout)}


def _check(python: Path) -> set[str]:
    done = subprocess.run(
        [str(python), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    return {line for line in done.stdout.splitlines() if line.strip()}


# run by the environment's interpreter: the exact versions its packages require
PINS = """
import json
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
pins = {}
for dist in metadata.distributions():
    for text in dist.requires or ():
        try:
            req = Requirement(text)
        except ValueError:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            pins.setdefault(req.name.lower().replace("_", "-"), set()).add(specs[0].version)
print(json.dumps({name: sorted(found) for name, found in pins.items()}))
"""


def constraints(python: Path, held: dict[str, str]) -> str:
    """What the environment holds, and the exact versions its packages require of what it
    lacks (a package two of them pin differently is left to pip)."""
    done = subprocess.run(
        [str(python), "-c", PINS], capture_output=True, text=True, check=True, env=_env()
    )
    lines = {name: f"{name}=={version}" for name, version in held.items() if name != "dprouter"}
    for name, versions in json.loads(done.stdout).items():
        if name not in lines and len(versions) == 1:
            lines[name] = f"{name}=={versions[0]}"
    return "\n".join(lines.values()) + "\n"


def install(python: Path) -> Installed:
    """``pip install`` this checkout into the environment of ``python``."""
    before, problems = _freeze(python), _check(python)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pinned:
        pinned.write(constraints(python, before))
        pinned.flush()
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "-c", pinned.name, str(ROOT)],
            check=True,
            env=_env(),
            timeout=900,
        )
    after = _freeze(python)
    changed = {
        name: (before[name], version)
        for name, version in after.items()
        if name in before and before[name] != version and name != "dprouter"
    }
    added = {name: version for name, version in after.items() if name not in before}
    return Installed(changed, added, sorted(_check(python) - problems))


def embedded(python: Path, engine_url: str) -> dict[str, object]:
    """What the embedded router answered, run from the environment of ``python``."""
    done = subprocess.run(
        [str(python), str(SCRIPT), engine_url],
        capture_output=True,
        text=True,
        env=_env(),
        cwd="/",  # not this checkout: dprouter comes from the environment
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(f"embedded router failed ({done.returncode}): {done.stderr[-2000:]}")
    found: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return found
