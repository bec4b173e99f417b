"""Start and stop a real vLLM (CPU) server for end-to-end tests.

Standard library only: the test suite imports this from the project's own
virtual environment, while vLLM runs from the separate environment that
`bash e2e/prepare.sh` builds under home() (default ~/.cache/dprouter-vllm).

    from e2e.vllm_server import VllmServer, available, free_port

    reason = available()          # None when prepared, else why not
    with VllmServer(free_port(), dp_size=2) as srv:
        srv.wait_ready()
        ...  # talk to srv.url (OpenAI API, /metrics, X-data-parallel-rank header)

Each server runs in its own process group with its own temporary cache/IPC folder
and its own block of internal ports (VLLM_PORT), all on 127.0.0.1 and in
20000-30000, and logs to home()/logs/.
"""

from __future__ import annotations

import os
from pathlib import Path

from e2e.engine_process import (
    HOST,
    EngineProcess,
    PortRange,
    allowed_cpus,
    core_per_rank,
    prepared_home,
)

PORT_RANGE = (20000, 30000)  # inclusive lower, exclusive upper
INTERNAL_PORT_BLOCK = 32  # ports vLLM may take from VLLM_PORT upward
MAX_MODEL_LEN = 2048  # the model's positions: room for a long decode, a wide window to watch
KV_CACHE_BYTES = 256 * 1024 * 1024
E2E_DIR = Path(__file__).resolve().parent
LAUNCHER = E2E_DIR / "vllm_launcher.py"
PREPARE_HINT = "run bash e2e/prepare.sh"


def home() -> Path:
    """Root of the prepared environment: $DPROUTER_VLLM_HOME or ~/.cache/dprouter-vllm."""
    return prepared_home("DPROUTER_VLLM_HOME", "dprouter-vllm")


def venv_python() -> Path:
    return home() / "venv" / "bin" / "python"


def model_dir() -> Path:
    return home() / "model"


def available() -> str | None:
    """None when a server can be started, else a reason to skip."""
    if not LAUNCHER.is_file():
        return f"vLLM CPU launcher missing: {LAUNCHER}"
    if not (home() / "venv" / ".dprouter-installed").is_file() or not venv_python().exists():
        return f"vLLM CPU environment not prepared ({home()}): {PREPARE_HINT}"
    if not (model_dir() / ".dprouter-built").is_file():
        return f"vLLM CPU tiny model not built ({model_dir()}): {PREPARE_HINT}"
    if len(allowed_cpus()) < 1:
        return "no CPU available to bind vLLM to"
    return None


_ports = PortRange(*PORT_RANGE)


def free_port(block: int = 1, avoid: range | None = None) -> int:
    """A free port in 20000-30000 (or the first of `block` consecutive free ports)."""
    return _ports.free_port(block, avoid)


class VllmServer(EngineProcess):
    """One `vllm serve` of the tiny model on 127.0.0.1:port (dp_size 1 or 2 engines).

    cpus: VLLM_CPU_OMP_THREADS_BIND value. Default: dp_size 2 -> "0|1" (one core per
    rank); dp_size 1 -> one core, taken round-robin over the allowed CPUs, so two
    single-engine servers started one after the other use different cores.
    """

    engine = "vLLM"
    tmp_prefix = "vllm"
    health_timeout = 2
    _next_cpu = 0

    def __init__(
        self,
        port: int,
        dp_size: int = 1,
        name: str = "tiny",
        *,
        cpus: str | None = None,
        extra_args: tuple[str, ...] = (),
        dev_mode: bool = False,
    ) -> None:
        super().__init__(port)
        self.dev_mode = dev_mode  # VLLM_SERVER_DEV_MODE=1: its RL routes (pause, versions...)
        self.dp_size = dp_size
        self.name = name
        self.cpus = cpus if cpus is not None else self._default_cpus(dp_size)
        self.extra_args = extra_args

    @classmethod
    def _default_cpus(cls, dp_size: int) -> str:
        if dp_size == 1:
            cpus = allowed_cpus()
            cpu = cpus[cls._next_cpu % len(cpus)]
            cls._next_cpu += 1
            return str(cpu)
        return core_per_rank(dp_size)

    def _home(self) -> Path:
        return home()

    def _unavailable(self) -> str | None:
        return available()

    def _log_name(self) -> str:
        return f"vllm-{self.name}-dp{self.dp_size}"

    def _log_header(self, env: dict[str, str]) -> str:
        return f"cpus={self.cpus} VLLM_PORT={env['VLLM_PORT']}"

    def _repr_fields(self) -> dict[str, object]:
        return {"port": self.port, "dp": self.dp_size, "cpus": self.cpus}

    def command(self) -> list[str]:
        cmd = [
            str(venv_python()),
            str(LAUNCHER),
            "serve",
            str(model_dir()),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--served-model-name",
            self.name,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enforce-eager",
            # bf16 takes vLLM's AMX attention where the CPU has AMX tiles, and on one such
            # machine (Xeon model 207) vllm-cpu 0.32.0's worker died silently at the first
            # forward; float32 takes the vector kernels everywhere, and routing does not care
            "--dtype",
            "float32",
        ]
        if self.dp_size > 1:
            cmd += ["--data-parallel-size", str(self.dp_size), "--api-server-count", "1"]
        return cmd + list(self.extra_args)

    def environment(self, tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        internal = free_port(INTERNAL_PORT_BLOCK, avoid=range(self.port, self.port + 1))
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_ENABLE_RESPONSES_API_STORE="1",  # GET /v1/responses/{id} finds stored ones
            VLLM_HOST_IP=HOST,
            VLLM_PORT=str(internal),
            VLLM_CPU_OMP_THREADS_BIND=self.cpus,
            HF_HOME=str(home() / "cache" / "hf"),
            XDG_CACHE_HOME=str(tmp / "xdg"),
            VLLM_CACHE_ROOT=str(tmp / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
            TMPDIR=str(tmp),
            VLLM_RPC_BASE_PATH=str(tmp),
            PYTHONUNBUFFERED="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.dp_size > 1:
            # Only read by vLLM's automatic binding; set as measured for DP=2 (with an
            # explicit bind it just logs a warning, so single engines leave it out).
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env.pop("PYTHONPATH", None)  # never leak the test venv into vLLM's
        return env


def main(argv: list[str] | None = None) -> int:
    """Run one server by hand until Ctrl-C: python3 -m e2e.vllm_server --dp 2 --port 28000."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m e2e.vllm_server")
    parser.add_argument("--port", type=int, default=0, help="default: a free port in 20000-30000")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (1 or 2)")
    parser.add_argument("--name", default="tiny", help="served model name")
    parser.add_argument("--cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND value")
    args = parser.parse_args(argv)
    reason = available()
    if reason is not None:
        print(reason)
        return 1
    return VllmServer(args.port or free_port(), args.dp, args.name, cpus=args.cpus).run_by_hand()


if __name__ == "__main__":
    raise SystemExit(main())
