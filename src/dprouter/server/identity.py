"""Who is calling: a request's ``Authorization: Bearer`` read as an API key of a tenant
(``--tenants``) or a JWT of the issuer (``--jwt-issuer``), and the admin check of the
control plane (the admin API, the engine commands, the dashboard).

With nothing configured no credential is read: everyone is the ``anonymous`` tenant
(the door does not even call ``identify``), and the router says so once at start-up.
A key is looked up by its SHA-256 digest (``core/tenants.py`` says why that is safe
against timing); a JWT is the issuer's to verify (``issuer.py``, imported only when
one is configured). No credential is ever logged, counted or echoed: only tenant names
are.
"""

from __future__ import annotations

import base64
import hmac
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.errors import error
from dprouter.core.tenants import ANONYMOUS, Tenants
from dprouter.core.types import Caller
from dprouter.server.trust import Trust

if TYPE_CHECKING:
    from dprouter.server.issuer import Issuer

log = logging.getLogger("dprouter.identity")

CHALLENGE = 'Bearer realm="dprouter"'
INVALID = 'Bearer realm="dprouter", error="invalid_token"'


class Identity:
    """The credentials a router takes: its tenants' keys, an issuer's JWTs, the admin
    token; made once from the configuration (``build_app``, the control plane)."""

    def __init__(self, config: RouterConfig, tenants: Tenants, warn: bool = True) -> None:
        self.config = config
        self.tenants = tenants
        self.issuer: Issuer | None = None
        if config.jwt_issuer:
            from dprouter.server.issuer import Issuer  # PyJWT: only where tokens are taken

            self.issuer = Issuer(config, tenants)
        self.configured = tenants.keyed or self.issuer is not None  # the data plane is closed
        self.everyone = tenants.named(ANONYMOUS).caller()
        self.warn = warn  # say at start-up what is open (one process of --processes says)
        # an admin credential exists: the control plane takes no caller by address alone
        self.admins = (
            config.admin_token is not None
            or self.issuer is not None
            or any(t.access == "admin" for t in tenants.listed.values())
        )
        self.trust = Trust(config.admin_from)  # who is taken by address when none exists

    @classmethod
    def of(cls, config: RouterConfig, warn: bool = True) -> Identity:
        tenants = Tenants.load(config.tenants, config.classes) if config.tenants else Tenants()
        return cls(config, tenants, warn)

    def start(self) -> None:
        if self.warn and not self.configured:
            log.warning(OPEN)

    async def stop(self) -> None:
        if self.issuer is not None:
            await self.issuer.close()

    async def lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        self.start()
        try:
            yield
        finally:
            await self.stop()

    async def identify(self, request: web.Request) -> Caller | web.Response:
        """The caller of a data-plane request, or the answer refusing it."""
        if not self.configured:
            return self.everyone
        token = bearer_token(request.headers.get("Authorization", ""))
        if token is None:
            return refused(
                "this router needs a credential: Authorization: Bearer <API key or token>",
                CHALLENGE,
            )
        return await self.caller(token)

    async def caller(self, token: str) -> Caller | web.Response:
        """Whose ``token`` is: a tenant's API key, else an issuer's JWT."""
        tenant = self.tenants.by_key(token)
        if tenant is not None:
            return tenant.caller()
        if self.issuer is None or token.count(".") != 2:
            return refused("unknown API key", INVALID)
        found = await self.issuer.caller(token)
        if isinstance(found, Caller):
            return found
        if found.unreachable:
            return error(503, f"{found.message}; retry", headers={"Retry-After": "5"})
        return refused(found.message, INVALID)

    async def admin(
        self, request: web.Request, relayed: bool = False, basic: bool = False
    ) -> web.Response | None:
        """The answer to a control-plane call its caller may not make; None: it may go on.
        An admin's credential (the admin token, an admin key, an admin JWT) passes, a
        user's is a 403; with no admin credential configured at all, callers from
        loopback, this host's own addresses and ``--admin-from`` pass (``Trust``;
        ``relayed``: a serving process of ``--processes N`` checked the address).
        ``basic``: the password of Basic auth counts too (the dashboard: how a browser
        logs in)."""
        header = request.headers.get("Authorization", "")
        token = bearer_token(header) or (basic_password(header) if basic else None)
        if token is not None:
            admin_token = self.config.admin_token
            if admin_token is not None and hmac.compare_digest(
                token.encode(), admin_token.encode()
            ):
                return None
            if self.configured:
                found = await self.caller(token)
                if isinstance(found, web.Response):
                    return found
                if found.access == "admin":
                    return None
                return error(
                    403,
                    f"tenant {found.tenant} has the user role: the admin API, engine commands "
                    "and the dashboard need an admin",
                )
        if self.admins:
            return refused(
                "admin calls need Authorization: Bearer <admin token, admin API key or JWT>",
                CHALLENGE,
            )
        if relayed or self.trust.trusts(request.remote):
            return None
        return error(403, self.trust.refusal(request.remote))

    def open_admin(self) -> bool:
        """The control plane takes callers by their address (no admin credential exists)."""
        return not self.admins


OPEN = (
    "no --tenants keys and no --jwt-issuer: the data plane (completions, chat, every "
    "routed endpoint) answers anyone who reaches the port, as the tenant anonymous; "
    "give --tenants with keys or --jwt-issuer to require a credential (docs/security.md)"
)


def refused(message: str, challenge: str) -> web.Response:
    return error(401, message, headers={"WWW-Authenticate": challenge})


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def basic_password(header: str) -> str | None:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return password or None
