"""Tenants: who may call the router, in which priority class, within which limits.

Read once from ``--tenants`` (a YAML file, docs/security.md)::

    tenants:
      interactive:
        keys: [sk-...]          # API keys; or key_env: [VAR] (read from the environment),
                                # or key_sha256: [hex] (the file then holds no secret)
        access: user            # or admin: also the admin API, RL calls, the dashboard
        class: high             # one of --classes
        set_class: false        # may choose its class per request (X-Priority)
        weight: 1               # its share of its class while requests are held
        limits: {requests_per_second: 5, tokens_per_second: 20000, burst: 2, in_flight: 8}
    default: {class: low}       # any tenant not listed: a JWT's, or everyone without keys

Keys are kept only as SHA-256 digests, and a key is found by its digest. Comparing
digests, not keys, is what makes the lookup safe against timing: how long it takes
depends on the digest of what the caller sent, which tells them nothing about any
stored key (to learn one from timings they would have to invert SHA-256).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dprouter.core.errors import ConfigError
from dprouter.core.types import Access, Caller

ANONYMOUS = "anonymous"  # the tenant of every request when no identity is configured
UNLISTED = 10_000  # tenants not listed kept made at once (each is the default, renamed)


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; 0: none. Rates are token buckets holding ``burst`` seconds of
    their rate; tokens are a request's prompt + output budget."""

    requests_per_second: float = 0.0
    tokens_per_second: float = 0.0
    burst: float = 1.0
    in_flight: int = 0

    @property
    def any(self) -> bool:
        return bool(self.requests_per_second or self.tokens_per_second or self.in_flight)


@dataclass(frozen=True)
class Tenant:
    name: str
    access: Access = "user"
    priority: int = 0  # its class, an index into --classes (0: the highest)
    set_class: bool = False  # may name another class in X-Priority
    weight: float = 1.0
    limits: Limits = field(default_factory=Limits)

    def caller(self, priority: int | None = None) -> Caller:
        """This tenant as a request's caller, in ``priority`` when it may choose one."""
        chosen = self.priority if priority is None or not self.set_class else priority
        return Caller(self.name, self.access, chosen, self.weight)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The tenants listed, the default for the rest, and their keys (by digest)."""

    def __init__(
        self,
        listed: Mapping[str, Tenant] | None = None,
        default: Tenant | None = None,
        keys: Mapping[bytes, str] | None = None,
    ) -> None:
        self.listed = dict(listed or {})
        self.default = default or Tenant(ANONYMOUS)
        self._keys = dict(keys or {})  # digest -> tenant name
        self._unlisted: dict[str, Tenant] = {}  # the default, named: made once per name

    @property
    def keyed(self) -> bool:
        """Some tenant has a key: requests without one are refused."""
        return bool(self._keys)

    def named(self, name: str) -> Tenant:
        """The tenant ``name``: as listed, else as the default says."""
        tenant = self.listed.get(name) or self._unlisted.get(name)
        if tenant is None:
            if len(self._unlisted) >= UNLISTED:  # a JWT's tenants are many: keep the latest
                self._unlisted.clear()
            tenant = self._unlisted[name] = replace(self.default, name=name)
        return tenant

    def by_key(self, key: str) -> Tenant | None:
        """The tenant whose API key ``key`` is; None: no tenant's."""
        name = self._keys.get(digest(key))
        return None if name is None else self.listed[name]

    @classmethod
    def load(
        cls, path: str | Path, classes: Sequence[str], environ: Mapping[str, str] = os.environ
    ) -> Tenants:
        """The tenants of a ``--tenants`` file; ``ConfigError`` says what is wrong."""
        try:
            text = Path(path).read_text()
            data = yaml.safe_load(text) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read --tenants {path}: {exc}") from None
        if not isinstance(data, dict) or set(data) - {"tenants", "default"}:
            raise ConfigError(f"--tenants {path}: expected the keys tenants and default")
        default = parse_tenant(ANONYMOUS, data.get("default") or {}, classes, keys=False)
        listed: dict[str, Tenant] = {}
        keys: dict[bytes, str] = {}
        entries = data.get("tenants") or {}
        if not isinstance(entries, dict):
            raise ConfigError(f"--tenants {path}: tenants must map names to tenants")
        for name, entry in entries.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"--tenants {path}: a tenant's name must be text")
            base = {"class": classes[default.priority], **(entry or {})}
            listed[name] = parse_tenant(name, base, classes, keys=True)
            for d in tenant_keys(name, entry or {}, environ):
                if keys.setdefault(d, name) != name:
                    raise ConfigError(f"--tenants {path}: {name} and {keys[d]} share a key")
        return cls(listed, default, keys)


