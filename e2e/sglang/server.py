"""Start and stop a real SGLang (CPU) server for end-to-end tests.

Standard library only: the test suite imports this from the project's own
virtual environment, while SGLang runs from the separate environment that
`bash e2e/sglang/prepare.sh` builds under home() (default
~/.cache/dprouter-sglang).

    from e2e.sglang.server import SglangServer, available, free_port

    reason = available()          # None when prepared, else why not
    with SglangServer(free_port(), dp_size=2) as srv:              # 2 DP replicas
        srv.wait_ready()
        ...  # srv.url: /generate, /v1/completions, /server_info, /v1/loads
    with SglangServer(free_port(), attn_dp_size=2, model="qwen3") as srv:
        ...  # attention DP: --tp-size 2 --attn-dp-size 2

Each server runs in its own process group with its own TMPDIR (SGLang's ipc://
sockets live there), gets its internal TCP ports explicitly where SGLang lets us
choose them (see _choose_internal_ports()), and logs to home()/logs/.  HTTP, ZMQ
and gloo sockets listen on 127.0.0.1; the one exception is torch.distributed's
TCPStore (one per rank group, on the NCCL or dist-init port), which torch binds
on all interfaces whatever host it is given.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

from e2e.engine_process import (
    HOST,
    EngineProcess,
    PortRange,
    allowed_cpus,
    core_per_rank,
    prepared_home,
)

# Ports we hand out: above the range where SGLang picks its own NCCL/TCPStore
# ports (22000-29999, get_free_port_below_ephemeral) and below the kernel's
# ephemeral range (32768+ by default, where gloo's sockets land), so that what
# we choose and what SGLang or the kernel choose never meet.
PORT_RANGE = (30000, 32700)  # inclusive lower, exclusive upper
DIST_INIT_BLOCK = 8  # --dist-init-addr D takes D..D+6 (TCPStore + 6 ZMQ ports)
MAX_TOTAL_TOKENS = 4096
MODELS = ("llama", "qwen3")
SGLANG_DIR = Path(__file__).resolve().parent  # holds the sgl_kernel stand-in
PREPARE_HINT = "run bash e2e/sglang/prepare.sh"


def home() -> Path:
    """Root of the prepared environment: $DPROUTER_SGLANG_HOME or ~/.cache/dprouter-sglang."""
    return prepared_home("DPROUTER_SGLANG_HOME", "dprouter-sglang")


def venv_python() -> Path:
    return home() / "venv" / "bin" / "python"


def model_dir(model: str = "llama") -> Path:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, not {model!r}")
    return home() / f"model-{model}"


def available() -> str | None:
    """None when a server can be started, else a reason to skip."""
    if not (SGLANG_DIR / "sgl_kernel" / "__init__.py").is_file():
        return f"sgl_kernel stand-in missing: {SGLANG_DIR / 'sgl_kernel'}"
    venv = home() / "venv"
    if not (venv / ".dprouter-installed").is_file() or not venv_python().exists():
        return f"SGLang CPU environment not prepared ({home()}): {PREPARE_HINT}"
    if not (venv / ".dprouter-patched").is_file():
        return f"SGLang CPU fixes not applied ({venv}): {PREPARE_HINT}"
    for model in MODELS:
        if not (model_dir(model) / ".dprouter-built").is_file():
            return f"SGLang tiny model not built ({model_dir(model)}): {PREPARE_HINT}"
    return None


# SGLang checks its own ports on 0.0.0.0 and on 127.0.0.1; do the same.  Never
# repeat one of the last 512 ports handed out: servers chosen but not yet started
# (and their internal ports) must not get the same answer.
_ports = PortRange(*PORT_RANGE, hosts=("0.0.0.0", HOST), remember=512)


def free_port(block: int = 1, avoid: range | None = None) -> int:
    """A free port in 30000-32699 (or the first of `block` consecutive free ports)."""
    return _ports.free_port(block, avoid)


class SglangServer(EngineProcess):
    """One `python -m sglang.launch_server` of a tiny model on 127.0.0.1:port.

    dp_size:       data-parallel replicas (`--dp-size N`), each its own scheduler.
    attn_dp_size:  attention DP (`--tp-size N --attn-dp-size N`, one TP group of N
                   ranks, attention-TP size 1); needs model="qwen3".  With
                   legacy_dp_attention=True the deprecated spelling
                   `--tp-size N --dp-size N --enable-dp-attention` is used instead.
    model:         "llama" (LlamaForCausalLM) or "qwen3" (Qwen3ForCausalLM).
    name:          --served-model-name (SGLang answers any model name anyway).
    cpus:          SGLANG_CPU_OMP_THREADS_BIND; default one core per rank ("0|1")
                   when there is more than one rank, unset for one rank (SGLang
                   requires it for more ranks than NUMA nodes, but only binds
                   threads on AMX CPUs).  With more than one rank the server also
                   gets OMP_NUM_THREADS=cores/ranks unless the caller set it.
    extra_args:    more launch_server arguments, e.g. ("--enable-metrics",).

    stop() takes about 6 s: SGLang's launcher sleeps 5 s "to let GPU activity
    settle" once it sees its scheduler die on SIGTERM.
    """

    engine = "SGLang"
    tmp_prefix = "sgl"
    # SGLang's /health answers 503 until the warm-up request has run, then 200 (by
    # default each later call runs a 1-token generate on a rank).
    health_timeout = 5

    def __init__(
        self,
        port: int,
        *,
        dp_size: int = 1,
        attn_dp_size: int = 1,
        model: str = "llama",
        name: str = "tiny",
        legacy_dp_attention: bool = False,
        cpus: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if dp_size < 1 or attn_dp_size < 1:
            raise ValueError("dp_size and attn_dp_size must be >= 1")
        if dp_size > 1 and attn_dp_size > 1:
            raise ValueError("SGLang does not combine --dp-size > 1 with --attn-dp-size > 1")
        if legacy_dp_attention and attn_dp_size == 1:
            raise ValueError("legacy_dp_attention needs attn_dp_size > 1")
        model_dir(model)  # validates the name
        super().__init__(port)
        self.dp_size = dp_size
        self.attn_dp_size = attn_dp_size
        self.model = model
        self.name = name
        self.legacy_dp_attention = legacy_dp_attention
        self.ranks = dp_size * attn_dp_size  # scheduler processes
        self.cpus = cpus if cpus is not None else self._default_cpus(self.ranks)
        self.extra_args = tuple(extra_args)
        self.internal_ports: dict[str, int] = {}

    @staticmethod
    def _default_cpus(ranks: int) -> str | None:
        return None if ranks == 1 else core_per_rank(ranks)

    def _home(self) -> Path:
        return home()

    def _unavailable(self) -> str | None:
        return available()

    def _log_name(self) -> str:
        layout = f"attndp{self.attn_dp_size}" if self.attn_dp_size > 1 else f"dp{self.dp_size}"
        return f"sglang-{self.model}-{layout}"

    def _log_header(self, env: dict[str, str]) -> str:
        return f"cpus={self.cpus} ports={self.internal_ports} TMPDIR={self._tmp}"

    def _repr_fields(self) -> dict[str, object]:
        return {
            "port": self.port,
            "model": self.model,
            "dp": self.dp_size,
            "attn_dp": self.attn_dp_size,
            "cpus": self.cpus,
        }

    def _banner(self) -> str:
        return f"starting {self!r}, ports {self.internal_ports}\nlog {self.log_path}"

    def _before_start(self) -> None:
        super()._before_start()
        self._choose_internal_ports()

    def _choose_internal_ports(self) -> None:
        """Pick the internal ports SGLang lets us set (called by start()).

        - one rank, or attention DP: `--nccl-port N` (torch.distributed's TCPStore
          for one rank; with attention DP every rank shares it).
        - attention DP: `--dist-init-addr 127.0.0.1:D`. SGLang then rendezvous on D
          and puts its 6 ZMQ TCP sockets on D+1..D+6 (otherwise it derives them
          from the HTTP port + 233, which can hit a neighbour's ports).
        - plain DP (dp_size > 1): nothing.  Each replica needs its own NCCL port
          and SGLang picks them itself (random in 22000-29999, held while picking;
          a fixed --nccl-port would be given to every replica and collide), and a
          --dist-init-addr would make the replicas rendezvous on one port.
          Its ZMQ sockets are ipc:// files in our TMPDIR.
        """
        taken = range(self.port, self.port + 1)
        self.internal_ports = {}
        if self.dp_size == 1:
            self.internal_ports["nccl_port"] = free_port(avoid=taken)
        if self.attn_dp_size > 1:
            # (free_port() never repeats a port it handed out recently: not N either)
            self.internal_ports["dist_init_port"] = free_port(DIST_INIT_BLOCK, avoid=taken)

    def command(self) -> list[str]:
        cmd = [
            str(venv_python()),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir(self.model)),
            "--served-model-name",
            self.name,
            "--device",
            "cpu",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-overlap-schedule",
            "--max-total-tokens",
            str(MAX_TOTAL_TOKENS),
            # Idle schedulers wait in zmq poll instead of spinning: on 2 cores the
            # spinning of two idle ranks cut decode speed to about a tenth.
            "--sleep-on-idle",
        ]
        if self.dp_size > 1:
            cmd += ["--dp-size", str(self.dp_size)]
        if self.attn_dp_size > 1:
            n = str(self.attn_dp_size)
            if self.legacy_dp_attention:
                cmd += ["--tp-size", n, "--dp-size", n, "--enable-dp-attention"]
            else:
                cmd += ["--tp-size", n, "--attn-dp-size", n]
        if "nccl_port" in self.internal_ports:
            cmd += ["--nccl-port", str(self.internal_ports["nccl_port"])]
        if "dist_init_port" in self.internal_ports:
            cmd += ["--dist-init-addr", f"{HOST}:{self.internal_ports['dist_init_port']}"]
        return cmd + list(self.extra_args)

    def environment(self, tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            DO_NOT_TRACK="1",
            SGLANG_USE_CPU_ENGINE="1",
            HF_HOME=str(home() / "cache" / "hf"),
            XDG_CACHE_HOME=str(tmp / "xdg"),
            TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
            TRITON_CACHE_DIR=str(tmp / "triton"),
            TMPDIR=str(tmp),
            PYTHONUNBUFFERED="1",
            # Only the sgl_kernel stand-in: never leak the test venv into SGLang's.
            PYTHONPATH=str(SGLANG_DIR),
        )
        if self.cpus is not None:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = self.cpus
        if self.ranks > 1:
            # SGLang applies SGLANG_CPU_OMP_THREADS_BIND only on AMX CPUs; elsewhere
            # each rank runs torch with one thread per core and two busy ranks fight
            # over the cores (2 x 400 tokens at once: 8-11 s, against 3.4-3.7 s
            # with one thread per rank).
            per_rank = max(1, len(allowed_cpus()) // self.ranks)
            env.setdefault("OMP_NUM_THREADS", str(per_rank))
        return env

    def get_json(self, path: str, timeout: float = 10) -> Any:
        """GET url+path and decode the JSON answer (a small convenience for tests)."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    """Run one server by hand until Ctrl-C: python3 -m e2e.sglang.server --dp 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m e2e.sglang.server")
    parser.add_argument("--port", type=int, default=0, help="default: a free port in 30000-32699")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (--dp-size)")
    parser.add_argument(
        "--attn-dp", type=int, default=1, help="attention DP (--tp-size N --attn-dp-size N)"
    )
    parser.add_argument(
        "--legacy", action="store_true", help="spell attention DP --dp-size N --enable-dp-attention"
    )
    parser.add_argument(
        "--model", choices=MODELS, default=None, help="default: qwen3 for --attn-dp, else llama"
    )
    parser.add_argument("--name", default="tiny", help="served model name")
    parser.add_argument("--cpus", default=None, help="SGLANG_CPU_OMP_THREADS_BIND value")
    parser.add_argument("extra", nargs="*", help="more launch_server arguments (after --)")
    args = parser.parse_args(argv)
    reason = available()
    if reason is not None:
        print(reason)
        return 1
    model = args.model or ("qwen3" if args.attn_dp > 1 else "llama")
    return SglangServer(
        args.port or free_port(),
        dp_size=args.dp,
        attn_dp_size=args.attn_dp,
        model=model,
        name=args.name,
        legacy_dp_attention=args.legacy,
        cpus=args.cpus,
        extra_args=tuple(args.extra),
    ).run_by_hand()


if __name__ == "__main__":
    raise SystemExit(main())
