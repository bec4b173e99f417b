"""A set of simulated engines started together, in-process."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from dataclasses import replace

from dprouter.core.service import Service
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig


def fleet(count: int, config: EngineConfig) -> list[EngineConfig]:
    """``count`` engines of one shape."""
    return [replace(config) for _ in range(count)]


class SimCluster(Service):
    """``async with SimCluster(configs) as cluster:`` starts every engine on loopback.

    With ``base_port`` 0 each engine binds a free port (``cluster.urls`` has the
    real ones); otherwise engine i listens on ``base_port + i``. ``api_key``: each
    answers 401 without it, as the engines' ``--api-key``; ``admin_key``: SGLang's
    ``--admin-api-key``; ``tls``: each serves HTTPS with that context (one that requires a
    client certificate, if it does).
    """

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        host: str = "127.0.0.1",
        base_port: int = 0,
        prefix: str = "engine",
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.servers = [
            SimServer(
                c,
                f"{prefix}-{i}",
                host,
                base_port + i if base_port else 0,
                api_key=api_key,
                tls=tls,
                admin_key=admin_key,
            )
            for i, c in enumerate(configs)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def __getitem__(self, index: int) -> SimServer:
        return self.servers[index]

    def __len__(self) -> int:
        return len(self.servers)

    async def start(self) -> None:
        try:
            for s in self.servers:
                await s.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers if s.started.is_set()))
