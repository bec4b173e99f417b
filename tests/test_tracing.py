"""Traces and request ids through the router: spans exported over OTLP/HTTP to a receiver
of the test's own, the client's trace and id carried to the engines, and nothing of
OpenTelemetry loaded when tracing is off."""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from dprouter.config import RouterConfig
from dprouter.core.tracing import Tracing
from dprouter.core.types import PdMode
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, serving, until, workers
from tests.test_router_pd import deploy

PROMPT = {"prompt": "trace me", "max_tokens": 3}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def traceparent(trace: str = TRACE) -> str:
    return f"00-{trace}-{CLIENT_SPAN}-01"


@dataclass
class Exported:
    name: str
    trace: str
    id: str
    parent: str
    attributes: dict[str, Any]
    failed: bool  # its status is ERROR
    service: str


@dataclass
class Receiver:
    """An OTLP/HTTP collector: what the router exported, span by span."""

    url: str = ""
    spans: list[Exported] = field(default_factory=list)

    async def traces(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        export = ExportTraceServiceRequest.FromString(raw)
        for resource in export.resource_spans:
            attrs = {a.key: value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        Exported(
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            {a.key: value(a.value) for a in s.attributes},
                            s.status.code == s.status.STATUS_CODE_ERROR,
                            attrs.get("service.name", ""),
                        )
                    )
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def of(self, trace: str, name: str | None = None) -> list[Exported]:
        return [s for s in self.spans if s.trace == trace and name in (None, s.name)]

    async def trace(self, trace: str, names: set[str], count: int = 0) -> list[Exported]:
        """The spans of ``trace`` once every one of ``names`` (and ``count`` spans) came."""
        assert await until(
            lambda: names <= {s.name for s in self.of(trace)} and len(self.of(trace)) >= count
        ), {s.name for s in self.of(trace)}
        return self.of(trace)


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    """The receiver, and the standard variables that send a router's spans to it soon."""
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", found.traces)
    async with serving(app) as url:
        found.url = url
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms between two exports
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        yield found


def one(spans: list[Exported], name: str, **attributes: Any) -> Exported:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, spans)
    return found[0]


def parents(server: SimServer, trace: str = TRACE) -> list[str]:
    """The parent span ids of the engine's requests in ``trace`` (their ``traceparent``)."""
    sent = [r.headers["traceparent"].split("-") for r in server.received]
    return [parent for _, t, parent, _ in sent if t == trace]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_trace_runs_through_the_router_to_the_engine(
    receiver: Receiver,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), tracing=True))
    headers = {"traceparent": traceparent(), "X-Request-Id": "client-7"}
    body = {**PROMPT, "stream": stream}
    async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()
        target, rid = r.headers["x-dprouter-target"], r.headers["x-request-id"]
    assert rid == "client-7"
    spans = await receiver.trace(TRACE, {"POST /v1/completions", "decision", "attempt", "relay"})
    root = one(spans, "POST /v1/completions")
    assert root.parent == CLIENT_SPAN  # the client's span is the router's parent
    assert root.attributes["dprouter.request_id"] == "client-7"
    assert root.attributes["http.response.status_code"] == 200
    assert root.service == "dprouter"
    decision = one(spans, "decision")
    assert decision.parent == root.id
    assert decision.attributes["dprouter.target"] == target  # what the client was told
    assert decision.attributes["dprouter.policy"] == router.parts.policy.name
    assert decision.attributes["dprouter.candidates"] == 2
    assert decision.attributes["dprouter.attempt"] == 0
    assert decision.attributes["dprouter.load"] == 0  # nothing else in flight
    attempt = one(spans, "attempt")
    assert attempt.parent == root.id
    assert attempt.attributes["dprouter.target"] == target
    assert attempt.attributes["http.response.status_code"] == 200
    assert not attempt.failed
    relay = one(spans, "relay")
    assert relay.parent == attempt.id
    assert relay.attributes["dprouter.bytes"] > 0
    assert relay.attributes["dprouter.reads"] >= (2 if stream else 1)
    # the engine's work is a child of the attempt, in the client's trace; its id is the client's
    assert parents(engine) == [attempt.id]
    assert engine.received[-1].headers["x-request-id"] == "client-7"


