"""RL rollouts with a weight update every other step: what the update costs.

Each step sends a batch of SGLang ``/generate`` rollouts at once and ends when the last
is answered. Every other step, once half of the batch is answered, the framework runs
miles' cycle -- pause (retract), flush (retried), update from disk with a new version,
continue -- with the rest in flight. Measured: the time from the pause until every
engine serves the new version (and is running again), requests lost (an answer other
than 200, or none: must be 0), answers to requests sent after the cycle that carry an
older version (must be 0), and the step time against the same router with no updates.
The cycle goes through the router (dprouter; smg 1.13 with ``--enable-rl``, which fans
the same calls out), or engine by engine, as miles sends it today. Two dprouter replicas
over etcd take the cycle through replica A while the rollouts go through both; replica
B's RL listing is polled meanwhile for when it holds every engine.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in
from dprouter.bench.harness.replicas import etcd_replicas
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig, RankLimits

SCALE = 0.02  # wall seconds per simulated second
LOAD = 0.2  # wall seconds one engine takes to load the weights
ENGINE = EngineConfig(
    persona="sglang",
    dp_size=2,
    dp_attention=True,
    limits=RankLimits(max_running=32),
    time_scale=SCALE,
)
REPLICAS = "dprouter, 2 replicas over etcd"
CYCLE: tuple[tuple[str, str, dict[str, Any] | None], ...] = (
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("GET", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "sim-model"}),
    ("POST", "/continue_generation", {}),
)


@dataclass
class Tally:
    steps: list[float] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)
    lost: int = 0
    stale: int = 0  # sent after a cycle ended, answered on older weights
    answered: int = 0
    refused: list[str] = field(default_factory=list)  # cycle calls the router did not serve
    # two replicas: when replica B held every engine, from the pause sent / from A's answer
    held_after_pause: list[float] = field(default_factory=list)
    held_after_answer: list[float] = field(default_factory=list)


async def rollout(
    http: aiohttp.ClientSession, url: str, rid: str, tokens: int, tally: Tally
) -> str | None:
    """One rollout; the weights' version that answered it (None: lost)."""
    body = {"text": f"rollout {rid}", "rid": rid, "sampling_params": {"max_new_tokens": tokens}}
    try:
        async with http.post(url + "/generate", json=body) as r:
            answer = await r.json(content_type=None)
            if r.status != 200:
                tally.lost += 1
                return None
    except (aiohttp.ClientError, TimeoutError):
        tally.lost += 1
        return None
    tally.answered += 1
    return str(answer["meta_info"].get("weight_version"))


async def cycle(
    http: aiohttp.ClientSession, targets: list[str], version: str, tally: Tally, query: str = ""
) -> float:
    """miles' cycle, sent to each of ``targets`` (the router, or every engine); smg takes
    it under ``/v1/rl/engine`` with a worker selector (``query``). When the pause was
    answered."""
    answered = math.nan
    for method, path, body in CYCLE:
        sent = {**body, "weight_version": version} if body and path.endswith("_disk") else body
        for _ in range(120):
            answers = await asyncio.gather(
                *(http.request(method, t + path + query, json=sent) for t in targets)
            )
            statuses = [a.status for a in answers]
            for a in answers:
                a.release()
            if path != "/flush_cache" or all(s == 200 for s in statuses):
                break
            await asyncio.sleep(0.05)  # miles retries the flush while the engine refuses
        said = f"{path} {statuses[0]}"
        if any(s != 200 for s in statuses) and said not in tally.refused:
            tally.refused.append(said)
        if math.isnan(answered):
            answered = time.monotonic()
    return answered


