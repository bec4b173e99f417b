"""Workers from Kubernetes: the ready pods a label selector finds, each port a worker.

List the pods, then watch them from the list's version. After any gap -- the
watch broke, the version expired (410), or ``resync`` seconds passed -- list
again and reconcile: a worker whose pod is gone, unready or deleting is
removed, whatever events were missed (the peers' bug: a pod deleted while their
watch was down kept its traffic for hours). A watch the server ends cleanly
(``timeoutSeconds``) is resumed from the last version seen. While the API
server cannot be read, the last membership stays and keeps routing; the
registry is marked stale until a list succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import aiohttp

from dprouter.core.errors import Duplicate, Gone, KubeError
from dprouter.fleet.membership.kube_client import Event, Kube
from dprouter.fleet.membership.kubeconfig import Access
from dprouter.fleet.membership.pods import PodRules
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.fleet.worker_spec import WorkerSpec

log = logging.getLogger("dprouter")
BACKOFF = (0.2, 5.0)  # seconds between attempts to reach the API server: first, most
Member = tuple[str, WorkerSpec]  # (pod name, spec)


class KubernetesMembership:
    name = "kubernetes"

    def __init__(
        self,
        access: Access,
        registry: Registry,
        monitor: Monitor,
        rules: PodRules,
        namespace: str | None,
        selector: str | None,
        resync: float,
    ) -> None:
        self.access = access
        self.namespace = namespace or access.namespace
        self.selector = selector or ""
        self.rules = rules
        self.registry = registry
        self.monitor = monitor
        self.resync = resync
        self.members: dict[str, Member] = {}  # worker id -> (pod name, spec)
        self.refused: dict[str, str] = {}  # pod name -> why (logged once per reason)
        self.synced = asyncio.Event()  # set once the pods have been listed
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()  # its own: watches outlive request timeouts
        kube = Kube(self.access, self._session)
        self._task = asyncio.create_task(self._run(kube), name="kubernetes-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def pod_of(self, worker_id: str) -> str | None:
        """The pod a worker comes from (None: not from a pod)."""
        member = self.members.get(worker_id)
        return member[0] if member is not None else None

    async def _run(self, kube: Kube) -> None:
        delay = BACKOFF[0]
        while True:
            try:
                pods, version = await kube.list_pods(self.namespace, self.selector)
            except KubeError as exc:
                self._unreachable(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            delay = BACKOFF[0]
            self.refused.clear()  # a pod refused for a clash may fit now: say so again
            self.reconcile(pods)
            self._reachable()
            try:
                await self._follow(kube, version)
            except Gone as exc:
                log.info("kubernetes: %s; listing the pods again", exc)
            except KubeError as exc:
                log.warning("kubernetes: %s; listing the pods again", exc)
                await asyncio.sleep(BACKOFF[0])  # not a tight loop if watches keep failing

    async def _follow(self, kube: Kube, version: str) -> None:
        """Apply the watch's events until the next whole list is due."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.resync
        while (left := due - loop.time()) > 0:
            opened = loop.time()
            try:  # the server ends the stream after ``timeoutSeconds``, but may not
                async with asyncio.timeout(left):
                    seconds = max(1, math.ceil(left))
                    async for event in kube.watch_pods(
                        self.namespace, self.selector, version, seconds
                    ):
                        version = self.apply(event) or version
                    if loop.time() - opened < 1.0:  # ended at once: no tight loop of watches
                        await asyncio.sleep(BACKOFF[0])
            except TimeoutError:
                return

    def apply(self, event: Event) -> str | None:
        """One watch event; the version it brings."""
        meta = event.object.get("metadata") or {}
        if event.type in ("ADDED", "MODIFIED", "DELETED"):
            self.update(str(meta.get("name")), None if event.type == "DELETED" else event.object)
        return meta.get("resourceVersion")  # a BOOKMARK brings only this

    def reconcile(self, pods: list[dict[str, Any]]) -> None:
        """Make the members exactly the workers of the pods listed (level-triggered)."""
        wanted: dict[str, Member] = {}
        for pod in pods:
            name = str((pod.get("metadata") or {}).get("name"))
            wanted.update(self._workers(name, pod))
        self._set(wanted, None)

    def update(self, name: str, pod: dict[str, Any] | None) -> None:
        """One pod's new state (None: deleted)."""
        self._set(self._workers(name, pod) if pod is not None else {}, name)

    def _workers(self, name: str, pod: dict[str, Any]) -> dict[str, Member]:
        try:
            specs = self.rules.workers(pod)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # PodError, bad IP
            self._refuse(name, f"pod {name} is not a worker: {exc}")
            return {}
        return {s.id or name: (name, s) for s in specs}

    def _set(self, wanted: dict[str, Member], pod: str | None) -> None:
        """Members (of ``pod``, or all) become ``wanted``: an update is a removal and an add,
        so a pod back with a new IP is discovered afresh at its new URL."""
        held = {w: m for w, m in self.members.items() if pod is None or m[0] == pod}
        for worker_id, member in held.items():
            if wanted.get(worker_id) != member:
                self._remove(worker_id)
        for worker_id, member in wanted.items():
            if worker_id not in self.members:
                self._add(worker_id, member)

    def _remove(self, worker_id: str) -> None:
        pod, _ = self.members.pop(worker_id)
        if worker_id in self.registry.workers:
            self.monitor.forget(worker_id)
            self.registry.remove(worker_id)
            log.info("kubernetes: worker %s left (pod %s)", worker_id, pod)

    def _add(self, worker_id: str, member: Member) -> None:
        pod, spec = member
        try:
            worker = self.registry.add(worker_from_spec(spec, self.registry))
        except Duplicate as exc:
            self._refuse(pod, f"pod {pod}: {exc}")
            return
        self.members[worker_id] = member
        self.monitor.watch(worker)
        log.info("kubernetes: worker %s joined: %s (pod %s)", worker.id, worker.url, pod)

    def _refuse(self, pod: str, why: str) -> None:
        if self.refused.get(pod) != why:
            self.refused[pod] = why
            log.error("kubernetes: %s", why)

    def _reachable(self) -> None:
        if self.registry.mark_stale(False):
            log.warning("kubernetes API reachable again: membership is current")
        self.synced.set()

    def _unreachable(self, exc: KubeError) -> None:
        if self.registry.mark_stale(True):
            log.error(
                "kubernetes API cannot be read (%s): keeping the last membership (%d workers) "
                "and retrying",
                exc,
                len(self.members),
            )
