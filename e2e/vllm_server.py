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

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Self

HOST = "127.0.0.1"
PORT_RANGE = (20000, 30000)  # inclusive lower, exclusive upper
INTERNAL_PORT_BLOCK = 32  # ports vLLM may take from VLLM_PORT upward
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 256 * 1024 * 1024
E2E_DIR = Path(__file__).resolve().parent
LAUNCHER = E2E_DIR / "vllm_launcher.py"
PREPARE_HINT = "run bash e2e/prepare.sh"


def home() -> Path:
    """Root of the prepared environment: $DPROUTER_VLLM_HOME or ~/.cache/dprouter-vllm."""
    env = os.environ.get("DPROUTER_VLLM_HOME")
    return Path(env) if env else Path.home() / ".cache" / "dprouter-vllm"


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
    if len(_allowed_cpus()) < 1:
        return "no CPU available to bind vLLM to"
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(block: int = 1, avoid: range | None = None) -> int:
    """A free port in 20000-30000 (or the first of `block` consecutive free ports).

    Tries binds from a random starting point, so that two callers that have not
    yet started their servers are unlikely to get the same answer.
    """
    lo, hi = PORT_RANGE
    span = hi - lo - block
    start = random.randrange(span)
    for i in range(span):
        port = lo + (start + i) % span
        ports = range(port, port + block)
        if avoid is not None and (ports.start < avoid.stop and avoid.start < ports.stop):
            continue
        if all(_port_is_free(p) for p in ports):
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


class VllmServer:
    """One `vllm serve` of the tiny model on 127.0.0.1:port (dp_size 1 or 2 engines).

    cpus: VLLM_CPU_OMP_THREADS_BIND value. Default: dp_size 2 -> "0|1" (one core per
    rank); dp_size 1 -> one core, taken round-robin over the allowed CPUs, so two
    single-engine servers started one after the other use different cores.
    """

    _next_cpu = 0

    def __init__(
        self,
        port: int,
        dp_size: int = 1,
        name: str = "tiny",
        *,
        cpus: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        self.dp_size = dp_size
        self.name = name
        self.cpus = cpus if cpus is not None else self._default_cpus(dp_size)
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.ready_seconds: float | None = None
        self._log_file: IO[bytes] | None = None
        self._tmp: Path | None = None
        self._started_at = 0.0

    @classmethod
    def _default_cpus(cls, dp_size: int) -> str:
        cpus = _allowed_cpus()
        if dp_size == 1:
            cpu = cpus[cls._next_cpu % len(cpus)]
            cls._next_cpu += 1
            return str(cpu)
        # One core per rank; when ranks outnumber cores, share them.
        return "|".join(str(cpus[r % len(cpus)]) for r in range(dp_size))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

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
        if self.dp_size > 1:
            # Only read by vLLM's automatic binding; set as measured for DP=2 (with an
            # explicit bind it just logs a warning, so single engines leave it out).
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env.pop("PYTHONPATH", None)  # never leak the test venv into vLLM's
        return env

    def start(self) -> Self:
        if self.proc is not None:
            raise RuntimeError("server already started")
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        logs = home() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (home() / "cache").mkdir(parents=True, exist_ok=True)
        # Short path: ZMQ ipc:// socket paths must stay under ~107 bytes.
        self._tmp = Path(tempfile.mkdtemp(prefix=f"vllm{self.port}-"))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = logs / f"vllm-{self.name}-dp{self.dp_size}-{self.port}-{stamp}.log"
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        env = self.environment(self._tmp)
        self._log_file.write(
            f"# cpus={self.cpus} VLLM_PORT={env['VLLM_PORT']} cmd={self.command()}\n".encode()
        )
        self._log_file.flush()
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(self._tmp),
            start_new_session=True,  # own process group: stop() kills all of it
        )
        return self

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 180) -> float:
        """Poll GET /health until 200; return seconds since start().

        Raises RuntimeError with the log tail if the server exits or times out.
        """
        if self.proc is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server on port {self.port} exited with {code} before ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy():
                self.ready_seconds = time.monotonic() - self._started_at
                return self.ready_seconds
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server on port {self.port} not ready after {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """Die at once, as a crashed machine would: SIGKILL the whole process group."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
        self.stop(timeout=5)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left."""
        if self.proc is not None:
            if self.proc.poll() is None or self._group_alive():
                self._signal_group(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    self.proc.poll()
                    if not self._group_alive():
                        break
                    time.sleep(0.1)
                else:
                    self._signal_group(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
                # Children may linger briefly after SIGKILL; give them a moment.
                deadline = time.monotonic() + 5
                while self._group_alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"VllmServer(port={self.port}, dp={self.dp_size}, cpus={self.cpus!r}, pid={pid})"


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
    server = VllmServer(args.port or free_port(), args.dp, args.name, cpus=args.cpus)
    with server:
        print(f"starting {server!r}, log {server.log_path}", flush=True)
        try:
            print(
                f"ready in {server.wait_ready():.1f} s at {server.url} (Ctrl-C stops)", flush=True
            )
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