async def held_at(http: aiohttp.ClientSession, url: str) -> float:
    """When the router at ``url`` holds every worker (its RL listing, polled every 2 ms;
    NaN: not within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        async with http.get(url + "/v1/rl/workers") as r:
            listing = await r.json()
        if listing["workers"] and all(w["held"] for w in listing["workers"]):
            return time.monotonic()
        await asyncio.sleep(0.002)
    return math.nan


async def served(cluster: SimCluster, version: str) -> bool:
    """Every engine runs again, on ``version`` (False: not within 30 s)."""
    for _ in range(6000):
        if all(s.weights.version == version and s.weights.paused is None for s in cluster.servers):
            return True
        await asyncio.sleep(0.005)
    return False


async def once(
    cluster: SimCluster,
    urls: list[str],
    steps: int,
    batch: int,
    direct: bool,
    updates: bool,
    control: tuple[str, str] = ("", ""),
    tokens: tuple[int, int] = (40, 400),
) -> Tally:
    """Rollouts through each of ``urls`` in turn, the cycle through the first (``control``:
    where the router takes its calls, a path prefix and a query); a second is watched for
    when it holds the engines."""
    tally = Tally()
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for step in range(steps):
            started = time.monotonic()
            version = f"{step}-{direct}-{updates}"
            tasks = [
                asyncio.create_task(
                    rollout(http, urls[i % len(urls)], f"s{step}r{i}", rng.randint(*tokens), tally)
                )
                for i in range(batch)
            ]
            if updates and step % 2 == 1:
                for done, next_one in enumerate(asyncio.as_completed(tasks), 1):
                    await next_one
                    if done >= batch // 2:
                        break
                paused = time.monotonic()
                prefix, query = control
                targets = cluster.urls if direct else [urls[0] + prefix]
                watch = [asyncio.create_task(held_at(http, u)) for u in urls[1:2]]
                answered = await cycle(http, targets, version, tally, "" if direct else query)
                for held in await asyncio.gather(*watch):
                    tally.held_after_pause.append(held - paused)
                    tally.held_after_answer.append(held - answered)
                if not await served(cluster, version):
                    tally.refused.append("engines never on the new version")
                    for s in cluster.servers:  # left paused: let the batch finish
                        s.weights.resume()
                    await asyncio.gather(*tasks)
                    tally.steps.append(time.monotonic() - started)
                    continue
                tally.updates.append(time.monotonic() - paused)
                after = [
                    asyncio.create_task(
                        rollout(http, urls[i % len(urls)], f"s{step}a{i}", 4, tally)
                    )
                    for i in range(4)
                ]
                said = await asyncio.gather(*after)
                tally.stale += sum(v != version for v in said if v is not None)
            await asyncio.gather(*tasks)
            tally.steps.append(time.monotonic() - started)
    return tally


async def measure(quick: bool) -> dict[str, dict[str, Any]]:
    steps, batch = (4, 32) if quick else (10, 64)
    tokens = (40, 400) if quick else (200, 2000)  # rollouts of up to 2000 tokens: ~1 s steps
    found: dict[str, dict[str, Any]] = {}
    engines = 2 if quick else 4
    async with SimCluster([replace(ENGINE)] * engines) as cluster:
        for server in cluster.servers:
            server.weights.update_time = LOAD
        runs: list[tuple[str, Proc, str, tuple[str, str]]] = []
        argv = [*DPROUTER, "serve", "--policy", "round_robin", "--port", "0"]
        for u in cluster.urls:
            argv += ["--worker", u]
        proc = Proc(argv)
        runs.append(("dprouter", proc, url_in(await proc.start(r"dprouter on http://")), ("", "")))
        if peer_routers.ensure() is None:
            smg, smg_url = await peer_routers.start_on_free_port(
                lambda port: peer_routers.router(
                    "smg", cluster.urls, port, dp_aware=True, extra=("--enable-rl",)
                ),
                model="sim-model",
            )
            # smg fans a call out under /v1/rl/engine/{path}, to the workers a selector names
            smg_control = ("/v1/rl/engine", "?selector=worker_type%3Dregular")
            runs.append(("smg 1.13 --enable-rl", smg, smg_url, smg_control))
        try:
            for name, _, url, control in runs:
                modes = [("none", False, False), ("through the router", False, True)]
                if name == "dprouter":
                    modes.append(("engine by engine", True, True))
                for mode, direct, updates in modes:
                    tally = await once(
                        cluster, [url], steps, batch, direct, updates, control, tokens
                    )
                    found[f"{name} | {mode}"] = tally.__dict__
        finally:
            for _, p, _, _ in runs:
                await p.stop()
        # A takes the cycle; the rollouts go through A and B in turn
        async with etcd_replicas(cluster.urls, 2, "--policy", "round_robin") as replicas:
            for mode, updates in (("none", False), ("through replica A", True)):
                tally = await once(cluster, replicas, steps, batch, False, updates, tokens=tokens)
                found[f"{REPLICAS} | {mode}"] = tally.__dict__
    return found


def run(quick: bool, out: Path) -> Result:
    found = asyncio.run(measure(quick))
    rows: list[list[Cell]] = []
    checks: dict[str, bool] = {}
    for key, t in found.items():
        name, mode = key.split(" | ")
        base = statistics.mean(found[f"{name} | none"]["steps"])
        step = statistics.mean(t["steps"])
        update = statistics.median(t["updates"]) if t["updates"] else None
        rows.append(
            [
                name,
                mode,
                step,
                step / base,
                update,
                t["lost"],
                t["stale"],
                ", ".join(t["refused"]) or "-",
            ]
        )
        if name.startswith("dprouter"):
            checks[f"{name}, updates {mode}: no request lost"] = t["lost"] == 0
            checks[f"{name}, updates {mode}: no stale answer after a cycle"] = t["stale"] == 0
    two = found[f"{REPLICAS} | through replica A"]
    sent, answered = two["held_after_pause"], two["held_after_answer"]
    checks[f"{REPLICAS}: replica B held every engine after each pause"] = bool(sent) and not any(
        math.isnan(x) for x in sent
    )
    held = [
        [
            "replica B holds every engine",
            len(sent),
            statistics.median(sent) * 1e3,
            max(sent) * 1e3,
            statistics.median(answered) * 1e3,
            max(answered) * 1e3,
        ]
    ]
    return Result(
        scenario="weight-updates",
        title="Weight updates during rollouts: time to the new version, requests lost",
        method=(
            __doc__.split("\n\n", 1)[1].replace("\n", " ")
            + f" Simulated SGLang engines (attention DP over 2 ranks) at {SCALE} wall s per "
            f"simulated s in the bench process, each taking {LOAD} s to load weights; each "
            "router its own process; smg takes the cycle under /v1/rl/engine/{path}."
        ),
        tables=[
            Table(
                [
                    "router",
                    "weight updates",
                    "mean step s",
                    "step / none",
                    "pause to new version s",
                    "lost",
                    "stale",
                    "calls not served",
                ],
                rows,
            ),
            Table(
                [
                    "two replicas",
                    "pauses",
                    "after the pause sent, median ms",
                    "max ms",
                    "after A's answer, median ms",
                    "max ms",
                ],
                held,
                "The pause through replica A reaching replica B (its RL listing polled "
                "every 2 ms; negative: before A answered)",
            ),
        ],
        verdict="Same engines, same seeded batches; an update every other step, mid-step.",
        checks=checks,
        data=found,
    )