async def test_a_retried_request_shows_each_attempt_and_its_log_lines_name_it(
    receiver: Receiver,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead, live = (await start_cluster([EngineConfig(), EngineConfig()])).servers
    config = RouterConfig(
        workers=workers(dead.url, live.url),
        policy="round_robin",
        retry_backoff=0,
        tracing=True,
    )
    router = await start_router(config)
    await dead.crash()  # its port closed: a connection there is refused
    traces = [f"{k:032x}" for k in (1, 2)]  # round robin: one of the two goes there first
    ids: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="dprouter.monitor"):
        for trace in traces:
            headers = {"traceparent": traceparent(trace)}
            async with http.post(router.url + "/v1/completions", json=PROMPT, headers=headers) as r:
                assert r.status == 200
                ids[trace] = r.headers["x-request-id"]
    for trace in traces:
        await receiver.trace(trace, {"relay"})  # each ended in an answer
    retried = [t for t in traces if len(receiver.of(t, "attempt")) == 2]
    assert len(retried) == 1
    spans = receiver.of(retried[0])
    root = one(spans, "POST /v1/completions")
    first = one(spans, "attempt", **{"dprouter.attempt": 0})
    second = one(spans, "attempt", **{"dprouter.attempt": 1})
    assert first.parent == second.parent == root.id  # siblings
    assert first.failed and first.attributes["dprouter.failure"] == "connect"
    assert first.attributes["dprouter.target"] == "w0"
    assert not second.failed and second.attributes["http.response.status_code"] == 200
    assert one(spans, "decision", **{"dprouter.attempt": 1}).attributes["dprouter.target"] == "w1"
    assert parents(live, retried[0]) == [second.id]
    # the warning the refusal caused names the request it happened to
    rid = ids[retried[0]]
    (warned,) = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert warned.request_id == rid  # type: ignore[attr-defined]
    assert warned.getMessage().endswith(f"[request {rid}]")


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl"])
async def test_both_legs_of_a_pair_carry_the_trace_and_the_id(
    receiver: Receiver,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
) -> None:
    d = await deploy(start_cluster, start_router, mode, (1, 2), (1, 2), tracing=True)
    (prefill,), (decode,) = d.prefills, d.decodes
    headers = {"traceparent": traceparent(), "X-Request-Id": "pair-1"}
    async with http.post(d.router.url + "/v1/completions", json=PROMPT, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        assert r.headers["x-request-id"] == "pair-1"
        said = {
            "prefill": r.headers["x-dprouter-prefill"],
            "decode": r.headers["x-dprouter-target"],
        }
    spans = await receiver.trace(TRACE, {"relay"}, count=6)  # root, 2 decisions, 2 legs, relay
    root = one(spans, "POST /v1/completions")
    for side, server in (("prefill", prefill), ("decode", decode)):
        decision = one(spans, "decision", **{"dprouter.side": side})
        assert decision.attributes["dprouter.target"] == said[side]
        assert decision.attributes["dprouter.candidates"] == 2
        leg = one(spans, "attempt", **{"dprouter.side": side})
        assert leg.parent == root.id and leg.attributes["dprouter.target"] == said[side]
        assert parents(server) == [leg.id]
        assert server.received[-1].headers["x-request-id"] == "pair-1"
    relay = one(spans, "relay")
    assert relay.parent == one(spans, "attempt", **{"dprouter.side": "decode"}).id
    if mode == "sglang":  # its own id, in the body, as before: both legs the same
        assert prefill.received[-1].body["rid"] == decode.received[-1].body["rid"]


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_request_id_is_kept_if_fit_else_made_and_goes_everywhere(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: Literal["vllm", "sglang"],
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona=persona, dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))  # tracing off
    url = router.url + "/v1/completions"
    given = ["kept: any printable ASCII~", "", "x" * 129, "tab\there", "caf\u00e9"]
    for stream in (False, True):
        for asked in given:
            headers = {"X-Request-Id": asked} if asked else {}
            async with http.post(url, json={**PROMPT, "stream": stream}, headers=headers) as r:
                assert r.status == 200
                await r.read()
                rid = r.headers["x-request-id"]
            if asked == given[0]:
                assert rid == asked
            else:  # made: a uuid4 in hex
                assert len(rid) == 32 and rid[12] == "4" and int(rid, 16)
            assert engine.received[-1].headers.getall("x-request-id") == [rid]
    if persona == "sglang":  # its body's rid is the router's as before
        assert engine.received[-1].body["rid"].startswith("dprouter-")
    # an answer the router makes itself names the request too
    async with http.post(url, data=b"{", headers={"X-Request-Id": "broken-1"}) as r:
        assert (r.status, r.headers["x-request-id"]) == (400, "broken-1")


