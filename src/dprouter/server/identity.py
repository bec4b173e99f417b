"""Who is calling: a request's ``Authorization: Bearer`` read as an API key of a tenant
(``--tenants``) or a JWT of the issuer (``--jwt-issuer``), and the admin check of the
control plane (the admin API, the engine commands, the dashboard).

With nothing configured no credential is read: everyone is the ``anonymous`` tenant
(the door does not even call ``identify``), and the router says so once at start-up.
A key is looked up by its SHA-256 digest (``core/tenants.py`` says why that is safe
against timing); a JWT is verified with PyJWT against the issuer's public keys, which
are fetched here with aiohttp, cached, and fetched again for a key id not yet known --
at most once every ``REFETCH`` seconds, so that forged key ids cannot flood the
issuer. A verified token's caller is kept by the token's SHA-256 digest until the token
expires, or ``LIFESPAN`` seconds at most (as long as the keys are): its signature
(~140 us with RS256, ~260 with ES256 on one core: as much again as the rest of a
request) is checked once, not on every request of a client reusing it. No credential is
ever logged, counted or echoed: only tenant names are.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import jwt
from aiohttp import web

from dprouter.config import RouterConfig, admin_networks
from dprouter.core.errors import error
from dprouter.core.tenants import ANONYMOUS, Tenants
from dprouter.core.types import Caller

log = logging.getLogger("dprouter.identity")

REFETCH = 1.0  # seconds between two fetches of the issuer's keys for unknown key ids
LIFESPAN = 300.0  # the issuer's keys are fetched again when a token comes after this long
LEEWAY = 30.0  # seconds of clock skew allowed on exp and nbf
FETCH_TIMEOUT = 5.0
VERIFIED = 65_536  # verified tokens kept at most (the oldest goes first)
# the algorithms a public key of each type may verify (a JWK without "alg"); never none,
# never an HMAC: a public key is not a shared secret
ASYMMETRIC = {
    "RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    "EC": ("ES256", "ES384", "ES512", "ES256K"),
    "OKP": ("EdDSA",),
}
CHALLENGE = 'Bearer realm="dprouter"'
INVALID = 'Bearer realm="dprouter", error="invalid_token"'


class Unreachable(Exception):
    """The issuer's keys could not be fetched (the message says why, with no token)."""


