"""Persona files: an engine's shape, per-rank limits and step costs, measured on a real
engine by ``dprouter sim calibrate`` and loaded by ``dprouter sim --persona-file``.

A file holds ``config`` (``EngineConfig`` fields), ``limits`` (``RankLimits``),
``cost`` (``CostModel``), and, for the reader, ``made_by`` (the command that wrote
it) and ``measured`` (what the fit was made from). An unknown field fails the load:
a file written for a newer simulator is not half-read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from dprouter.sim.model.config import CostModel, EngineConfig, RankLimits

CALIBRATED = Path(__file__).parent / "calibrated"  # the files this package ships
SHAPE = ("persona", "dp_size", "tp_size", "dp_attention", "dispatch", "mixed_chunk")


def path_of(name: str) -> Path:
    """A shipped persona's name (``sglang-cpu``) or a file's path."""
    shipped = CALIBRATED / f"{name}.json"
    if "/" not in name and not name.endswith(".json") and shipped.is_file():
        return shipped
    path = Path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CALIBRATED.glob("*.json")))
        raise ValueError(f"no persona file {name!r} (shipped: {known})")
    return path


def _only(kind: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown fields {', '.join(unknown)}")
    return values


def load(name: str) -> EngineConfig:
    path = path_of(name)
    try:
        data = json.loads(path.read_text())
        config = _only(EngineConfig, data.get("config", {}), f"{path}: config")
        if set(config) - set(SHAPE):
            raise ValueError(f"{path}: config holds only {', '.join(SHAPE)}")
        limits = RankLimits(**_only(RankLimits, data.get("limits", {}), f"{path}: limits"))
        cost = CostModel(**_only(CostModel, data.get("cost", {}), f"{path}: cost"))
        return EngineConfig(**config, limits=limits, cost=cost)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def dump(config: EngineConfig, made_by: str, measured: dict[str, Any]) -> str:
    """The file's text for ``config`` (its shape, limits and costs)."""
    data = {
        "made_by": made_by,
        "config": {k: getattr(config, k) for k in SHAPE},
        "limits": asdict(config.limits),
        "cost": asdict(config.cost),
        "measured": measured,
    }
    return json.dumps(data, indent=1) + "\n"
