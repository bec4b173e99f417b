"""The ``dprouter`` command: a thin layer over the Python API."""

from __future__ import annotations

import click

from dprouter.bench.command import bench
from dprouter.demo import demo
from dprouter.serve import serve
from dprouter.sim.command import sim


@click.group()
@click.version_option(package_name="dprouter")
def main() -> None:
    """dprouter: route LLM requests to (worker, dp_rank) targets."""


main.add_command(bench)
main.add_command(demo)
main.add_command(serve)
main.add_command(sim)
