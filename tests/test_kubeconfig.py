"""Reaching the API server as a pod does and as a kubeconfig says: over real TLS.

A throwaway CA (made with the ``openssl`` command) signs the stand-in API
server's certificate (for 127.0.0.1) and a client certificate; the stand-in
serves HTTPS and, in the client-certificate tests, refuses a connection without
one. Every way of giving the CA, the token and the client certificate is read
into ``Access`` and used for a real list call.
"""

from __future__ import annotations

import base64
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from dprouter.core.errors import ConfigError, KubeError
from dprouter.fleet.membership.kube_client import Kube
from dprouter.fleet.membership.kubeconfig import (
    Access,
    access,
    from_kubeconfig,
    in_cluster,
    kubeconfig_path,
)
from tests.kube_apiserver import KubeApiServer, pod


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt, server.crt/key (IP 127.0.0.1), client.crt/key, other-ca.crt."""
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for leaf in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr",
                "-subj", f"/CN=dprouter-{leaf}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{leaf}.crt", "-days", "2",
                "-extfile", f"{leaf}.ext", cwd=d)  # fmt: skip
    return d


def server_tls(pki: Path, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED if client_cert else ssl.CERT_NONE
    return context


async def serve_tls(pki: Path, client_cert: bool, token: str | None) -> KubeApiServer:
    server = KubeApiServer(token=token, ssl=server_tls(pki, client_cert))
    await server.start()
    await server.put(pod("e0", namespace="llm"))
    return server


@pytest.fixture
async def tls_server(pki: Path) -> AsyncIterator[KubeApiServer]:
    server = await serve_tls(pki, client_cert=False, token="secret")
    yield server
    await server.stop()


@pytest.fixture
async def mtls_server(pki: Path) -> AsyncIterator[KubeApiServer]:
    server = await serve_tls(pki, client_cert=True, token=None)
    yield server
    await server.stop()


async def names(found: Access, namespace: str = "llm") -> list[str]:
    async with aiohttp.ClientSession() as session:
        pods, _ = await Kube(found, session).list_pods(namespace, "app=engine")
    return [p["metadata"]["name"] for p in pods]


def write_kubeconfig(
    path: Path, server: str, cluster: dict[str, Any], user: dict[str, Any]
) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "here",
        "contexts": [
            {"name": "elsewhere", "context": {"cluster": "nope", "user": "nope"}},
            {"name": "here", "context": {"cluster": "c", "user": "u", "namespace": "llm"}},
        ],
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


async def test_a_kubeconfig_with_ca_data_and_a_token(
    pki: Path, tls_server: KubeApiServer, tmp_path: Path
) -> None:
    cluster = {"certificate-authority-data": b64(pki / "ca.crt")}
    path = write_kubeconfig(tmp_path / "config", tls_server.url, cluster, {"token": "secret"})
    found = from_kubeconfig(path)
    assert (found.server, found.namespace) == (tls_server.url, "llm")
    assert await names(found) == ["e0"]
    wrong = write_kubeconfig(tmp_path / "wrong", tls_server.url, cluster, {"token": "nope"})
    with pytest.raises(KubeError, match="HTTP 401"):
        await names(from_kubeconfig(wrong))


async def test_a_kubeconfig_with_a_ca_file_relative_to_it_and_a_token_file(
    pki: Path, tls_server: KubeApiServer, tmp_path: Path
) -> None:
    (tmp_path / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    (tmp_path / "token").write_text("secret\n")
    cluster = {"certificate-authority": "ca.crt"}
    path = write_kubeconfig(tmp_path / "config", tls_server.url, cluster, {"tokenFile": "token"})
    assert await names(from_kubeconfig(path)) == ["e0"]


async def test_the_servers_certificate_must_chain_to_the_ca_given(
    pki: Path, tls_server: KubeApiServer, tmp_path: Path
) -> None:
    cluster = {"certificate-authority": str(pki / "other-ca.crt")}
    path = write_kubeconfig(tmp_path / "config", tls_server.url, cluster, {"token": "secret"})
    with pytest.raises(KubeError, match="CERTIFICATE_VERIFY_FAILED"):
        await names(from_kubeconfig(path))


@pytest.mark.parametrize("form", ["data", "file"])
async def test_a_kubeconfig_with_a_client_certificate(
    pki: Path, mtls_server: KubeApiServer, tmp_path: Path, form: str
) -> None:
    if form == "data":
        cluster = {"certificate-authority-data": b64(pki / "ca.crt")}
        user = {
            "client-certificate-data": b64(pki / "client.crt"),
            "client-key-data": b64(pki / "client.key"),
        }
    else:
        cluster = {"certificate-authority": str(pki / "ca.crt")}
        user = {
            "client-certificate": str(pki / "client.crt"),
            "client-key": str(pki / "client.key"),
        }
    path = write_kubeconfig(tmp_path / "config", mtls_server.url, cluster, user)
    assert await names(from_kubeconfig(path)) == ["e0"]
    without = write_kubeconfig(tmp_path / "without", mtls_server.url, cluster, {})
    with pytest.raises(KubeError):  # the server wants a certificate
        await names(from_kubeconfig(without))


def test_kubeconfigs_that_cannot_work_fail_at_start_up(tmp_path: Path) -> None:
    server = "https://127.0.0.1:6443"
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({}, {"exec": {"command": "aws"}}, "exec"),
        ({"certificate-authority": "missing.crt"}, {}, "TLS files"),
        ({}, {"client-certificate-data": "eA=="}, "needs its key"),
    ]
    for cluster, user, said in cases:
        path = write_kubeconfig(tmp_path / "config", server, cluster, user)
        with pytest.raises(ConfigError, match=said):
            from_kubeconfig(path)
    (tmp_path / "empty").write_text("kind: Config\n")
    with pytest.raises(ConfigError, match="current-context"):
        from_kubeconfig(tmp_path / "empty")


def test_the_kubeconfig_path_follows_the_flag_then_kubeconfig_then_home() -> None:
    assert kubeconfig_path("/x/config", {"KUBECONFIG": "/y"}) == Path("/x/config")
    assert kubeconfig_path(None, {"KUBECONFIG": "/a:/b", "HOME": "/h"}) == Path("/a")
    assert kubeconfig_path(None, {"HOME": "/h"}) == Path("/h/.kube/config")


def service_account(directory: Path, pki: Path, token: str) -> Path:
    directory.mkdir()
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    (directory / "namespace").write_text("llm\n")
    return directory


async def test_in_a_pod_the_service_account_and_the_service_env_are_used(
    pki: Path, tls_server: KubeApiServer, tmp_path: Path
) -> None:
    sa = service_account(tmp_path / "sa", pki, "secret")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(tls_server.port)}
    found = access(None, directory=sa, environ=env)  # chosen over any kubeconfig
    assert (found.server, found.namespace) == (tls_server.url, "llm")
    assert await names(found) == ["e0"]
    with pytest.raises(ConfigError, match="not in a pod"):
        in_cluster(sa, {})


async def test_a_rotated_token_is_read_again_after_a_401(
    pki: Path, tls_server: KubeApiServer, tmp_path: Path
) -> None:
    sa = service_account(tmp_path / "sa", pki, "secret")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(tls_server.port)}
    found = in_cluster(sa, env)
    assert found.token is not None
    found.token.every = 3600.0  # not by age: only the 401 makes it read the file again
    assert await names(found) == ["e0"]
    tls_server.token = "rotated"  # the kubelet writes a new token; the old one expires
    (sa / "token").write_text("rotated")
    with pytest.raises(KubeError, match="401"):
        await names(found)
    assert await names(found) == ["e0"]
