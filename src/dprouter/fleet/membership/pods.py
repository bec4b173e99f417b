"""Which workers a pod is: the rules of Kubernetes membership, with no I/O.

A pod is a member while it has a pod IP, its ``Ready`` condition is ``True`` and
it has no ``deletionTimestamp`` (it is being deleted: its engine is draining or
gone). Each of its engine ports is one worker, ``http://<pod IP>:<port>``,
named after the pod (``<pod>`` for one port, ``<pod>-<port>`` for several), so
that every replica names it alike. Its role comes from the P/D selectors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from yarl import URL

from dprouter.core.errors import ConfigError, PodError
from dprouter.core.types import Role
from dprouter.fleet.membership.labels import Selector, matches
from dprouter.fleet.worker_spec import WorkerSpec, check_worker, parse_worker

PORTS_ANNOTATION = "dprouter/ports"  # "8000" or "8000,8001,...": one worker per port
WORKER_ANNOTATION = "dprouter/worker"  # "dialect=vllm,dp_size=8": --worker's keys, each port


@dataclass(frozen=True)
class PodRules:
    pod_port: int | None
    prefill: Selector | None  # with --pd: pods matching it are prefill workers...
    decode: Selector | None  # ...and these decode; a pod matching neither is not a member
    bootstrap_annotation: str

    def role(self, labels: dict[str, str]) -> Role | None:
        if self.prefill is None and self.decode is None:
            return "regular"
        prefill = self.prefill is not None and matches(self.prefill, labels)
        decode = self.decode is not None and matches(self.decode, labels)
        if prefill and decode:
            raise PodError("its labels match both --prefill-selector and --decode-selector")
        return "prefill" if prefill else "decode" if decode else None

    def workers(self, pod: dict[str, Any]) -> list[WorkerSpec]:
        """The workers ``pod`` is now (none while it is not a member)."""
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or meta.get("deletionTimestamp") or not ready(status):
            return []
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        role = self.role(labels)
        if role is None:
            return []
        ports = self.ports(notes)
        keys = self.keys(notes, len(ports))
        bootstrap = notes.get(self.bootstrap_annotation)
        name = str(meta["name"])
        specs = []
        for port in ports:
            url = str(URL.build(scheme="http", host=ip, port=port))
            try:
                spec = parse_worker(",".join((url, *keys)), role)
                spec = replace(
                    spec,
                    id=name if len(ports) == 1 else f"{name}-{port}",
                    bootstrap_port=_port(bootstrap)
                    if bootstrap is not None
                    else spec.bootstrap_port,
                )
                specs.append(check_worker(spec))
            except (ConfigError, TypeError) as exc:
                raise PodError(str(exc)) from None
        return specs

    def keys(self, notes: dict[str, str], ports: int) -> list[str]:
        """The ``dprouter/worker`` annotation's ``key=value`` pairs (``--worker``'s keys)."""
        pairs = [p.strip() for p in notes.get(WORKER_ANNOTATION, "").split(",") if p.strip()]
        for pair in pairs:
            key = pair.partition("=")[0].strip().replace("-", "_")
            if key in ("url", "id", "role"):
                raise PodError(f"{WORKER_ANNOTATION}: {key} comes from the pod, not from a key")
            if key == "rank_offset" and ports > 1:
                raise PodError(
                    f"{WORKER_ANNOTATION}: rank_offset on a pod of {ports} ports; each port's "
                    "is discovered from its engine"
                )
        return pairs

    def ports(self, notes: dict[str, str]) -> list[int]:
        listed = notes.get(PORTS_ANNOTATION)
        if listed is None:
            if self.pod_port is None:
                raise PodError(f"no {PORTS_ANNOTATION} annotation and no --pod-port")
            return [self.pod_port]
        ports = [_port(p) for p in listed.split(",") if p.strip()]
        if not ports or len(set(ports)) != len(ports):
            raise PodError(f"{PORTS_ANNOTATION} {listed!r}: list distinct ports, e.g. 8000,8001")
        return ports


def ready(status: dict[str, Any]) -> bool:
    conditions = status.get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _port(text: str) -> int:
    try:
        port = int(str(text).strip())
    except ValueError:
        raise PodError(f"{text!r} is not a port") from None
    if not 1 <= port <= 65535:
        raise PodError(f"port {port} is out of range")
    return port
