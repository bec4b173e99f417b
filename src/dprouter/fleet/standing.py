"""What the engine commands left each worker in: paused, updating its weights, asleep.

The router holds a worker while its standing says so (``Registry.hold``: no new request
while another worker can serve it). ``Standings`` keeps them for one router, by worker
id; under etcd discovery ``membership.etcd_holds.EtcdHolds`` keeps them for every
replica. The commands (``server/commands.py``) change a standing and a version only
through them, so where they are kept is decided here and nowhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import ASLEEP, PAUSED, UPDATING, Worker


@dataclass(frozen=True)
class Standing:
    """The router holds the worker while any is true."""

    paused: bool = False
    updating: bool = False  # during an update call, and between begin and finish
    session: bool = False  # begun, not finished
    asleep: bool = False

    def why(self) -> str | None:
        if self.updating:
            return UPDATING
        if self.paused:
            return PAUSED
        return ASLEEP if self.asleep else None

    def fields(self) -> dict[str, bool]:
        return asdict(self)

    @classmethod
    def of(cls, found: dict[str, Any]) -> Standing:
        """From ``fields``' shape; anything else in ``found`` is not its."""
        return cls(**{k: bool(found.get(k)) for k in ("paused", "updating", "session", "asleep")})

    def but(self, **changed: bool) -> Standing:
        return replace(self, **changed)


class Standings:
    """Workers' standings for this router alone, by worker id. A worker that leaves leaves
    its standing behind: one added again under its id starts afresh."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.by_id: dict[str, Standing] = {}
        registry.listeners.append(self._forget)

    def of(self, worker: Worker) -> Standing:
        return self.by_id.get(worker.id) or Standing()

    def set(self, worker: Worker, standing: Standing) -> None:
        """``worker`` stands so now: held, or released, from this moment."""
        self.by_id[worker.id] = standing
        self.registry.hold(worker, standing.why())

    def version(self, worker: Worker, version: str) -> None:
        """A command said ``worker`` serves weights ``version`` now."""
        self.registry.set_weight_version(worker, version)

    async def published(self, seconds: float) -> None:
        """Every change made so far is known where it must be (here: at once)."""

    def _forget(self) -> None:
        for gone in [k for k in self.by_id if k not in self.registry.workers]:
            del self.by_id[gone]
