"""Where the Kubernetes API server is and how to prove who we are to it.

In a pod: the service account's files (token, CA, namespace) and
``KUBERNETES_SERVICE_HOST``/``PORT``. Outside: a kubeconfig file's current
context -- its cluster's server and CA (file or data), its user's token (or
token file) or client certificate and key (file or data). Both read once at
start-up, so a bad file fails loudly there; only the token is read again,
because projected service-account tokens rotate (about hourly).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dprouter.core.errors import ConfigError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_EVERY = 60.0  # seconds a token read from a file is used before it is read again


class Token:
    """A bearer token, given or read from a file (and read again every ``every`` seconds,
    or at once after ``expire`` -- the server answered 401)."""

    def __init__(
        self, value: str | None = None, path: Path | None = None, every: float = TOKEN_EVERY
    ) -> None:
        self.value, self.path, self.every = value, path, every
        self._read_at = float("-inf")

    def get(self) -> str:
        if self.path is not None and time.monotonic() - self._read_at >= self.every:
            try:
                self.value = self.path.read_text().strip()
            except OSError as exc:
                if self.value is None:
                    raise ConfigError(f"cannot read the token {self.path}: {exc}") from None
            self._read_at = time.monotonic()
        return self.value or ""

    def expire(self) -> None:
        self._read_at = float("-inf")


@dataclass
class Access:
    server: str  # https://HOST:PORT
    ssl: ssl.SSLContext | None  # None: plain http (a local proxy, a test)
    token: Token | None
    namespace: str  # where pods are looked for unless --namespace says


def in_cluster(
    directory: Path = SERVICE_ACCOUNT, environ: Mapping[str, str] = os.environ
) -> Access:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError("not in a pod: KUBERNETES_SERVICE_HOST/PORT are not set")
    host = f"[{host}]" if ":" in host else host
    try:
        namespace = (directory / "namespace").read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the pod's namespace: {exc}") from None
    token = Token(path=directory / "token")
    token.get()  # fails now if it cannot be read
    context = tls(ca_file=directory / "ca.crt")
    return Access(f"https://{host}:{port}", context, token, namespace)


def kubeconfig_path(given: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """``--kubeconfig``, else the first file of ``$KUBECONFIG``, else ``~/.kube/config``."""
    if given:
        return Path(given).expanduser()
    listed = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        return Path(listed[0]).expanduser()
    return Path(environ.get("HOME", "~")).expanduser() / ".kube" / "config"


def named(entries: Any, name: str, kind: str, path: Path) -> dict[str, Any]:
    for entry in entries or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            found = entry.get(kind)
            return found if isinstance(found, dict) else {}
    raise ConfigError(f"{path}: no {kind} named {name!r}")


def from_kubeconfig(path: Path) -> Access:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the kubeconfig {path}: {exc}") from None
    if not isinstance(doc, dict) or not doc.get("current-context"):
        raise ConfigError(f"{path}: no current-context")
    context = named(doc.get("contexts"), doc["current-context"], "context", path)
    cluster = named(doc.get("clusters"), context.get("cluster", ""), "cluster", path)
    user = named(doc.get("users"), context["user"], "user", path) if context.get("user") else {}
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ConfigError(f"{path}: the cluster's server must be an http(s) URL, got {server!r}")
    for unsupported in ("exec", "auth-provider", "username"):
        if user.get(unsupported):
            raise ConfigError(
                f"{path}: the user authenticates by {unsupported}, which dprouter does not run; "
                "give it a token (or token file) or a client certificate"
            )

    def file(key: str) -> Path | None:  # relative paths are relative to the kubeconfig
        value = cluster.get(key) if key.startswith("certificate-authority") else user.get(key)
        return (path.parent / value) if value else None

    def data(source: dict[str, Any], key: str) -> bytes | None:
        value = source.get(key)
        return base64.b64decode(value) if value else None

    context_ssl = None
    if server.startswith("https://"):
        context_ssl = tls(
            ca_file=file("certificate-authority"),
            ca_data=data(cluster, "certificate-authority-data"),
            cert_file=file("client-certificate"),
            cert_data=data(user, "client-certificate-data"),
            key_file=file("client-key"),
            key_data=data(user, "client-key-data"),
            verify=not cluster.get("insecure-skip-tls-verify", False),
        )
    token = None
    if user.get("token"):
        token = Token(value=str(user["token"]))
    elif user.get("tokenFile"):
        token = Token(path=path.parent / user["tokenFile"])
        token.get()
    return Access(server, context_ssl, token, str(context.get("namespace") or "default"))


def tls(
    ca_file: Path | None = None,
    ca_data: bytes | None = None,
    cert_file: Path | None = None,
    cert_data: bytes | None = None,
    key_file: Path | None = None,
    key_data: bytes | None = None,
    verify: bool = True,
) -> ssl.SSLContext:
    """A client TLS context: the cluster's CA (the system's if none is given), and a client
    certificate if there is one. ``ssl`` loads certificates only from files: data is written
    to a private temporary directory for the moment it takes."""
    try:
        context = ssl.create_default_context(
            cafile=str(ca_file) if ca_file else None,
            cadata=ca_data.decode() if ca_data else None,
        )
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if (cert_file or cert_data) and (key_file or key_data):
            with tempfile.TemporaryDirectory() as scratch:
                cert = cert_file or _written(Path(scratch) / "cert.pem", cert_data)
                key = key_file or _written(Path(scratch) / "key.pem", key_data)
                context.load_cert_chain(cert, key)
        elif cert_file or cert_data or key_file or key_data:
            raise ConfigError("a client certificate needs its key, and a key its certificate")
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"cannot load the Kubernetes TLS files: {exc}") from None
    return context


def _written(path: Path, data: bytes | None) -> Path:
    path.touch(mode=0o600)
    path.write_bytes(data or b"")
    return path


def access(
    kubeconfig: str | None,
    directory: Path = SERVICE_ACCOUNT,
    environ: Mapping[str, str] = os.environ,
) -> Access:
    """In a pod (and no ``--kubeconfig``): the service account; otherwise a kubeconfig."""
    if kubeconfig is None and environ.get("KUBERNETES_SERVICE_HOST") and directory.is_dir():
        return in_cluster(directory, environ)
    return from_kubeconfig(kubeconfig_path(kubeconfig, environ))