FIELDS = {"keys", "key_env", "key_sha256", "access", "class", "set_class", "weight", "limits"}
LIMITS = {"requests_per_second", "tokens_per_second", "burst", "in_flight"}


def parse_tenant(name: str, entry: Any, classes: Sequence[str], keys: bool) -> Tenant:
    where = f"tenant {name}" if keys else "the default tenant"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(entry) - (FIELDS if keys else FIELDS - {"keys", "key_env", "key_sha256"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    access = entry.get("access", "user")
    if access not in ("user", "admin"):
        raise ConfigError(f"{where}: access must be user or admin, got {access!r}")
    chosen = entry.get("class", classes[(len(classes) - 1) // 2])
    if chosen not in classes:
        raise ConfigError(f"{where}: class {chosen!r} is not one of --classes {list(classes)}")
    weight = number(entry.get("weight", 1.0))
    if weight is None or weight <= 0:
        raise ConfigError(f"{where}: weight must be a number > 0, got {entry['weight']!r}")
    set_class = entry.get("set_class", False)
    if not isinstance(set_class, bool):
        raise ConfigError(f"{where}: set_class must be true or false")
    return Tenant(
        name,
        access,
        classes.index(chosen),
        set_class,
        weight,
        parse_limits(where, entry.get("limits") or {}),
    )


def parse_limits(where: str, entry: Any) -> Limits:
    if not isinstance(entry, dict) or set(entry) - LIMITS:
        raise ConfigError(f"{where}: limits takes {', '.join(sorted(LIMITS))}")
    given: dict[str, float] = {}
    for name, value in entry.items():
        found = number(value)
        if found is None or found < 0:
            raise ConfigError(f"{where}: limits.{name} must be a number >= 0, got {value!r}")
        given[name] = found
    if given.get("in_flight", 0) != int(given.get("in_flight", 0)):
        raise ConfigError(f"{where}: limits.in_flight must be a whole number")
    if given.get("burst", 1) <= 0:
        raise ConfigError(f"{where}: limits.burst must be > 0 seconds")
    return Limits(
        given.get("requests_per_second", 0.0),
        given.get("tokens_per_second", 0.0),
        given.get("burst", 1.0),
        int(given.get("in_flight", 0)),
    )


def number(value: Any) -> float | None:
    """``value`` as a finite number, or None. Text that reads as one counts: YAML 1.1
    (PyYAML) reads ``1e7`` and ``1.0e7`` as strings, wanting ``1.0e+7``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def tenant_keys(name: str, entry: Mapping[str, Any], environ: Mapping[str, str]) -> list[bytes]:
    """The digests of a tenant's keys: given, from the environment, or as digests."""

    def texts(field_name: str) -> list[str]:
        value = entry.get(field_name, [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"tenant {name}: {field_name} must be a list of text")
        return value

    found = [digest(k) for k in texts("keys")]
    for var in texts("key_env"):
        key = environ.get(var)
        if not key:
            raise ConfigError(f"tenant {name}: the environment variable {var} holds no key")
        found.append(digest(key))
    for hexed in texts("key_sha256"):
        try:
            raw = bytes.fromhex(hexed)
        except ValueError:
            raw = b""
        if len(raw) != hashlib.sha256().digest_size:
            raise ConfigError(f"tenant {name}: key_sha256 {hexed[:8]}... is not a SHA-256 digest")
        found.append(raw)
    return found
