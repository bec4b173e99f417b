"""Who may call: tenants' API keys and an issuer's JWTs on the data plane, the admin role
on the control plane (the admin API, the engine commands, the dashboard), under
``--processes 2`` too; keys never in a log record, an answer or /metrics.

The issuer is a real one on loopback: an aiohttp server answering its OpenID
configuration and its JWKS, with keys made by ``cryptography`` and tokens signed by
PyJWT; it counts what the router fetched."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
import yaml
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from dprouter.config import RouterConfig
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.identity import OPEN
from dprouter.server.issuer import LEEWAY, REFETCH
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, metric_sum, reserve_port, serving, workers

USER_KEY = "sk-user-a-0123456789"
ADMIN_KEY = "sk-ops-9876543210"
WRONG_KEY = "sk-wrong-5555555555"
KEYS = (USER_KEY, ADMIN_KEY, WRONG_KEY)
SGLANG = EngineConfig(persona="sglang", time_scale=0.05)
PROMPT = {"prompt": "hello", "max_tokens": 4}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tenants_file(tmp_path: Path, **tenants: dict[str, Any]) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path)


def keyed(tmp_path: Path) -> str:
    return tenants_file(
        tmp_path,
        a={"keys": [USER_KEY], "set_class": True},
        ops={"key_env": ["OPS_KEY"], "access": "admin"},
    )


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> tuple[int, str, dict[str, str]]:
    async with http.request(method, url, json=body, headers=headers or {}) as r:
        return r.status, await r.text(), dict(r.headers)


# -- API keys ---------------------------------------------------------------------------


async def test_with_keys_the_data_plane_needs_one_and_the_control_plane_an_admins(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPS_KEY", ADMIN_KEY)
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(workers=workers(engine.url), tenants=keyed(tmp_path), dashboard=True)
    router = await start_router(config)
    url = router.url
    completions = url + "/v1/completions"
    # the data plane: no key, a wrong key, a scheme that is not Bearer: 401, saying which
    for headers, said in (
        ({}, "needs a credential"),
        (bearer(WRONG_KEY), "unknown API key"),
        ({"Authorization": f"Basic {USER_KEY}"}, "needs a credential"),
    ):
        status, text, answer_headers = await call(http, "POST", completions, headers, PROMPT)
        assert status == 401, text
        assert said in text and WRONG_KEY not in text and USER_KEY not in text
        assert json.loads(text)["error"]["type"] == "authentication_error"
        assert answer_headers["WWW-Authenticate"].startswith("Bearer")
    assert len(engine.received) == 0
    for key in (USER_KEY, ADMIN_KEY):
        status, text, _ = await call(http, "POST", completions, bearer(key), PROMPT)
        assert status == 200, text
    assert len(engine.received) == 2
    assert all("Authorization" not in r.headers for r in engine.received)  # never passed on
    # a tenant that may choose its class names one that exists, or gets a 400
    headers = {**bearer(USER_KEY), "X-Priority": "urgent"}
    status, text, _ = await call(http, "POST", completions, headers, PROMPT)
    assert status == 400 and "X-Priority" in text
    # the open endpoints stay open
    for path in ("/health", "/v1/models", "/metrics"):
        assert (await call(http, "GET", url + path))[0] == 200
    # the control plane: a user key gets 403 on the admin API, an engine command and the
    # dashboard; no key (even from loopback) or a wrong one, 401; the admin key, 200
    control = [
        ("GET", "/workers", None),
        ("GET", "/list_workers", None),
        ("GET", "/flush_cache", None),
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/continue_generation", {}),
        ("GET", "/v1/rl/workers", None),
        ("GET", "/dashboard/data", None),
        ("GET", "/dashboard", None),
    ]
    for method, path, payload in control:
        status, text, _ = await call(http, method, url + path, bearer(USER_KEY), payload)
        assert status == 403, (path, text)
        assert "tenant a has the user role" in text and USER_KEY not in text
        assert json.loads(text)["error"]["type"] == "permission_error"
        for headers in ({}, bearer(WRONG_KEY)):
            assert (await call(http, method, url + path, headers, payload))[0] == 401, path
    assert engine.hits["GET /flush_cache"] == 0 and engine.hits["POST /pause_generation"] == 0
    for method, path, payload in control:
        status, text, _ = await call(http, method, url + path, bearer(ADMIN_KEY), payload)
        assert status == 200, (path, text)
    assert engine.hits["GET /flush_cache"] == 1 and engine.hits["POST /pause_generation"] == 1
    # a browser logs in to the dashboard with the admin key as Basic auth's password
    basic = base64.b64encode(f"anyone:{ADMIN_KEY}".encode()).decode()
    wrong = base64.b64encode(f"anyone:{USER_KEY}".encode()).decode()
    auth = {"Authorization": f"Basic {basic}"}
    assert (await call(http, "GET", url + "/dashboard/data", auth))[0] == 200
    status, _, headers = await call(http, "GET", url + "/dashboard/data", {})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
    auth = {"Authorization": f"Basic {wrong}"}
    assert (await call(http, "GET", url + "/dashboard/data", auth))[0] == 403
    # the metrics name tenants, never keys; no log record holds one
    async with http.get(url + "/metrics") as r:
        metrics = await r.text()
    assert await metric_sum(http, url, "dprouter_tenant_admitted_total", tenant="a") == 1
    assert await metric_sum(http, url, "dprouter_tenant_admitted_total", tenant="ops") == 1
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    for key in KEYS:
        assert key not in metrics and key not in logged
        assert hashlib.sha256(key.encode()).hexdigest() not in metrics + logged
    assert OPEN not in logged  # the data plane is closed: nothing to warn of


async def test_the_admin_token_still_opens_the_control_plane_beside_keys(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    monkeypatch.setenv("OPS_KEY", ADMIN_KEY)
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(workers=workers(engine.url), tenants=keyed(tmp_path), admin_token="t0ken")
    router = await start_router(config)
    for token, status in (("t0ken", 200), (ADMIN_KEY, 200), (USER_KEY, 403), ("guess", 401)):
        assert (await call(http, "GET", router.url + "/workers", bearer(token)))[0] == status
    # the admin token is the control plane's, not a tenant's key
    status, _, _ = await call(http, "POST", router.url + "/v1/completions", bearer("t0ken"))
    assert status == 401


async def test_with_nothing_configured_the_open_data_plane_is_said_once(
    caplog: pytest.LogCaptureFixture,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    caplog.set_level(logging.INFO)
    (engine,) = (await start_cluster([SGLANG])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), dashboard=True))
    # any Authorization is ignored: everyone is anonymous, admin calls from loopback pass
    for headers in ({}, bearer(WRONG_KEY)):
        status, text, _ = await call(http, "POST", router.url + "/v1/completions", headers, PROMPT)
        assert status == 200, text
        assert (await call(http, "GET", router.url + "/workers", headers))[0] == 200
        assert (await call(http, "GET", router.url + "/dashboard/data", headers))[0] == 200
    assert await metric_sum(http, router.url, "dprouter_tenant_admitted_total") == 2
    warned = [r for r in caplog.records if r.getMessage() == OPEN]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "--tenants" in OPEN and "--jwt-issuer" in OPEN


# -- JWT --------------------------------------------------------------------------------


class Issuer:
    """An OpenID issuer on loopback: its configuration document and its JWKS, which the
    test may change (a rotation); counts the fetches of each."""

    def __init__(self) -> None:
        self.url = ""
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.hits = {"config": 0, "jwks": 0}

    def add(self, kid: str, key: Any) -> None:
        self.keys[kid] = key

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self.configuration)
        app.router.add_get("/keys", self.jwks)
        return app

    async def configuration(self, _: web.Request) -> web.Response:
        self.hits["config"] += 1
        return web.json_response({"issuer": self.url, "jwks_uri": self.url + "/keys"})

    async def jwks(self, _: web.Request) -> web.Response:
        self.hits["jwks"] += 1
        found = []
        for kid, key in self.keys.items():
            public = key.public_key()
            if isinstance(public, rsa.RSAPublicKey):
                data = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(public))
            else:
                data = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(public))
            found.append({**data, "kid": kid, "use": "sig"})
        return web.json_response({"keys": found})

    def token(self, kid: str, key: Any | None = None, **claims: Any) -> str:
        key = key or self.keys[kid]
        now = int(time.time())
        payload = {"iss": self.url, "aud": "dprouter", "sub": "team-a", "iat": now}
        payload |= {"exp": now + 600, **claims}
        payload = {name: value for name, value in payload.items() if value is not None}
        algorithm = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
        return jwt.encode(payload, key, algorithm=algorithm, headers={"kid": kid})


@pytest.fixture
async def issuer() -> AsyncIterator[Issuer]:
    found = Issuer()
    found.add("k1", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    async with serving(found.app(), health=False) as url:
        found.url = url
        yield found


def forged(header: dict[str, Any], payload: dict[str, Any], secret: bytes | None) -> str:
    """A token written by hand: ``alg`` none, or an HMAC keyed with ``secret``."""

    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    signed = f"{part(header)}.{part(payload)}"
    if secret is None:
        return signed + "."
    mac = hmac.new(secret, signed.encode(), hashlib.sha256).digest()
    return signed + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


async def test_a_jwt_is_verified_against_the_issuers_keys_and_maps_tenant_and_role(
    tmp_path: Path,
    issuer: Issuer,
    caplog: pytest.LogCaptureFixture,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    caplog.set_level(logging.DEBUG)
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(
        workers=workers(engine.url),
        tenants=tenants_file(tmp_path, **{"team-a": {"class": "high"}}),
        jwt_issuer=issuer.url,
        jwt_audience="dprouter",
        dashboard=True,
    )
    router = await start_router(config)
    completions = router.url + "/v1/completions"
    user = issuer.token("k1")
    admin = issuer.token("k1", sub="ops", role=["reader", "admin"])
    status, text, _ = await call(http, "POST", completions, bearer(user), PROMPT)
    assert status == 200, text
    assert await metric_sum(http, router.url, "dprouter_tenant_admitted_total", tenant="team-a")
    # the role claim decides the control plane
    status, text, _ = await call(http, "GET", router.url + "/workers", bearer(user))
    assert status == 403 and "tenant team-a has the user role" in text
    for path in ("/workers", "/dashboard/data", "/flush_cache"):
        assert (await call(http, "GET", router.url + path, bearer(admin)))[0] == 200, path
    assert (await call(http, "POST", completions, bearer(admin), PROMPT))[0] == 200
    # each of these is a 401 naming what is wrong
    public = (
        issuer.keys["k1"]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    claims = jwt.decode(user, options={"verify_signature": False})
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for token, said in (
        (issuer.token("k1", key=other), "signature does not verify"),
        (issuer.token("k1", exp=int(time.time()) - 3600), "expired"),
        (issuer.token("k1", iss="http://127.0.0.1:1/elsewhere"), "issuer"),
        (issuer.token("k1", aud="another-service"), "audience"),
        (issuer.token("k1", nbf=int(time.time()) + 3600), "not valid yet"),
        (issuer.token("k1", exp=None), "no exp claim"),
        (issuer.token("k1", sub=""), "names no tenant"),
        (forged({"alg": "none", "kid": "k1"}, claims, None), "algorithm"),
        (forged({"alg": "HS256", "kid": "k1"}, claims, public), "algorithm"),
        ("not.a.token", "cannot be read"),
    ):
        status, text, headers = await call(http, "POST", completions, bearer(token), PROMPT)
        assert status == 401 and said in text, (said, text)
        assert token not in text and 'error="invalid_token"' in headers["WWW-Authenticate"]
        assert (await call(http, "GET", router.url + "/workers", bearer(token)))[0] == 401
    assert len(engine.received) == 2
    # the issuer was asked once for all of them: discovery, then its keys
    assert issuer.hits == {"config": 1, "jwks": 1}
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert user not in logged and admin not in logged


async def test_a_tokens_signature_is_checked_once_until_it_expires(
    issuer: Issuer,
    monkeypatch: pytest.MonkeyPatch,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """A client reusing its token has it verified once (PyJWT's decode counted); a token
    near its expiry is kept no longer than that: verified again after, and refused once
    past it (with the leeway)."""
    decoded: list[str] = []
    decode = jwt.decode

    def counted(token: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(token)
        return decode(token, *args, **kwargs)

    monkeypatch.setattr(jwt, "decode", counted)
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(workers=workers(engine.url), jwt_issuer=issuer.url)
    router = await start_router(config)
    completions = router.url + "/v1/completions"
    user = issuer.token("k1")
    for _ in range(5):
        assert (await call(http, "POST", completions, bearer(user), PROMPT))[0] == 200
    assert decoded == [user]
    # expires in 1-2 s (whole seconds): kept until then, then verified again (the leeway
    # lets it pass)
    soon = issuer.token("k1", exp=int(time.time()) + 2)
    assert (await call(http, "POST", completions, bearer(soon), PROMPT))[0] == 200
    assert (await call(http, "POST", completions, bearer(soon), PROMPT))[0] == 200
    assert decoded.count(soon) == 1
    await asyncio.sleep(2.5)
    assert (await call(http, "POST", completions, bearer(soon), PROMPT))[0] == 200
    assert decoded.count(soon) == 2
    # past its expiry and the leeway: refused, though it was verified before
    late = issuer.token("k1", exp=int(time.time()) - LEEWAY + 2)
    assert (await call(http, "POST", completions, bearer(late), PROMPT))[0] == 200
    await asyncio.sleep(2.5)
    status, text, _ = await call(http, "POST", completions, bearer(late), PROMPT)
    assert status == 401 and "expired" in text, text


async def test_a_new_key_id_is_fetched_but_forged_ones_do_not_flood_the_issuer(
    issuer: Issuer,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(
        workers=workers(engine.url), jwt_issuer=issuer.url, jwt_jwks=issuer.url + "/keys"
    )
    router = await start_router(config)
    completions = router.url + "/v1/completions"
    status, text, _ = await call(http, "POST", completions, bearer(issuer.token("k1")), PROMPT)
    assert status == 200, text
    assert issuer.hits == {"config": 0, "jwks": 1}  # --jwt-jwks: no discovery
    # the issuer rotates to an EC key: the router learns it (the first tries may come
    # before a refetch is allowed again)
    issuer.add("k2", ec.generate_private_key(ec.SECP256R1()))
    rotated = issuer.token("k2")
    statuses = []
    for _ in range(100):  # 5 s at most, several REFETCH
        statuses.append((await call(http, "POST", completions, bearer(rotated), PROMPT))[0])
        if statuses[-1] == 200:
            break
        await asyncio.sleep(0.05)
    assert statuses[-1] == 200 and set(statuses) <= {401, 200}, statuses
    # a flood of forged key ids: at most one fetch per REFETCH seconds, however many
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    before, started = issuer.hits["jwks"], time.monotonic()
    answers = await asyncio.gather(
        *(
            call(http, "POST", completions, bearer(issuer.token(f"forged-{n}", stranger)))
            for n in range(50)
        )
    )
    elapsed = time.monotonic() - started
    assert {status for status, _, _ in answers} == {401}
    assert all("the issuer has no key" in text for _, text, _ in answers)
    assert issuer.hits["jwks"] - before <= 1 + elapsed / REFETCH


async def test_an_issuer_out_of_reach_is_a_503_for_that_request(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([SGLANG])).servers
    holder = reserve_port()  # held, not listening: the issuer refuses connections
    try:
        gone = f"http://127.0.0.1:{holder.getsockname()[1]}"
        config = RouterConfig(workers=workers(engine.url), jwt_issuer=gone)
        router = await start_router(config)
        key = ec.generate_private_key(ec.SECP256R1())
        token = jwt.encode(
            {"iss": gone, "sub": "x", "exp": int(time.time()) + 60},
            key,
            algorithm="ES256",
            headers={"kid": "k1"},
        )
        status, text, _ = await call(
            http, "POST", router.url + "/v1/completions", bearer(token), PROMPT
        )
        assert status == 503 and "cannot fetch the issuer's keys" in text
        assert token not in text
        assert (await call(http, "GET", router.url + "/health"))[0] == 200
        assert len(engine.received) == 0
    finally:
        holder.close()


# -- --processes 2 ----------------------------------------------------------------------


async def test_under_two_processes_the_parent_checks_the_admin_credential(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    start_cluster: StartCluster,
) -> None:
    monkeypatch.setenv("OPS_KEY", ADMIN_KEY)
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(
        workers=workers(engine.url), tenants=keyed(tmp_path), port=0, processes=2, grace=2.0
    )
    sup = Supervisor(config)
    await sup.start()
    try:
        assert await sup.settled(10)
        for _ in range(6):  # a connection each: both processes answer some
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                for path, headers, status in (
                    ("/workers", bearer(ADMIN_KEY), 200),
                    ("/workers", bearer(USER_KEY), 403),
                    ("/workers", bearer(WRONG_KEY), 401),
                    ("/workers", {}, 401),  # loopback is not enough: admin keys exist
                    ("/flush_cache", bearer(USER_KEY), 403),
                ):
                    got, text, _ = await call(s, "GET", sup.url + path, headers)
                    assert got == status, (path, text)
                    assert USER_KEY not in text and ADMIN_KEY not in text
                got, _, _ = await call(s, "POST", sup.url + "/v1/completions", {}, PROMPT)
                assert got == 401
                headers = bearer(USER_KEY)
                got, _, _ = await call(s, "POST", sup.url + "/v1/completions", headers, PROMPT)
                assert got == 200
        assert engine.hits["GET /flush_cache"] == 0
    finally:
        await sup.stop()


async def test_under_two_processes_the_open_data_plane_is_said_once(
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    start_cluster: StartCluster,
) -> None:
    caplog.set_level(logging.INFO)  # the serving processes log at the parent's level
    (engine,) = (await start_cluster([SGLANG])).servers
    sup = Supervisor(RouterConfig(workers=workers(engine.url), port=0, processes=2, grace=2.0))
    await sup.start()
    try:
        assert await sup.settled(10)
        async with aiohttp.ClientSession() as s:
            assert (await call(s, "POST", sup.url + "/v1/completions", {}, PROMPT))[0] == 200
    finally:
        await sup.stop()
    said = [r for r in caplog.records if r.getMessage() == OPEN]  # the parent's
    assert len(said) == 1
    assert OPEN not in capfd.readouterr().err  # the serving processes' own log
