"""``GET /dashboard/data``: the one JSON the page and ``dprouter top`` read.

Its shape is part of the API (docs/router.md, "Dashboard"): add keys, never
rename them. Loads are read off the targets at the moment of the call (the
board: the whole router's under ``--processes``), the requests held off their gauge
(summed over the serving processes), the workers' holds and weights' versions off the
registry (the parent's, which every serving process follows), rates off the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target
from dprouter.server.admin import worker_fields
from dprouter.server.dashboard.window import Rates, Window


@dataclass(frozen=True)
class RouterInfo:
    """What the router says of itself, besides its targets."""

    version: str
    uptime: float  # seconds
    processes: int
    policy: str
    pd: str | None
    discovery: str  # static, etcd, k8s or moriio
    sessions: int  # routing keys held by manual (0 for other policies)
    held: dict[tuple[str, str], int]  # requests held in the router now, by (class, why)


def target_row(target: Target, rates: Rates | None) -> dict[str, Any]:
    worker = target.worker
    return {
        "target": target.label,
        "worker": worker.id,
        "dp_rank": target.rank,
        "role": worker.role,
        "in_flight": target.outstanding,
        "engine_load": target.reported,
        "load": target.load,
        "ready": worker.ready,
        "breaker": "open" if target.tripped else "closed",
        "requests_per_second": round(rates.per_second, 3) if rates else 0.0,
        "ttfb_p50_seconds": rates.ttfb_p50 if rates else None,
        "ttfb_p99_seconds": rates.ttfb_p99 if rates else None,
        "errors": rates.errors if rates else {},
    }


def build(registry: Registry, window: Window, info: RouterInfo) -> dict[str, Any]:
    rates = window.rates()
    workers = list(registry.workers.values())
    targets = [
        target_row(t, rates.get((w.role, w.id, t.rank_label))) for w in workers for t in w.targets
    ]
    lanes = None
    pairs: list[dict[str, Any]] = []
    if info.pd is not None:
        lanes = {
            side: [t["target"] for t in targets if t["role"] == side]
            for side in ("prefill", "decode")
        }
        seconds = max(window.seconds, 1e-9)
        for (pw, pr, dw, dr), count in sorted(window.pairs().items()):
            pairs.append(
                {
                    "prefill": f"{pw}/{pr}" if pr else pw,
                    "decode": f"{dw}/{dr}" if dr else dw,
                    "requests": round(count),
                    "requests_per_second": round(count / seconds, 3),
                }
            )
    states = [w.state for w in workers]
    classes: dict[str, dict[str, int]] = {}
    for (name, why), count in info.held.items():
        classes.setdefault(name, {})[why] = count
    return {
        "window_seconds": round(window.seconds, 3),
        "router": {
            "version": info.version,
            "uptime_seconds": round(info.uptime, 1),
            "processes": info.processes,
            "policy": info.policy,
            "pd": info.pd,
            "requests_per_second": round(sum(r.per_second for r in rates.values()), 3),
            "in_flight": sum(t["in_flight"] for t in targets),
            "event_loop_lag_seconds": window.samples[-1].lag if window.samples else 0.0,
            "discovery": {
                "source": info.discovery,
                "stale": registry.stale,
                "workers": {s: states.count(s) for s in ("ready", "discovering", "error")},
            },
            "sessions": info.sessions,
            "held_requests": {"total": sum(info.held.values()), "classes": classes},
        },
        "workers": [{**worker_fields(w), "hold": w.hold} for w in workers],
        "targets": targets,
        "lanes": lanes,
        "pairs": pairs,
    }
