"""TLS and the engines' keys: the router serving HTTPS (and reloading its certificate),
engines reached over mTLS, and the API key sent to engines but shown nowhere else.

The certificates are made here: a throwaway CA, a server certificate for 127.0.0.1 and
localhost, a client certificate. Engines are simulated, in-process, on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import ssl
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dprouter.config import RouterConfig
from dprouter.core.errors import ConfigError
from dprouter.core.tls import server_context
from dprouter.fleet.worker_spec import WorkerSpec, check_worker, parse_worker
from dprouter.multiproc.supervisor import Supervisor
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, until, workers

PROMPT = {"prompt": "over TLS", "max_tokens": 3}
KEY = "sk-engine-3f9a1c"  # the engines' --api-key
CLIENT_TOKEN = "client-token-77"  # what a client sends the router: never the engine's


# -- certificates ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path
    serial: int


class Authority:
    """A throwaway CA that signs server and client certificates into ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dprouter test CA")])
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = directory / "ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _builder(
        self, subject: x509.Name, public: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, name: str, client: bool = False) -> Pair:
        """A certificate for 127.0.0.1 and localhost (a server's), or a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = self._builder(subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if not client:
            loopback = ipaddress.ip_address("127.0.0.1")
            names = [x509.DNSName("localhost"), x509.IPAddress(loopback)]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pair = Pair(self.dir / f"{name}.pem", self.dir / f"{name}.key", cert.serial_number)
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return pair

    def trusting(self, client: Pair | None = None) -> ssl.SSLContext:
        """A client's context that trusts this CA (and shows ``client``, if given)."""
        context = ssl.create_default_context(cafile=str(self.path))
        if client is not None:
            context.load_cert_chain(client.cert, client.key)
        return context


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


