"""Run by an engine environment's own interpreter: a ``Router`` in this process, in front of
the engine at argv[1], one completion through it. Prints one JSON line: where dprouter
was imported from, the answer's status and the target that served it."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

import dprouter
from dprouter import Router, RouterConfig, WorkerSpec


async def main(engine: str) -> dict[str, object]:
    config = RouterConfig(workers=(WorkerSpec(engine),), port=0)
    async with Router(config) as router, aiohttp.ClientSession() as http:
        if not await router.settled(60):
            raise SystemExit("the engine was not discovered within 60 s")
        body = {"model": "tiny", "prompt": "hello from the engine's environment", "max_tokens": 4}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            await r.read()
            return {
                "imported_from": dprouter.__file__,
                "status": r.status,
                "target": r.headers.get("x-dprouter-target"),
                "ranks": len(router.registry.snapshot.pool()),
            }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
