"""The front door: every routed request passes it first. Who sent it (``identify``: an
API key, a JWT, or nobody when none is configured), whether their tenant's limits let it
in (``proxy/limiter.py``), and the class it is held in when the fleet is full
(``proxy/dispatch.py``). docs/security.md says what is checked and why.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from dprouter.core.errors import error
from dprouter.core.tenants import ANONYMOUS, Tenant, Tenants
from dprouter.core.types import Caller
from dprouter.proxy.limiter import ENTRY, Entry, Limiter
from dprouter.proxy.metrics import RouterMetrics

Identify = Callable[[web.Request], Awaitable[Caller | web.Response]]


class Door:
    def __init__(
        self,
        tenants: Tenants,
        limiter: Limiter,
        metrics: RouterMetrics,
        classes: tuple[str, ...],
        identify: Identify | None = None,
    ) -> None:
        self.tenants = tenants
        self.limiter = limiter
        self.metrics = metrics
        self.classes = classes
        self.identify = identify  # None: no identity configured, everyone is anonymous
        self.anonymous = tenants.named(ANONYMOUS)
        self.everyone = self.anonymous.caller()
        self._admitted: dict[tuple[str, int], object] = {}  # (tenant, class) -> its counter

    async def enter(self, request: web.Request) -> Entry | web.Response:
        """The request's entry (kept in it under ``ENTRY``), or the answer refusing it."""
        if self.identify is None:
            tenant, access = self.anonymous, self.anonymous.access
        else:
            identified = await self.identify(request)
            if isinstance(identified, web.Response):
                return identified
            tenant, access = self.tenants.named(identified.tenant), identified.access
        if tenant is self.anonymous and not tenant.set_class:
            caller = self.everyone  # nothing configured: the one caller, made once
        else:
            asked = self.asked(request, tenant)
            if isinstance(asked, web.Response):
                return asked
            caller = tenant.caller(asked)
            if caller.access != access:  # a JWT's role claim decides, not the tenant's entry
                caller = Caller(caller.tenant, access, caller.priority, caller.weight)
        refusal = self.limiter.enter(tenant)
        if refusal is not None:
            self.metrics.limited.labels(self.label(tenant), refusal.limit).inc()
            return refusal.answer()
        entry = request[ENTRY] = Entry(caller, tenant, self.limiter, self.label(tenant))
        self.count(caller)
        return entry

    def leave(self, entry: Entry) -> None:
        self.limiter.leave(entry.tenant)

    def asked(self, request: web.Request, tenant: Tenant) -> int | web.Response | None:
        """The class the request asks for in ``X-Priority``: None when it names none or
        its tenant may not choose (its tenant's class stands); a 400 for no such class."""
        if not tenant.set_class:
            return None
        name = request.headers.get(PRIORITY_HEADER)
        if name is None:
            return None
        if name not in self.classes:
            known = ", ".join(self.classes)
            return error(400, f"{PRIORITY_HEADER} {name!r} is not a class; use one of {known}")
        return self.classes.index(name)

    def queued(self, caller: Caller, seconds: float) -> None:
        """A held request got its running slot after ``seconds`` (the dispatcher says)."""
        labels = (self.label(self.tenants.named(caller.tenant)), self.classes[caller.priority])
        self.metrics.queued.labels(*labels).observe(seconds)

    def shed(self, caller: Caller, why: str) -> None:
        """A held request, or one that would have been, was answered 503 (``why``)."""
        labels = (self.label(self.tenants.named(caller.tenant)), self.classes[caller.priority])
        self.metrics.shed.labels(*labels, why).inc()

    def label(self, tenant: Tenant) -> str:
        """A tenant's name in the metrics: a listed one's, else "default" (a JWT's tenants
        are many: one series each would grow without bound)."""
        return tenant.name if tenant.name in self.tenants.listed else "default"

    def count(self, caller: Caller) -> None:
        key = (caller.tenant, caller.priority)
        child = self._admitted.get(key)
        if child is None:
            tenant = self.tenants.named(caller.tenant)
            labels = (self.label(tenant), self.classes[caller.priority])
            child = self._admitted[key] = self.metrics.admitted.labels(*labels)
            if len(self._admitted) > 10_000:
                self._admitted.clear()
        child.inc()  # type: ignore[attr-defined]


PRIORITY_HEADER = "X-Priority"
