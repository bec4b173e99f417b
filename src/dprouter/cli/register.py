"""``dprouter register``: keep one engine registered in etcd while it is healthy.

Runs beside the engine until SIGTERM or SIGINT; the work is ``Registrar``'s.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import aiohttp
import click

from dprouter.core.errors import ConfigError
from dprouter.fleet.membership.etcd_client import Etcd
from dprouter.fleet.membership.registrar import Registrar
from dprouter.fleet.worker_spec import WorkerSpec, parse_worker

log = logging.getLogger("dprouter")


def endpoints(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]``, each with or without ``http://``."""
    found = [e if "://" in e else "http://" + e for e in (p.strip() for p in text.split(",")) if e]
    if not found:
        raise ValueError("--etcd needs HOST:PORT")
    return found


async def main(etcd_urls: list[str], prefix: str, spec: WorkerSpec, ttl: int, every: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        await Registrar(Etcd(etcd_urls, session), prefix, spec, ttl, every).run(stop)


@click.command()
@click.option("--etcd", "etcd_urls", required=True, metavar="HOST:PORT[,HOST:PORT...]")
@click.option("--prefix", required=True, help="The key prefix the routers' --discovery names.")
@click.option(
    "--worker",
    required=True,
    metavar="URL[,key=value...]",
    help="The engine, as dprouter serve --worker takes it (role=prefill|decode for P/D).",
)
@click.option(
    "--ttl",
    type=click.IntRange(min=2),
    default=10,
    show_default=True,
    help="Seconds the key outlives this process if it is killed.",
)
@click.option(
    "--health-interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between health checks (two failures in a row deregister).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
def register(
    etcd_urls: str, prefix: str, worker: str, ttl: int, health_interval: float, log_level: str
) -> None:
    """Register an engine in etcd for dprouter serve --discovery, while it is healthy."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        spec = parse_worker(worker)
        urls = endpoints(etcd_urls)
    except (ConfigError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(main(urls, prefix, spec, ttl, health_interval))
