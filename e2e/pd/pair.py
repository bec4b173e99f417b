"""Start and stop real prefill/decode engines on the CPU, the KV moving over Mooncake's TCP.

Standard library only, like the single-engine helpers it builds on (e2e/sglang/server.py,
e2e/vllm_server.py); `bash e2e/pd/prepare.sh` prepares what it needs.

    from e2e.pd.pair import SglangPd, VllmPd, available

    with SglangPd("prefill", dp_size=2) as p, SglangPd("decode") as d:
        p.wait_ready(); d.wait_ready()
        ...  # p.bootstrap_port: the room's meeting place, given in both bodies
    with VllmPd("prefill") as p, VllmPd("decode") as d:
        ...  # p.bootstrap_port: the prefill's bootstrap server (GET /query)

Each engine gets Mooncake's transfer engine on its PYTHONPATH (prepared beside, never in,
its environment), the three Debian libraries on LD_LIBRARY_PATH when the system lacks
them, and MC_FORCE_TCP=1: the transfer runs over TCP on 127.0.0.1, no RDMA device.
"""

from __future__ import annotations

import json
import os
import sysconfig
import urllib.request
from pathlib import Path
from typing import Any, Literal

from e2e import vllm_server
from e2e.engine_process import HOST, prepared_home
from e2e.sglang import server as sglang_server

Role = Literal["prefill", "decode"]
PREPARE_HINT = "run bash e2e/pd/prepare.sh"


def home() -> Path:
    """Root of the prepared P/D extras: $DPROUTER_PD_HOME or ~/.cache/dprouter-pd."""
    return prepared_home("DPROUTER_PD_HOME", "dprouter-pd")


def available() -> str | None:
    """None when both engines and the transfer engine are prepared, else a reason to skip."""
    for reason in (vllm_server.available(), sglang_server.available()):
        if reason is not None:
            return reason
    if not (home() / "mooncake" / ".dprouter-installed").is_file():
        return f"Mooncake's transfer engine not prepared ({home()}): {PREPARE_HINT}"
    return None


def with_mooncake(env: dict[str, str]) -> dict[str, str]:
    """An engine's environment, plus what Mooncake's TCP transport needs."""
    paths = [str(home() / "mooncake"), *filter(None, [env.get("PYTHONPATH")])]
    arch = str(sysconfig.get_config_var("MULTIARCH"))  # x86_64-linux-gnu, aarch64-linux-gnu
    libs = [str(home() / "debs" / sub / arch) for sub in ("usr/lib", "lib")]
    libs += filter(None, [env.get("LD_LIBRARY_PATH")])
    return {
        **env,
        "PYTHONPATH": os.pathsep.join(paths),
        "LD_LIBRARY_PATH": os.pathsep.join(libs),
        "MC_FORCE_TCP": "1",
    }


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class SglangPd(sglang_server.SglangServer):
    """A real SGLang prefill or decode engine: the plain CPU server plus
    `--disaggregation-mode ROLE --disaggregation-transfer-backend mooncake_tcp`; a
    prefill also gets its bootstrap port, a decode SGLang's CPU retraction backup
    (without it: "Torch not compiled with CUDA enabled" at start-up)."""

    def __init__(self, role: Role, *, port: int = 0, **kwargs: Any) -> None:
        super().__init__(port or sglang_server.free_port(), **kwargs)
        self.role = role
        self.bootstrap_port = sglang_server.free_port() if role == "prefill" else None

    def _unavailable(self) -> str | None:
        return available()

    def _log_name(self) -> str:
        return f"{super()._log_name()}-{self.role}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd += ["--disaggregation-mode", self.role]
        cmd += ["--disaggregation-transfer-backend", "mooncake_tcp"]
        if self.bootstrap_port is not None:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        else:
            cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return cmd

    def environment(self, tmp: Path) -> dict[str, str]:
        return with_mooncake(super().environment(tmp))


class VllmPd(vllm_server.VllmServer):
    """A real vLLM engine with the MooncakeConnector over TCP: `kv_producer` (prefill, its
    bootstrap server on `bootstrap_port`) or `kv_consumer` (decode)."""

    def __init__(self, role: Role, *, port: int = 0, dp_size: int = 1, **kwargs: Any) -> None:
        config = {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        extra = ("--kv-transfer-config", json.dumps(config), *kwargs.pop("extra_args", ()))
        super().__init__(port or vllm_server.free_port(), dp_size, extra_args=extra, **kwargs)
        self.role = role
        self.bootstrap_port = vllm_server.free_port()

    def _unavailable(self) -> str | None:
        return available()

    def _log_name(self) -> str:
        return f"{super()._log_name()}-{self.role}"

    def environment(self, tmp: Path) -> dict[str, str]:
        env = with_mooncake(super().environment(tmp))
        # where the prefill's rank 0 runs its bootstrap server (GET /query)
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        return env

    def query(self) -> Any:
        """The prefill's bootstrap server: `{dp_rank: {engine_id, worker_addr}}`."""
        return get_json(f"http://{HOST}:{self.bootstrap_port}/query")
