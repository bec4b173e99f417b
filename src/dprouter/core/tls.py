"""TLS and the engines' keys: the router's own certificate, served and reloaded in
place, and what every call it makes to an engine carries (``EngineAccess``).

A reload loads the new pair into the *same* ``SSLContext``: handshakes from then on
show the new certificate, while a connection already open keeps the session it
negotiated. OpenSSL replaces the certificate before it reads the key, so a key that
fails to load would leave the context with a certificate and no key; the pair is
therefore tried on a scratch context first, and the live one is touched only once it
loads there.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import hdrs

from dprouter.core.errors import ConfigError

log = logging.getLogger("dprouter.tls")
MINIMUM = ssl.TLSVersion.TLSv1_2
# an engine's origin (``https://host:port``) -> the key to send it, None: send none
KeyOf = Callable[[str], str | None]


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A context serving ``cert`` (its chain, PEM) with ``key``; with ``client_ca``,
    a client must show a certificate that CA signed (mTLS). ``ConfigError`` if a file
    does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM
    _load(context, cert, key, "--tls-cert/--tls-key")
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--tls-client-ca: cannot load {client_ca}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def reload(context: ssl.SSLContext, cert: str, key: str) -> bool:
    """Load ``cert`` and ``key`` again into ``context`` (SIGHUP). False, logged, when
    they do not load: the context keeps the pair it had."""
    try:
        _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert, key, "the new certificate")
        _load(context, cert, key, "the new certificate")
    except ConfigError as exc:
        log.error("TLS reload failed, the certificate in use stays: %s", exc)
        return False
    log.info("TLS certificate reloaded from %s", cert)
    return True


def _load(context: ssl.SSLContext, cert: str, key: str, what: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        # the paths are named, never what the files hold
        raise ConfigError(f"{what}: cannot load {cert} with {key}: {exc}") from None


def client_context(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext | None:
    """The context for ``https://`` engines: their certificates checked against ``ca``
    (host names too), and ``cert``/``key`` shown to those that ask for one. None when
    neither is given: aiohttp's own default (the system's CAs)."""
    if ca is None and cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--engine-ca: cannot load {ca}: {exc}") from None
    context.minimum_version = MINIMUM
    if cert is not None and key is not None:
        _load(context, cert, key, "--engine-cert/--engine-key")
    return context


def https(url: str, secure: bool) -> str:
    """``url`` (``http://...``) with the scheme a TLS listener answers on."""
    return "https://" + url.removeprefix("http://") if secure else url


@dataclass(frozen=True)
class EngineAccess:
    """What every call to an engine carries: the TLS context for ``https://`` workers
    (None: the system's CAs) and the key sent as ``Authorization: Bearer`` to a worker
    that has none of its own (the engines' ``--api-key``). Made once per router, from
    its configuration; the default reaches plain engines with no key."""

    tls: ssl.SSLContext | None = None
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)  # SGLang's --admin-api-key

    @classmethod
    def load(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> EngineAccess:
        return cls(client_context(ca, cert, key), api_key or None, admin_key or None)

    @property
    def connector_ssl(self) -> ssl.SSLContext | bool:
        """What a connector's ``ssl`` takes: the context, or True (verify, by default)."""
        return True if self.tls is None else self.tls

    def authorization(self, own: str | None) -> str | None:
        """The ``Authorization`` value for a worker whose own key is ``own``."""
        key = own or self.api_key
        return None if key is None else f"Bearer {key}"

    def admin_authorization(self, own_admin: str | None, own: str | None) -> str | None:
        """The ``Authorization`` value for an SGLang admin endpoint (its engine commands,
        ``/abort_request``) of a worker whose own keys are ``own_admin`` and ``own``: the
        admin key where one is given (SGLang's admin endpoints then take no other, and
        its others not that one), else the API key."""
        key = own_admin or self.admin_key
        return f"Bearer {key}" if key is not None else self.authorization(own)

    def session(self, key_of: KeyOf, **options: Any) -> aiohttp.ClientSession:
        """A client session to engines: the TLS context on its connector, and each request
        given the key ``key_of`` names for the origin it goes to. Probes, scrapes, commands
        and lookups then need not each remember the key; a redirect to an origin that is
        no worker's gets none. A request that names its own (an admin endpoint's) keeps
        it."""

        async def keyed(
            request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
        ) -> aiohttp.ClientResponse:
            value = key_of(str(request.url.origin()))
            if value is not None and hdrs.AUTHORIZATION not in request.headers:
                request.headers[hdrs.AUTHORIZATION] = f"Bearer {value}"
            return await handler(request)

        connector = aiohttp.TCPConnector(ssl=self.connector_ssl)
        return aiohttp.ClientSession(connector=connector, middlewares=(keyed,), **options)