async def served_serial(url: str, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new handshake with ``url`` gets."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        await writer.wait_closed()


def swap(live: Pair, new: Pair) -> None:
    """Renew the certificate on disk, as a certificate manager would (same paths)."""
    live.cert.write_bytes(new.cert.read_bytes())
    live.key.write_bytes(new.key.read_bytes())


# -- serving HTTPS ------------------------------------------------------------------------


async def test_the_router_serves_https_to_a_client_that_trusts_its_ca(
    ca: Authority, start_cluster: StartCluster, start_router: StartRouter
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    pair = ca.issue("router")
    config = RouterConfig(
        workers=workers(engine.url), tls_cert=str(pair.cert), tls_key=str(pair.key)
    )
    router = await start_router(config)
    assert router.url.startswith("https://127.0.0.1:")
    connector = aiohttp.TCPConnector(ssl=ca.trusting())
    async with (
        aiohttp.ClientSession(connector=connector) as https,
        https.post(router.url + "/v1/completions", json=PROMPT) as r,
    ):
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"]
    assert engine.generation_requests == 1
    # a client that does not trust the CA gets no answer at all
    async with aiohttp.ClientSession() as untrusting:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await untrusting.get(router.url + "/health")
    assert await served_serial(router.url, ca.trusting()) == pair.serial


async def test_a_reload_swaps_the_certificate_and_an_open_stream_keeps_going(
    ca: Authority,
    start_cluster: StartCluster,
    start_router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    live, renewed = ca.issue("router"), ca.issue("renewed")
    config = RouterConfig(
        workers=workers(engine.url), tls_cert=str(live.cert), tls_key=str(live.key)
    )
    router = await start_router(config)
    trusting = ca.trusting()
    assert await served_serial(router.url, trusting) == live.serial
    body = {"prompt": "a long answer", "max_tokens": 64, "stream": True, "ignore_eos": True}
    connector = aiohttp.TCPConnector(ssl=trusting)
    async with aiohttp.ClientSession(connector=connector) as https:
        async with https.post(router.url + "/v1/completions", json=body) as stream:
            assert stream.status == 200
            first = await stream.content.readline()  # the stream is under way...
            assert first.startswith(b"data: ")
            swap(live, renewed)
            assert router.reload_tls()  # ...when the certificate is renewed
            assert await served_serial(router.url, trusting) == renewed.serial
            rest = await stream.read()  # the open connection was not dropped
        assert rest.rstrip().endswith(b"data: [DONE]")
        tokens = (first + rest).count(b'"text"')
        assert tokens >= 64
        # a new connection of the same client works too, on the new certificate
        async with https.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
    # a bad new file is logged and the pair in use stays
    live.key.write_text("not a key")
    with caplog.at_level(logging.ERROR, logger="dprouter.tls"):
        assert not router.reload_tls()
    assert any("TLS reload failed" in m for m in caplog.messages)
    assert await served_serial(router.url, trusting) == renewed.serial


async def test_serving_processes_serve_https_and_sighup_reaches_each(ca: Authority) -> None:
    """``--processes 2``: each serving process has its own context; the supervisor
    forwards SIGHUP (real signals to real processes) once the new pair loads."""
    live, renewed = ca.issue("router"), ca.issue("renewed")
    config = RouterConfig(
        port=0, processes=2, grace=1.0, tls_cert=str(live.cert), tls_key=str(live.key)
    )
    trusting = ca.trusting()
    async with SimCluster([EngineConfig()]) as cluster:
        config = replace(config, workers=workers(*cluster.urls))
        async with Supervisor(config) as sup:
            assert await sup.settled(10)
            assert sup.url.startswith("https://")
            connector = aiohttp.TCPConnector(ssl=trusting, force_close=True)
            async with aiohttp.ClientSession(connector=connector) as https:
                for _ in range(4):  # new connections: the kernel spreads them over both
                    async with https.post(sup.url + "/v1/completions", json=PROMPT) as r:
                        assert r.status == 200
            assert await served_serial(sup.url, trusting) == live.serial
            swap(live, renewed)
            assert sup.reload_tls()
            serials: list[int] = []

            async def seen() -> None:
                serials.append(await served_serial(sup.url, trusting))

            # each process reloads when its signal arrives: then, 12 handshakes in a row
            # (spread over both by the kernel) all get the new certificate
            for _ in range(250):
                await seen()
                if serials[-12:] == [renewed.serial] * 12:
                    break
                await asyncio.sleep(0.02)
            assert serials[-12:] == [renewed.serial] * 12
            assert all(c.is_alive() for c in sup.children.values())  # none died of SIGHUP


async def test_a_pair_that_does_not_load_fails_at_start(ca: Authority, tmp_path: Path) -> None:
    pair = ca.issue("router")
    other = ca.issue("other")
    with pytest.raises(ConfigError, match="cannot load"):
        server_context(str(pair.cert), str(other.key))  # a key that is not the cert's


# -- to the engines: mTLS ----------------------------------------------------------------


async def test_an_engine_requiring_a_client_certificate_gets_the_routers(
    ca: Authority, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    server, client = ca.issue("engine"), ca.issue("router-client", client=True)
    tls = server_context(str(server.cert), str(server.key), client_ca=str(ca.path))
    async with SimCluster([EngineConfig(dp_size=2)], tls=tls) as cluster:
        (engine,) = cluster.servers
        assert engine.url.startswith("https://")
        config = RouterConfig(
            workers=workers(engine.url),
            engine_ca=str(ca.path),
            engine_cert=str(client.cert),
            engine_key=str(client.key),
        )
        router = await start_router(config)
        assert router.registry.snapshot.pool("regular")  # discovered over mTLS: ready
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
        assert engine.generation_requests == 1
        assert engine.hits["GET /health"] >= 1  # health checks went over mTLS too


async def test_without_a_client_certificate_the_engine_is_not_ready_and_nothing_hangs(
    ca: Authority, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    server = ca.issue("engine")
    tls = server_context(str(server.cert), str(server.key), client_ca=str(ca.path))
    async with SimCluster([EngineConfig()], tls=tls) as cluster:
        (engine,) = cluster.servers
        config = RouterConfig(workers=workers(engine.url), engine_ca=str(ca.path))
        router = await start_router(config, settle=False)
        (worker,) = router.registry.workers.values()
        assert await until(lambda: worker.error is not None, 10)
        assert not worker.ready
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 503  # no ready worker: at once, not a hang
        assert engine.generation_requests == 0


# -- to the engines: the API key ---------------------------------------------------------


async def test_the_key_goes_with_every_call_and_the_clients_own_does_not(
    start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang's --api-key guards all but /health, /ready and /metrics: discovery
    # (/server_info) and load scrapes (/v1/loads) need the key as much as completions do
    caplog.set_level(logging.DEBUG)
    async with SimCluster([EngineConfig(persona="sglang", dp_size=2)], api_key=KEY) as cluster:
        (engine,) = cluster.servers
        config = RouterConfig(workers=workers(engine.url), engine_api_key=KEY, load_interval=0.05)
        router = await start_router(config)
        (worker,) = router.registry.workers.values()
        assert worker.ready and worker.ranks == 2
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
            for path in ("/v1/completions", "/generate"):
                body = PROMPT if path != "/generate" else {"text": "hi"}
                async with http.post(router.url + path, json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            assert await until(lambda: engine.hits["GET /v1/loads"] >= 2)
            seen = [r.headers.getall("Authorization") for r in engine.received]
            assert seen == [[f"Bearer {KEY}"]] * 2  # the router's key, once, not the client's
            assert not engine.refused  # discovery, scrapes and requests: every one had it
            assert engine.hits["GET /server_info"] >= 1
            for path in ("/workers", "/metrics", "/list_workers"):
                async with http.get(router.url + path) as r:
                    assert KEY not in await r.text()
    assert not [r for r in caplog.records if KEY in r.getMessage()]


async def test_sglangs_admin_endpoints_get_its_admin_key_and_the_rest_its_api_key(
    start_router: StartRouter, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang with --api-key and --admin-api-key: its admin endpoints (the engine commands,
    /abort_request) take the admin key alone, the others the API key alone. Given only
    the API key, the router's flush and abort are refused, and the refused abort is said;
    given both, each call carries the right one."""
    caplog.set_level(logging.WARNING)
    admin = "sk-engine-admin-19"
    sglang = EngineConfig(persona="sglang", dp_size=2)
    body = {"prompt": "a long story", "max_tokens": 5000}  # not streamed: nothing to notice

    async def leave(router_url: str) -> None:
        leaving = asyncio.create_task(http.post(router_url + "/v1/completions", json=body))
        assert await until(lambda: any(r.num_running for r in engine.engine.ranks))
        leaving.cancel()

    async with SimCluster([sglang], api_key=KEY, admin_key=admin) as cluster:
        (engine,) = cluster.servers
        plain = await start_router(RouterConfig(workers=workers(engine.url), engine_api_key=KEY))
        (worker,) = plain.registry.workers.values()
        assert worker.ready  # discovery: the API key's endpoints
        async with http.post(plain.url + "/flush_cache") as r:
            answer = await r.json()
        assert r.status != 200 and [w["status"] for w in answer["workers"]] == [401]
        await leave(plain.url)
        assert await until(lambda: engine.refused["POST /abort_request"] == 1)
        assert await until(lambda: any("--engine-admin-key" in m for m in caplog.messages))
        assert not engine.abort_requests
        await plain.stop()
        # the abort was refused: the generation ended only as the router stopped and closed
        # its connection; now with both keys
        assert await until(lambda: not any(r.num_running for r in engine.engine.ranks), 30)
        config = RouterConfig(
            workers=workers(engine.url), engine_api_key=KEY, engine_admin_key=admin
        )
        both = await start_router(config)
        async with http.post(both.url + "/flush_cache") as r:
            assert r.status == 200, await r.text()
        async with http.post(both.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200  # the API key still, where the admin key is refused
        await leave(both.url)
        assert await until(lambda: len(engine.abort_requests) == 1)
        assert engine.refused == {"POST /abort_request": 1, "POST /flush_cache": 1}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert admin not in logged and KEY not in logged


async def test_without_the_key_the_engine_never_becomes_ready(
    start_router: StartRouter, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "sk-not-the-engines"
    caplog.set_level(logging.DEBUG)
    async with SimCluster([EngineConfig(persona="sglang")], api_key=KEY) as cluster:
        (engine,) = cluster.servers
        config = RouterConfig(workers=workers(engine.url), engine_api_key=wrong)
        router = await start_router(config, settle=False)
        (worker,) = router.registry.workers.values()
        assert await until(lambda: engine.refused["GET /server_info"] >= 2, 10)
        assert not worker.ready
        async with http.get(router.url + "/workers") as r:
            listing = await r.text()
        assert wrong not in listing and KEY not in listing
    assert not [r for r in caplog.records if wrong in r.getMessage()]


async def test_a_workers_own_key_wins_from_the_command_line_and_the_admin_api(
    start_router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_B_KEY", "sk-b")
    async with (
        SimCluster([EngineConfig(persona="sglang")], api_key="sk-a") as a,
        SimCluster([EngineConfig(persona="sglang")], api_key="sk-b") as b,
    ):
        config = RouterConfig(
            workers=(
                parse_worker(f"{a.urls[0]},id=a,api_key=sk-a"),
                parse_worker(f"{b.urls[0]},id=b,api_key_env=ENGINE_B_KEY"),
            ),
            engine_api_key="sk-everyone-else",
        )
        router = await start_router(config)
        assert {w.id for w in router.registry.workers.values() if w.ready} == {"a", "b"}
        async with SimCluster([EngineConfig(persona="sglang")], api_key="sk-c") as c:
            async with aiohttp.ClientSession() as http:
                body = {"url": c.urls[0], "id": "c", "api_key": "sk-c"}
                async with http.post(router.url + "/workers?wait=10", json=body) as r:
                    assert r.status == 201
                    added = await r.text()
                assert "sk-c" not in added
                assert router.registry.workers["c"].ready
                for _ in range(6):
                    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
                        assert r.status == 200
            keys = {
                s.engine_id: {h for r in s.received for h in r.headers.getall("Authorization")}
                for s in (a[0], b[0], c[0])
            }
            assert keys == {
                a[0].engine_id: {"Bearer sk-a"},
                b[0].engine_id: {"Bearer sk-b"},
                c[0].engine_id: {"Bearer sk-c"},
            }
            assert not (a[0].refused or b[0].refused or c[0].refused)


async def test_a_vllm_engine_guards_its_api_and_not_its_probes() -> None:
    """As vLLM's --api-key: /v1/... need the key; /health, /metrics and /server_info do
    not (so discovery by /metrics works without it, and /v1/models does not)."""
    async with SimCluster([EngineConfig()], api_key=KEY) as cluster:
        url = cluster.urls[0]
        async with aiohttp.ClientSession() as http:
            for path in ("/health", "/metrics"):
                async with http.get(url + path) as r:
                    assert r.status == 200
            async with http.get(url + "/v1/models") as r:
                assert r.status == 401
                assert await r.json() == {"error": "Unauthorized"}
            auth = {"Authorization": f"Bearer {KEY}"}
            async with http.get(url + "/v1/models", headers=auth) as r:
                assert r.status == 200
        assert cluster[0].refused == {"GET /v1/models": 1}


# -- where a key is read, and where it never shows ---------------------------------------


def test_a_workers_key_comes_from_its_spec_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("W_KEY", "sk-from-env")
    spec = check_worker(parse_worker("http://127.0.0.1:9,api_key_env=W_KEY"))
    assert (spec.api_key, spec.api_key_env) == ("sk-from-env", None)
    assert check_worker(spec) == spec  # checked again (every validate): the same
    assert "sk-from-env" not in repr(spec)
    monkeypatch.delenv("W_KEY")
    with pytest.raises(ConfigError, match="W_KEY, which is not set"):
        check_worker(parse_worker("http://127.0.0.1:9,api_key_env=W_KEY"))
    with pytest.raises(ConfigError, match="not both"):
        check_worker(WorkerSpec("http://127.0.0.1:9", api_key="a", api_key_env="W_KEY"))
    with pytest.raises(ConfigError) as wrong:  # a file's key of the wrong type: not echoed
        check_worker(WorkerSpec("http://127.0.0.1:9", api_key=12345678))  # type: ignore[arg-type]
    assert "12345678" not in str(wrong.value)