async def test_the_front_doors_root_and_admission_spans(
    receiver: Receiver, http: aiohttp.ClientSession
) -> None:
    """What the routes call: the root span of a request (one, however often asked for),
    and the admission span under it, from the time it began to queue."""
    tracing = Tracing(True)

    async def door(request: web.Request) -> web.Response:
        queued = time.time_ns()
        # the door's root, then the proxy's, which finds it there: none of its own
        with tracing.request(request, "chat"), tracing.request(request, "chat"):
            admitted = {"dprouter.tenant": "t1", "dprouter.outcome": "in"}
            tracing.admission(request, queued, admitted)
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", door)
    async with serving(app, health=False) as url:
        headers = {"traceparent": traceparent()}
        async with http.post(url + "/v1/chat/completions", headers=headers) as r:
            assert r.status == 200
    await tracing.stop()  # flushed
    root = one(receiver.of(TRACE), "POST /v1/chat/completions")
    assert root.parent == CLIENT_SPAN and root.attributes["dprouter.kind"] == "chat"
    admission = one(receiver.of(TRACE), "admission")
    assert admission.parent == root.id
    assert admission.attributes == {"dprouter.tenant": "t1", "dprouter.outcome": "in"}
    assert len(receiver.of(TRACE)) == 2


async def test_tracing_off_exports_nothing(
    receiver: Receiver,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    headers = {"traceparent": traceparent()}
    async with http.post(router.url + "/v1/completions", json=PROMPT, headers=headers) as r:
        assert r.status == 200
    await router.stop()  # what a router exports is flushed when it stops
    assert receiver.spans == []
    # the client's own trace still reaches the engine, untouched
    assert engine.received[-1].headers["traceparent"] == traceparent()


async def test_a_trace_sampled_out_records_nothing_and_tells_the_engine_so(
    receiver: Receiver,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """A client's trace not sampled (flags 00, the default sampler follows its parent):
    no span of it exported, and the engine gets the same trace, still not sampled, from
    the router's root; a sampled trace sent after it is recorded as before."""
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), tracing=True))
    out = {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-00"}
    for stream in (False, True):
        body = {**PROMPT, "stream": stream}
        async with http.post(router.url + "/v1/completions", json=body, headers=out) as r:
            assert r.status == 200
            await r.read()
    sent = [r.headers["traceparent"].split("-") for r in engine.received]
    assert [(t, flags) for _, t, _, flags in sent] == [(TRACE, "00")] * 2
    assert all(parent != CLIENT_SPAN for _, _, parent, _ in sent)  # the router's root
    later = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": traceparent(later)}
    async with http.post(router.url + "/v1/completions", json=PROMPT, headers=headers) as r:
        assert r.status == 200
        await r.read()
    await receiver.trace(later, {"POST /v1/completions", "decision", "attempt", "relay"})
    await router.stop()  # all it had is exported
    assert receiver.of(TRACE) == []
    assert parents(engine, later) == [one(receiver.of(later), "attempt").id]


OFF = """
import asyncio, sys
import aiohttp
from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig

async def main():
    cluster = SimCluster([EngineConfig()], "127.0.0.1")
    await cluster.start()
    router = Router(RouterConfig(workers=(WorkerSpec(cluster.servers[0].url),), port=0))
    await router.start()
    try:
        assert await router.settled(10)
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "p", "max_tokens": 2}
            headers = {"traceparent": "00-%s-00f067aa0ba902b7-01" % ("ab" * 16)}
            async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, r.status
    finally:
        await router.stop()
        await cluster.stop()
    door = ("opentelemetry", "jwt", "cryptography")
    print(sorted(m for m in sys.modules if m.split(".")[0] in door))

asyncio.run(main())
"""


async def test_the_door_off_imports_nothing_of_opentelemetry_or_pyjwt() -> None:
    """Neither tracing nor an issuer configured: their libraries are never loaded (PyJWT
    brings cryptography: ~10 MB a serving process)."""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OFF, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    assert out.decode().strip().splitlines()[-1] == "[]"


# `dprouter serve` in an interpreter where the modules under PREFIX are not installed: a
# finder ahead of the others says so for each, as the import system does for a missing one
WITHOUT = """
import sys
from importlib.abc import MetaPathFinder

PREFIX = sys.argv.pop(1)


class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == PREFIX or name.startswith(PREFIX + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
for name in [m for m in sys.modules if m == PREFIX or m.startswith(PREFIX + ".")]:
    del sys.modules[name]
from dprouter.cli import main

main()
"""


@pytest.mark.parametrize(
    "absent", ["opentelemetry", "opentelemetry.sdk", "opentelemetry.exporter.otlp"]
)
def test_tracing_without_opentelemetry_installed_says_to_install_the_extra(absent: str) -> None:
    """Without the ``tracing`` extra (or a part of it), ``--tracing`` is a usage error
    naming the extra, before anything starts, not a traceback."""
    argv = [sys.executable, "-c", WITHOUT, absent, "serve", "--tracing", "--port", "0"]
    done = subprocess.run(
        [*argv, "--worker", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "--tracing needs OpenTelemetry's SDK and OTLP exporter" in done.stderr
    assert "pip install 'dprouter[tracing]'" in done.stderr
    assert f"(no {absent}" in done.stderr
