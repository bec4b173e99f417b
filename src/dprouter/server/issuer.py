"""An issuer's JWTs (``--jwt-issuer``): verified with PyJWT against the issuer's public
keys, which are fetched here with aiohttp, cached, and fetched again for a key id not yet
known -- at most once every ``REFETCH`` seconds, so that forged key ids cannot flood the
issuer. A verified token's caller is kept by the token's SHA-256 digest until the token
expires, or ``LIFESPAN`` seconds at most (as long as the keys are): its signature
(~140 us with RS256, ~260 with ES256 on one core: as much again as the rest of a
request) is checked once, not on every request of a client reusing it.

Imported only when an issuer is configured (``identity.py``): PyJWT brings in
``cryptography``, about 10 MB of memory in every serving process.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import jwt

from dprouter.config import RouterConfig
from dprouter.core.tenants import Tenants
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


@dataclass(frozen=True, slots=True)
class Rejected:
    """Why a token is refused, in words that never quote it; ``unreachable``: the issuer's
    keys could not be fetched (a 503, not a 401)."""

    message: str
    unreachable: bool = False


class Issuer:
    """The issuer's keys, and the tokens verified against them lately."""

    def __init__(self, config: RouterConfig, tenants: Tenants) -> None:
        assert config.jwt_issuer is not None
        self.config = config
        self.tenants = tenants
        self.jwks = Jwks(config.jwt_issuer, config.jwt_jwks)
        self.verified_tokens: dict[bytes, tuple[Caller, float]] = {}  # digest -> caller, until

    async def close(self) -> None:
        await self.jwks.close()

    async def caller(self, token: str) -> Caller | Rejected:
        """``token``'s caller: kept since it was verified, or verified now."""
        digest = hashlib.sha256(token.encode()).digest()
        now = time.time()
        kept = self.verified_tokens.get(digest)
        if kept is not None:
            if now < kept[1]:
                return kept[0]
            del self.verified_tokens[digest]
        found = await self.verify(token)
        if isinstance(found, Rejected):
            return found
        caller, expires = found
        verified = self.verified_tokens
        if len(verified) >= VERIFIED:
            del verified[next(iter(verified))]
        verified[digest] = (caller, min(expires, now + LIFESPAN))
        return caller

    async def verify(self, token: str) -> tuple[Caller, float] | Rejected:
        """``token``'s caller and when it expires (the epoch), checked against the issuer's
        keys, or why it is refused."""
        config = self.config
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            found = await self.jwks.key(kid if isinstance(kid, str) else "")
            if found is None:
                return Rejected(f"the issuer has no key {kid!r}")
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
            return Rejected(str(exc), unreachable=True)
        except jwt.PyJWTError as exc:
            return Rejected(f"invalid token: {why(exc)}")
        name = claims.get(config.jwt_tenant_claim)
        if not isinstance(name, str) or not name:
            return Rejected(f"the token names no tenant (claim {config.jwt_tenant_claim})")
        role = claims.get(config.jwt_role_claim)
        admin = role == "admin" or (isinstance(role, list) and "admin" in role)
        tenant = self.tenants.named(name)
        caller = Caller(tenant.name, "admin" if admin else "user", tenant.priority, tenant.weight)
        return caller, float(claims["exp"])


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
