"""Our load generator, checked against one we did not write: inference-perf.

The same streamed load, shaped like scenario 3 -- constant rate, 8 shared
system prompts of 200 tokens, 50-token questions, 32 output tokens -- through
dprouter (cache_aware) to simulated engines, measured once by
inference-perf 0.7.0 (its own Python 3.12 environment, a locally built
tokenizer, no model hub) and once by ours; TTFT and throughput should agree
within noise.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

from dprouter.bench.harness import peer_routers
from dprouter.bench.harness.procs import DPROUTER, Proc, url_in, urls_in
from dprouter.bench.report.results import Cell, Result, Table
from dprouter.sim.offline.report import percentiles

PIN = "inference-perf==0.7.0"
RATE, OUTPUT = 8.0, 32
GROUPS, SYSTEM, QUESTION = 8, 200, 50  # scenario 3's shape: shared system prompts
TOKENIZER = Path(__file__).resolve().parents[1] / "harness" / "ipf" / "make_tokenizer.py"


def home() -> Path:
    return peer_routers.bench_home() / "inference-perf"


def python312() -> str | None:
    """A Python 3.12 that really runs (a pyenv shim on PATH may not)."""
    pyenv = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python")))
    for candidate in [*pyenv, shutil.which("python3.12")]:
        if candidate is None:
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if probe.returncode == 0 and "(3, 12)" in probe.stdout:
            return candidate
    return None


def prepare() -> str | None:
    """The environment and tokenizer; None when ready, else why not."""
    venv, tokenizer = home() / "venv", home() / "tokenizer"
    if (venv / "bin" / "inference-perf").exists() and (tokenizer / "tokenizer.json").exists():
        return None
    py = python312()
    if py is None:
        return "inference-perf needs Python 3.12, which this machine lacks"
    try:
        subprocess.run([py, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "--quiet", PIN],
            check=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )
        subprocess.run(
            [str(venv / "bin" / "python"), str(TOKENIZER), str(tokenizer)],
            check=True,
            timeout=120,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"inference-perf could not be prepared: {exc}"
    return None


def config(url: str, out: Path, seconds: int) -> str:
    return json.dumps(
        {  # JSON is YAML
            "api": {"type": "completion", "streaming": True},
            "server": {
                "type": "vllm",
                "model_name": "sim-model",
                "base_url": url,
                "ignore_eos": True,
            },
            "tokenizer": {"pretrained_model_name_or_path": str(home() / "tokenizer")},
            "data": {
                "type": "shared_prefix",
                "shared_prefix": {
                    "num_groups": GROUPS,
                    "num_prompts_per_group": 20,
                    "system_prompt_len": SYSTEM,
                    "question_len": QUESTION,
                    "output_len": OUTPUT,
                    "seed": 1,
                },
            },
            "load": {
                "type": "constant",
                "stages": [{"rate": RATE, "duration": seconds}],
                "num_workers": 1,
                "worker_max_concurrency": 100,
                "request_timeout": 30,
                "base_seed": 1234,
            },
            "report": {
                "request_lifecycle": {"summary": True, "per_stage": False, "per_request": False},
                "prometheus": None,
            },
            "storage": {"local_storage": {"path": str(out)}},
        }
    )


async def theirs(url: str, out: Path, seconds: int) -> dict[str, float]:
    shutil.rmtree(out / "inference-perf", ignore_errors=True)  # no stale report read back
    path = out / "inference-perf.yml"
    path.write_text(config(url, out / "inference-perf", seconds))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
    }
    log = out / "inference-perf.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            str(home() / "venv" / "bin" / "inference-perf"),
            "--config_file",
            str(path),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(out),
        )
        await asyncio.wait_for(proc.wait(), seconds * 6 + 60)
    summary = out / "inference-perf" / "summary_lifecycle_metrics.json"
    if not summary.exists():  # every request failed, or it did not start: say why
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(
            f"inference-perf wrote no summary (exit {proc.returncode}):\n" + "\n".join(tail)
        )
    data = json.loads(summary.read_text())
    ok, ttft = data["successes"], data["successes"]["latency"]["time_to_first_token"]
    return {
        "ttft_p50": ttft["median"],
        "ttft_p99": ttft["p99"],
        "count": ok["count"],
        "req_s": ok["throughput"]["requests_per_sec"],
        "tok_s": ok["throughput"]["output_tokens_per_sec"],
        "failed": data["failures"]["count"],
    }


async def ours(url: str, seconds: int) -> dict[str, float]:
    rng = random.Random(1234)
    systems = [
        " ".join(f"s{g}x{rng.getrandbits(16)}" for _ in range(SYSTEM)) for g in range(GROUPS)
    ]
    ttfts: list[float] = []
    failed = 0
    start = time.perf_counter()
    ends: list[float] = []

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        question = " ".join(f"w{rng.getrandbits(16)}" for _ in range(QUESTION))
        prompt = systems[rng.randrange(GROUPS)] + " " + question
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": OUTPUT, "stream": True}
        t0 = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                failed += 1
                return
            await r.content.readuntil(b"\n\n")  # the first content event
            ttfts.append(time.perf_counter() - t0)
            await r.read()
        ends.append(time.perf_counter())

    async with aiohttp.ClientSession() as session:
        tasks = []
        for i in range(int(RATE * seconds)):
            await asyncio.sleep(max(0.0, start + i / RATE - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    span = max(ends) - start
    p = percentiles(ttfts)
    return {
        "ttft_p50": p.p50,
        "ttft_p99": p.p99,
        "count": len(ends),
        "req_s": len(ends) / span,
        "tok_s": len(ends) * OUTPUT / span,
        "failed": failed,
    }


async def measure(out: Path, seconds: int) -> dict[str, dict[str, float]]:
    sim = Proc([*DPROUTER, "sim", "--engines", "2", "--dp-size", "2", "--port", "0"])
    router: Proc | None = None
    try:
        await sim.start("ready")
        workers = [a for u in urls_in(sim.lines, "vllm-") for a in ("--worker", u)]
        router = Proc([*DPROUTER, "serve", "--port", "0", *workers])
        url = url_in(await router.start(r"dprouter on http://"))
        await peer_routers.until_serving(url, model="sim-model", proc=router)
        return {
            "inference-perf": await theirs(url, out, seconds),
            "dprouter bench": await ours(url, seconds),
        }
    finally:
        if router is not None:
            await router.stop()
        await sim.stop()


def run(quick: bool, out: Path) -> Result:
    reason = prepare()
    columns = ["load generator", "TTFT p50 ms", "TTFT p99 ms", "req/s", "output tok/s", "failed"]
    if reason is not None:
        return Result(
            "crosscheck",
            "Cross-check: an independent load generator",
            reason,
            [Table(columns, [])],
            f"Not run: {reason}.",
        )
    work = out.resolve() / "crosscheck"  # inference-perf runs there: no relative paths
    work.mkdir(parents=True, exist_ok=True)
    seconds = 10 if quick else 20
    found = asyncio.run(measure(work, seconds))
    rows: list[list[Cell]] = [
        [name, m["ttft_p50"] * 1e3, m["ttft_p99"] * 1e3, m["req_s"], m["tok_s"], int(m["failed"])]
        for name, m in found.items()
    ]
    a, b = found["inference-perf"], found["dprouter bench"]
    gap = abs(a["ttft_p50"] - b["ttft_p50"]) / max(a["ttft_p50"], 1e-9)
    agree = gap < 0.35 and abs(a["req_s"] - b["req_s"]) / a["req_s"] < 0.1
    return Result(
        scenario="crosscheck",
        title="Cross-check: inference-perf and our load generator on the same load",
        method=(
            f"dprouter in front of 2 simulated vLLM engines x DP2; {RATE:.0f} streamed "
            f"requests/s for {seconds} s, {GROUPS} shared {SYSTEM}-token system prompts, "
            f"{QUESTION}-token questions, {OUTPUT} output tokens, policy cache_aware; "
            "inference-perf 0.7.0 (a Python 3.12 environment of its own, local word-level "
            "tokenizer), then our generator with the same shape. TTFT: to the first event."
        ),
        tables=[Table(columns, rows)],
        verdict=(
            f"TTFT p50 {a['ttft_p50'] * 1e3:.1f} ms (inference-perf) vs "
            f"{b['ttft_p50'] * 1e3:.1f} ms (ours), throughput {a['req_s']:.2f} vs "
            f"{b['req_s']:.2f} req/s: "
            + ("they agree within noise." if agree else "they DISAGREE (see table).")
        ),
        checks={"TTFT p50 within 35% and throughput within 10%": agree},
        data=found,
    )
