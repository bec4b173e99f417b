"""A worker as configured: ``WorkerSpec``, read from ``--worker URL,key=value``, a
config file's ``[[workers]]``, the admin API, etcd or a pod's annotations, and checked
the same way wherever it comes from."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from yarl import URL

from dprouter.core.errors import ConfigError
from dprouter.core.tls import EngineAccess, KeyOf
from dprouter.core.types import ROLES, DialectName, Role

if TYPE_CHECKING:
    from dprouter.fleet.targets import Worker


def normalise_url(raw: str) -> str:
    """``http://host:port``; IPv6 hosts stay bracketed. Without a scheme, ``host:port``
    (MoRIIO's registrations say so) and the port is required: a bare word (``notaurl``)
    is a mistake, not port 80. A path is refused: the router appends the client's own
    path (``/v1/completions``, ...) to the worker's URL."""
    schemeless = "://" not in raw
    try:
        url = URL(f"http://{raw}" if schemeless else raw)
        port = url.explicit_port
    except ValueError:  # a port out of range or not a number
        raise ValueError(f"worker URL {raw!r} must be http(s)://host:port") from None
    if url.scheme not in ("http", "https") or not url.host or (schemeless and port is None):
        raise ValueError(f"worker URL {raw!r} must be http(s)://host:port")
    if url.user or url.password or url.query_string or url.fragment:
        raise ValueError(f"worker URL {raw!r} must not carry credentials, a query or a fragment")
    if url.path.strip("/"):
        raise ValueError(
            f"worker URL {raw!r} has a path ({url.path}): give the engine's root, "
            f"{url.origin()}; the router adds /v1/... itself"
        )
    return str(url.origin())


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    id: str | None = None
    role: Role = "regular"
    dialect: DialectName | None = None
    dp_size: int | None = None
    rank_offset: int | None = None
    model: str | None = None
    bootstrap_port: int | None = None  # P/D prefill; None: SGLang's /server_info, vLLM's 8998
    tp_size: int | None = None  # P/D peers are told it (MoRIIO); None: as discovered, else 1
    # KV-cache events: tcp://HOST:PORT, rank r publishing on PORT + r (the engines' layout;
    # HOST * is the worker's host), or auto (vLLM's GET /kv_event_sources, SGLang's
    # /server_info say); a replay socket likewise (docs/kv-events.md)
    kv_events: str | None = None
    kv_replay: str | None = None
    # the engine's KV block size in tokens (vLLM --block-size, SGLang --page-size): known
    # before the first event, so the blocks a router sends count as pending from the start
    kv_block_size: int | None = None
    # the engine's --api-key, sent as Authorization: Bearer (wins over --engine-api-key),
    # or the environment variable holding it (read once, when the worker is checked);
    # never shown: not in repr, logs or error messages
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    # SGLang's --admin-api-key, for its admin endpoints (engine commands, aborts), which
    # then take no other key (wins over --engine-admin-key); likewise never shown
    admin_key: str | None = field(default=None, repr=False)
    admin_key_env: str | None = None


# fields whose values are secrets: an error names them, never what they hold
SECRET_SUFFIXES = ("api_key", "admin_key", "token")

SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def check_types(obj: object, where: str) -> None:
    """Every plain field holds its declared type: a file or an API call can say anything."""
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        names = [part.strip() for part in str(f.type).split("|")]
        if value is None and "None" in names:
            continue
        kinds = [n for n in names if n != "None"]
        if not all(k in SIMPLE_TYPES for k in kinds):
            continue  # not a plain field: checked by name in validate()
        wanted = tuple(t for k in kinds for t in SIMPLE_TYPES[k])
        bool_slipped = isinstance(value, bool) and bool not in wanted  # True is an int too
        if bool_slipped or not isinstance(value, wanted):
            secret = f.name.endswith(SECRET_SUFFIXES)
            shown = f"a {type(value).__name__}" if secret else repr(value)
            raise ConfigError(f"{where}{f.name} must be {' or '.join(kinds)}, got {shown}")


def check_worker(spec: WorkerSpec) -> WorkerSpec:
    if not isinstance(spec.url, str):
        raise ConfigError(f"worker url must be a string, got {spec.url!r}")
    try:
        url = normalise_url(spec.url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_types(spec, f"worker {url}: ")
    if spec.role not in ROLES:
        raise ConfigError(f"worker {url}: role must be one of {', '.join(ROLES)}")
    if spec.dialect not in (None, "vllm", "sglang"):
        raise ConfigError(f"worker {url}: dialect must be auto, vllm or sglang")
    if spec.dp_size is not None and spec.dp_size < 1:
        raise ConfigError(f"worker {url}: dp_size must be at least 1")
    if spec.rank_offset is not None and spec.rank_offset < 0:
        raise ConfigError(f"worker {url}: rank_offset must be at least 0")
    check_kv_events(spec, url)
    spec = check_key(spec, url, "api_key")
    return replace(check_key(spec, url, "admin_key"), url=url)


def check_key(spec: WorkerSpec, url: str, name: str) -> WorkerSpec:
    """``{name}_env`` read into ``name`` (once: the spec then holds the key alone, so
    checking it again finds nothing to read); a missing variable fails here, loudly."""
    key, env = getattr(spec, name), getattr(spec, f"{name}_env")
    if key == "":
        raise ConfigError(f"worker {url}: {name} is empty")
    if env is None:
        return spec
    if key is not None:
        raise ConfigError(f"worker {url}: give {name} or {name}_env, not both")
    value = os.environ.get(env)
    if not value:
        raise ConfigError(f"worker {url}: {name}_env names {env}, which is not set (or empty)")
    found: dict[str, Any] = {name: value, f"{name}_env": None}
    return replace(spec, **found)


def own_key(worker: Worker) -> str | None:
    """``worker``'s own key, if it has one (``Worker.api_key``, from its spec)."""
    return worker.api_key


def keys(workers: Callable[[], Iterable[Worker]], access: EngineAccess) -> KeyOf:
    """The key each worker's origin gets: its own, else the router's; None for an
    origin that is no worker's (a redirect elsewhere takes no key with it)."""

    def key_of(origin: str) -> str | None:
        for worker in workers():
            if worker.url == origin:
                return own_key(worker) or access.api_key
        return None

    return key_of


def check_kv_events(spec: WorkerSpec, url: str) -> None:
    """What cannot work is refused here, at start-up (or when the worker is added),
    not warned about forever by the subscribers."""
    ports = {name: kv_port(spec, name, url) for name in ("kv_events", "kv_replay")}
    if spec.kv_replay is not None and spec.kv_events is None:
        raise ConfigError(f"worker {url}: kv_replay needs kv_events")
    if spec.kv_replay is not None and spec.kv_events == "auto":
        raise ConfigError(
            f"worker {url}: kv_replay with kv_events=auto: the engine names its replay "
            "socket itself; give both as tcp://HOST:PORT, or auto alone"
        )
    if spec.kv_block_size is not None and spec.kv_block_size < 1:
        raise ConfigError(f"worker {url}: kv_block_size must be at least 1")
    if spec.kv_block_size is not None and spec.kv_events is None:
        raise ConfigError(f"worker {url}: kv_block_size sizes KV-event ranks: it needs kv_events")
    last = (spec.rank_offset or 0) + (spec.dp_size or 1) - 1  # the last rank, the engine's
    for name, port in ports.items():
        if port is not None and port + last > 65535:
            raise ConfigError(
                f"worker {url}: {name} port {port} + rank {last} is past 65535 "
                "(rank r publishes on port + r)"
            )
    events, replay = ports["kv_events"], ports["kv_replay"]
    if events is not None and replay is not None:
        width = spec.dp_size or 1
        same_host = urlsplit(str(spec.kv_events)).hostname == urlsplit(str(spec.kv_replay)).hostname
        if same_host and abs(events - replay) < width:
            raise ConfigError(
                f"worker {url}: kv_events and kv_replay ports overlap over {width} ranks "
                f"(rank r uses port + r of each): {events} and {replay}"
            )


def kv_port(spec: WorkerSpec, name: str, url: str) -> int | None:
    """The port of ``tcp://HOST:PORT`` (None: not given, or auto); anything else fails."""
    value: str | None = getattr(spec, name)
    if value is None or (value == "auto" and name == "kv_events"):
        return None
    where = urlsplit(value)
    try:
        port = where.port
    except ValueError:
        port = None
    if (
        where.scheme != "tcp"
        or not where.hostname
        or not port  # 0 is where an engine binds a free port, never where it is found
        or where.path
        or where.query
        or where.fragment
        or where.username
    ):
        raise ConfigError(
            f"worker {url}: {name} must be tcp://HOST:PORT"
            + (" or auto" if name == "kv_events" else "")
            + f", got {value!r}"
        )
    return port


# the SGLang gateway's names for the same keys (RL frameworks register workers so)
ALIASES = {"worker_type": "role", "model_id": "model"}


def worker_from_mapping(raw: dict[str, Any]) -> WorkerSpec:
    for alias, name in ALIASES.items():
        if alias in raw:
            if name in raw and raw[name] != raw[alias]:
                raise ConfigError(f"{alias} and {name} name the same thing: give one")
            raw = {**{k: v for k, v in raw.items() if k != alias}, name: raw[alias]}
    known = {f for f in WorkerSpec.__dataclass_fields__}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown worker keys {sorted(unknown)}; known: {sorted(known)}")
    if "url" not in raw:
        raise ConfigError("every worker needs a url")
    if raw.get("dialect") == "auto":
        raw = {**raw, "dialect": None}
    return WorkerSpec(**raw)


INT_KEYS = ("dp_size", "rank_offset", "bootstrap_port", "tp_size", "kv_block_size")


def parse_worker(text: str, role: str = "regular") -> WorkerSpec:
    """``URL[,key=value...]``, e.g. ``http://[::1]:8000,dialect=vllm,dp_size=8``."""
    url, *pairs = text.split(",")
    raw: dict[str, Any] = {"url": url, "role": role}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--worker {text!r}: expected key=value after the URL, got {pair!r}")
        key = key.strip().replace("-", "_")
        try:
            raw[key] = int(value) if key in INT_KEYS else value
        except ValueError:
            raise ConfigError(f"--worker {text!r}: {key} must be an integer") from None
    return worker_from_mapping(raw)