class Jwks:
    """The issuer's public keys by key id (``kid``; "" for a key without one)."""

    def __init__(self, issuer: str, url: str | None) -> None:
        self.issuer = issuer
        self.url = url  # None: the issuer's OpenID discovery document names it
        self.keys: dict[str, tuple[jwt.PyJWK, tuple[str, ...]]] = {}
        self._loaded = -LIFESPAN  # monotonic seconds of the last good fetch
        self._tried = -REFETCH  # ...and of the last attempt
        self._failure: str | None = None  # why the last attempt failed
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    async def key(self, kid: str) -> tuple[jwt.PyJWK, tuple[str, ...]] | None:
        """The key ``kid`` names and the algorithms it may verify; None: no such key.
        ``Unreachable`` when it is not known and the issuer could not be asked."""
        if self._due(kid):
            async with self._lock:  # a burst of tokens waits for one fetch
                if self._due(kid):
                    await self._refresh()
        found = self.keys.get(kid)
        if found is None and not kid and len(self.keys) == 1:
            found = next(iter(self.keys.values()))  # a token naming no key, an issuer with one
        if found is None and self._failure is not None:
            raise Unreachable(self._failure)
        return found

    def _due(self, kid: str) -> bool:
        now = time.monotonic()
        wanted = kid not in self.keys or now - self._loaded >= LIFESPAN
        return wanted and now - self._tried >= REFETCH

    async def _refresh(self) -> None:
        self._tried = time.monotonic()
        try:
            self.keys = await self._fetch()
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            self._failure = f"cannot fetch the issuer's keys: {exc or type(exc).__name__}"
            log.warning("%s (JWT issuer %s)", self._failure, self.issuer)
            return
        self._loaded, self._failure = time.monotonic(), None

    async def _fetch(self) -> dict[str, tuple[jwt.PyJWK, tuple[str, ...]]]:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
            self._session = aiohttp.ClientSession(timeout=timeout)
        if self.url is None:
            found = await self._get(self.issuer.rstrip("/") + "/.well-known/openid-configuration")
            if not isinstance(found.get("jwks_uri"), str):
                raise ValueError("the issuer's OpenID configuration names no jwks_uri")
            self.url = found["jwks_uri"]
        keys: dict[str, tuple[jwt.PyJWK, tuple[str, ...]]] = {}
        for data in (await self._get(self.url))["keys"]:
            try:
                key = public_key(data)
            except (jwt.PyJWTError, ValueError, TypeError, KeyError):
                key = None  # a key it cannot use: the others still serve
            if key is not None:
                keys[str(data.get("kid", ""))] = key
        return keys

    async def _get(self, url: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(url) as r:
            if r.status != 200:
                raise ValueError(f"{url} answered {r.status}")
            found = await r.json(content_type=None)
        if not isinstance(found, dict):
            raise ValueError(f"{url} did not answer a JSON object")
        return found

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def public_key(data: Any) -> tuple[jwt.PyJWK, tuple[str, ...]] | None:
    """A JWK of the set as a key and the algorithms it may verify; None: not a signing
    key this router takes (an encryption key, a shared secret, an algorithm not its
    type's)."""
    if not isinstance(data, dict) or data.get("use", "sig") != "sig":
        return None
    allowed = ASYMMETRIC.get(data.get("kty", ""), ())
    if "alg" in data:
        allowed = (data["alg"],) if data["alg"] in allowed else ()
    if not allowed:
        return None
    return jwt.PyJWK(data, data.get("alg")), allowed


class Identity:
    """The credentials a router takes: its tenants' keys, an issuer's JWTs, the admin
    token; made once from the configuration (``build_app``, the control plane)."""

    def __init__(self, config: RouterConfig, tenants: Tenants, warn: bool = True) -> None:
        self.config = config
        self.tenants = tenants
        self.jwks = Jwks(config.jwt_issuer, config.jwt_jwks) if config.jwt_issuer else None
        self.configured = tenants.keyed or self.jwks is not None  # the data plane is closed
        self.everyone = tenants.named(ANONYMOUS).caller()
        self.warn = warn  # say at start-up what is open (one process of --processes says)
        # an admin credential exists: the control plane takes no caller by address alone
        self.admins = (
            config.admin_token is not None
            or self.jwks is not None
            or any(t.access == "admin" for t in tenants.listed.values())
        )
        self.verified_tokens: dict[bytes, tuple[Caller, float]] = {}  # digest -> caller, until

    @classmethod
    def of(cls, config: RouterConfig, warn: bool = True) -> Identity:
        tenants = Tenants.load(config.tenants, config.classes) if config.tenants else Tenants()
        return cls(config, tenants, warn)

    def start(self) -> None:
        if self.warn and not self.configured:
            log.warning(OPEN)

    async def stop(self) -> None:
        if self.jwks is not None:
            await self.jwks.close()

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
        if self.jwks is not None and token.count(".") == 2:
            return await self.verified(token)
        return refused("unknown API key", INVALID)

    async def verified(self, token: str) -> Caller | web.Response:
        assert self.jwks is not None
        digest = hashlib.sha256(token.encode()).digest()
        now = time.time()
        kept = self.verified_tokens.get(digest)
        if kept is not None:
            if now < kept[1]:
                return kept[0]
            del self.verified_tokens[digest]
        found = await self.verify(token)
        if isinstance(found, tuple):
            caller, expires = found
            verified = self.verified_tokens
            if len(verified) >= VERIFIED:
                del verified[next(iter(verified))]
            verified[digest] = (caller, min(expires, now + LIFESPAN))
            return caller
        return found

    async def verify(self, token: str) -> tuple[Caller, float] | web.Response:
        """``token``'s caller and when it expires (the epoch), checked against the issuer's
        keys, or the answer refusing it."""
        assert self.jwks is not None
        config = self.config
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            found = await self.jwks.key(kid if isinstance(kid, str) else "")
            if found is None:
                return refused(f"the issuer has no key {kid!r}", INVALID)
            key, allowed = found
            claims = jwt.decode(
                token,
                key.key,
                algorithms=list(allowed),
                issuer=config.jwt_issuer,
                audience=config.jwt_audience,
                leeway=LEEWAY,
                options={"require": ["exp", "iss"], "verify_aud": config.jwt_audience is not None},
            )
        except Unreachable as exc:
            return error(503, f"{exc}; retry", headers={"Retry-After": "5"})
        except jwt.PyJWTError as exc:
            return refused(f"invalid token: {why(exc)}", INVALID)
        name = claims.get(config.jwt_tenant_claim)
        if not isinstance(name, str) or not name:
            return refused(f"the token names no tenant (claim {config.jwt_tenant_claim})", INVALID)
        role = claims.get(config.jwt_role_claim)
        admin = role == "admin" or (isinstance(role, list) and "admin" in role)
        tenant = self.tenants.named(name)
        caller = Caller(tenant.name, "admin" if admin else "user", tenant.priority, tenant.weight)
        return caller, float(claims["exp"])

    async def admin(
        self, request: web.Request, relayed: bool = False, basic: bool = False
    ) -> web.Response | None:
        """The answer to a control-plane call its caller may not make; None: it may go on.
        An admin's credential (the admin token, an admin key, an admin JWT) passes, a
        user's is a 403; with no admin credential configured at all, callers from
        loopback and ``--admin-from`` pass (``relayed``: a serving process of
        ``--processes N`` checked the address). ``basic``: the password of Basic auth
        counts too (the dashboard: how a browser logs in)."""
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
        if relayed or trusted(request.remote, self.config.admin_from):
            return None
        return error(
            403,
            f"without an admin token, admin calls are taken from loopback and --admin-from "
            f"networks only, not from {request.remote}: start the router with --admin-token, "
            "or name the caller's network in --admin-from",
        )

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


def why(exc: jwt.PyJWTError) -> str:
    """What is wrong with a token, in words that never quote it."""
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "it has expired"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "it is not valid yet"
    if isinstance(exc, jwt.InvalidIssuerError):
        return "its issuer is not this router's"
    if isinstance(exc, jwt.InvalidAudienceError):
        return "its audience is not this router's"
    if isinstance(exc, jwt.InvalidSignatureError):
        return "its signature does not verify"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"it has no {exc.claim} claim"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return "its algorithm is not the key's"
    return "it cannot be read"


def trusted(remote: str | None, admin_from: Sequence[str]) -> bool:
    """``remote`` is loopback or in one of the ``admin_from`` networks."""
    try:
        address = ipaddress.ip_address((remote or "").split("%")[0])
    except ValueError:
        return False  # no address: not a caller it can place
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # an IPv4 caller of a dual-stack socket
    if address.is_loopback:
        return True
    return any(address in network for network in admin_networks(admin_from))
