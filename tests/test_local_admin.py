"""The router's own host is local: a router listening on a non-loopback address of its
host (as an RL framework starts it, on the node's address) takes admin calls from that
address without a token, as it does from loopback; a caller from another host, here a
network namespace of the test's own behind a veth pair, is still refused.

Loopback aliases (127.0.0.2) would prove nothing: they are loopback. The addresses are
read off the machine (psutil, as the router does, but not through the router's code); a
machine with none skips, except under CI=true, whose machines have one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil
import pytest

from dprouter.config import RouterConfig
from dprouter.core.host import REREAD, HostAddresses
from dprouter.core.net import url_of
from dprouter.server.trust import Trust
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, until

CI = os.environ.get("CI") == "true"
SGLANG_DP2 = EngineConfig(persona="sglang", dp_size=2, dp_attention=True)


def node_addresses() -> list[str]:
    """One address per family of this machine's interfaces that is neither loopback nor
    link-local: where a framework would start its router."""
    found: dict[int, str] = {}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(entry.address.split("%")[0])
            if not (address.is_loopback or address.is_link_local):
                found.setdefault(entry.family, str(address))
    if not found:
        if CI:
            pytest.fail("CI machines have a non-loopback address; this one lists none")
        pytest.skip("this machine has no non-loopback address to start the router on")
    return list(found.values())


def from_address(address: str) -> aiohttp.ClientSession:
    """A client whose connections leave from ``address`` (its source bound to it)."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30))


async def test_a_router_on_its_hosts_address_takes_registration_from_that_address(
    start_cluster: StartCluster, start_router: StartRouter
) -> None:
    for address in node_addresses():  # IPv4 and IPv6, where the machine has them
        (engine,) = (await start_cluster([SGLANG_DP2], host=address)).servers
        router = await start_router(RouterConfig(host=address))  # no token, no worker
        assert router.url == url_of(address, router.port)
        async with from_address(address) as client:
            async with client.post(router.url + "/workers?wait=5", json={"url": engine.url}) as r:
                assert r.status == 201, await r.text()
            async with client.get(router.url + "/workers") as r:
                (listed,) = (await r.json())["workers"]
            assert listed["url"] == engine.url and listed["is_healthy"]
            assert listed["dp_size"] == 2  # discovered: the engine answered the router
            body = {"text": "local", "sampling_params": {"max_new_tokens": 2}}
            ranks = set()
            for _ in range(4):
                async with client.post(router.url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    ranks.add(r.headers["x-sim-dp-rank"])
            assert ranks == {"0", "1"}  # routed to both ranks of the engine it registered


def test_the_start_up_line_names_loopback_this_hosts_addresses_and_admin_from() -> None:
    line = Trust(("203.0.113.0/24",)).exposure()  # what dprouter serve logs without a token
    assert "answers anyone on loopback, this host's own addresses (" in line
    assert all(address in line for address in node_addresses())
    assert "--admin-from 203.0.113.0/24 without one" in line


@dataclass(frozen=True)
class OtherHost:
    """A network namespace joined to this host by a veth pair: ``near`` is this host's
    end (its address one of this host's), ``far`` the other host's address."""

    name: str
    link: str
    near: str
    far: str
    spare: str  # an address of the same network, added to this host's end by a test

    def run(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def other_host() -> Iterator[OtherHost]:
    why = None
    if os.geteuid() != 0:
        why = "a network namespace needs root"
    elif shutil.which("ip") is None:
        why = "a network namespace needs iproute2's ip"
    if why is not None:
        if CI:
            pytest.fail(f"{why}: CI runs as root with iproute2")
        pytest.skip(why)
    # a /29 of the benchmarking range (RFC 2544) per process: two runs side by side
    # (several sessions share a machine) neither clash nor reach each other
    tag = os.getpid() % 16384
    base = ipaddress.ip_network("198.18.0.0/15")[tag * 8]
    host = OtherHost(f"dpr{tag}", f"dpr{tag}h", str(base + 1), str(base + 2), str(base + 5))
    try:
        ip("netns", "add", host.name)
        ip("link", "add", host.link, "type", "veth", "peer", "name", f"dpr{tag}n")
        ip("link", "set", f"dpr{tag}n", "netns", host.name)
        ip("addr", "add", f"{host.near}/29", "dev", host.link)
        ip("link", "set", host.link, "up")
        ip("-n", host.name, "addr", "add", f"{host.far}/29", "dev", f"dpr{tag}n")
        ip("-n", host.name, "link", "set", f"dpr{tag}n", "up")
        yield host
    finally:
        with suppress(subprocess.CalledProcessError):
            ip("link", "del", host.link)  # both ends go with it
        with suppress(subprocess.CalledProcessError):
            ip("netns", "del", host.name)


# what the other host runs: POST /workers, print the status and the answer
POST = """
import json, sys, urllib.error, urllib.request
request = urllib.request.Request(
    sys.argv[1] + "/workers", json.dumps({"url": sys.argv[2]}).encode(),
    {"Content-Type": "application/json"},
)
try:
    with urllib.request.urlopen(request, timeout=20) as r:
        print(json.dumps([r.status, json.loads(r.read())]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, json.loads(e.read())]))
"""


async def register_from(host: OtherHost, router: str, engine: str) -> tuple[int, Any]:
    process = await asyncio.create_subprocess_exec(
        *host.run(sys.executable, "-c", POST, router, engine),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    status, body = json.loads(out)
    return status, body


async def test_another_host_is_refused_and_a_new_address_of_this_host_is_taken(
    other_host: OtherHost, start_cluster: StartCluster, start_router: StartRouter
) -> None:
    host = other_host
    (engine,) = (await start_cluster([SGLANG_DP2], host=host.near)).servers
    router = await start_router(RouterConfig(host=host.near))
    status, body = await register_from(host, router.url, engine.url)
    assert status == 403, body
    assert f"not from {host.far}:" in body["error"]["message"]
    assert router.registry.workers == {}
    # the same caller, named in --admin-from, is taken: it was refused for its address alone
    named = await start_router(RouterConfig(host=host.near, admin_from=(f"{host.far}/32",)))
    status, body = await register_from(host, named.url, engine.url)
    assert status == 201, body
    assert [w.url for w in named.registry.workers.values()] == [engine.url]

    # an address this host gains after start is its own too, found within REREAD seconds
    stale = HostAddresses(reread=3600)
    assert stale.holds(ipaddress.ip_address(host.near))  # read now, before the new address
    add = await asyncio.create_subprocess_exec(
        "ip", "addr", "add", f"{host.spare}/32", "dev", host.link
    )
    assert await add.wait() == 0
    spare = ipaddress.ip_address(host.spare)
    assert not stale.holds(spare)  # within its bound it does not read the interfaces again
    assert HostAddresses(reread=0).holds(spare)
    statuses: list[int] = []  # 403 until the router reads its interfaces again
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REREAD + 5
    async with from_address(host.spare) as client:
        while not statuses or (statuses[-1] == 403 and loop.time() < deadline):
            if statuses:
                await asyncio.sleep(0.2)  # the pace of the poll, not a synchronisation
            async with client.post(router.url + "/workers", json={"url": engine.url}) as r:
                statuses.append(r.status)
    assert statuses[-1] == 201 and set(statuses) <= {403, 201}, statuses
    assert await until(lambda: [w.url for w in router.registry.workers.values()] == [engine.url])
