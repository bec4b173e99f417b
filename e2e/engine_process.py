"""What the real-engine helpers share: free ports, CPUs, and one server process's life.

Standard library only: the test suite imports this from the project's own
virtual environment, while each engine runs from its own environment.

An `EngineProcess` is one engine server started in its own process group, with
its own temporary folder (TMPDIR) and a log file; e2e/vllm_server.py and
e2e/sglang/server.py fill in the command, the environment and the names.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, ClassVar, Self

HOST = "127.0.0.1"


class PortRange:
    """Hands out free ports in [lo, hi): a port counts as free when it binds on every host.

    Tries binds from a random starting point, so that two callers that have not
    yet started their servers are unlikely to get the same answer; with
    `remember` > 0 it also never hands out a port it gave recently (the last
    `remember`), so that servers chosen but not yet started (and their internal
    ports) do not get the same answer either.
    """

    def __init__(
        self, lo: int, hi: int, *, hosts: tuple[str, ...] = (HOST,), remember: int = 0
    ) -> None:
        self.lo, self.hi = lo, hi
        self.hosts = hosts
        self._handed_out: collections.deque[int] = collections.deque(maxlen=remember)

    def _is_free(self, port: int) -> bool:
        for host in self.hosts:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    return False
        return True

    def free_port(self, block: int = 1, avoid: range | None = None) -> int:
        """A free port (or the first of `block` consecutive free ports) outside `avoid`."""
        span = self.hi - self.lo - block
        start = random.randrange(span)
        recent = set(self._handed_out)
        for i in range(span):
            port = self.lo + (start + i) % span
            ports = range(port, port + block)
            if avoid is not None and (ports.start < avoid.stop and avoid.start < ports.stop):
                continue
            if recent.intersection(ports):
                continue
            if all(self._is_free(p) for p in ports):
                self._handed_out.extend(ports)
                return port
        raise RuntimeError(f"no free port in {self.lo}-{self.hi}")


def prepared_home(variable: str, name: str) -> Path:
    """Where an engine's prepared environment lives: $variable, or ~/.cache/name."""
    env = os.environ.get(variable)
    return Path(env) if env else Path.home() / ".cache" / name


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def core_per_rank(ranks: int) -> str:
    """A CPU bind list ("0|1"): one core per rank; when ranks outnumber cores, share them."""
    cpus = allowed_cpus()
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


def _mapped_shm(pids: list[int] | None = None) -> set[Path]:
    """The /dev/shm files that these processes (default: every process) have mapped."""
    if pids is None:
        pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith("/dev/shm/"):
                    found.add(Path(path.removesuffix(" (deleted)")))
    return found


class EngineProcess(abc.ABC):
    """One engine server on 127.0.0.1:port, run in its own process group.

    A subclass gives the engine's name, its home (logs/ and cache/ go there),
    the availability check, the command, the environment and the log file name.
    _before_start(), _while_running() and _after_stop() keep the /dev/shm files
    the engine leaves behind in check; a subclass may add its own bookkeeping.
    """

    engine: ClassVar[str]  # for messages: "vLLM", "SGLang"
    tmp_prefix: ClassVar[str]  # of the TMPDIR name, before the port
    health_timeout: ClassVar[float]  # seconds for one GET /health

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.ready_seconds: float | None = None
        self._log_file: IO[bytes] | None = None
        self._tmp: Path | None = None
        self._started_at = 0.0
        self._shm: set[Path] = set()  # /dev/shm files the group mapped: removed on stop
        # an engine serving HTTPS (its --ssl-* options): how the test reaches it
        self.tls: ssl.SSLContext | None = None

    # What a subclass fills in.

    @abc.abstractmethod
    def _home(self) -> Path: ...

    @abc.abstractmethod
    def _unavailable(self) -> str | None:
        """None when a server can be started, else why not."""

    @abc.abstractmethod
    def command(self) -> list[str]: ...

    @abc.abstractmethod
    def environment(self, tmp: Path) -> dict[str, str]: ...

    @abc.abstractmethod
    def _log_name(self) -> str:
        """The log file's name before "-PORT-STAMP.log"."""

    @abc.abstractmethod
    def _log_header(self, env: dict[str, str]) -> str:
        """What the log's first line says before the command."""

    @abc.abstractmethod
    def _repr_fields(self) -> dict[str, object]: ...

    def _before_start(self) -> None:
        """Called by start() once the TMPDIR exists, before environment() and command()."""
        return None  # nothing here: a subclass adds its own bookkeeping

    def _while_running(self) -> None:
        """Called at each wait_ready() poll and just before kill() or stop() signal the
        group (also when start-up fails: an engine may exit without removing its files)."""
        self._note_shm()

    def _after_stop(self) -> None:
        """Called by stop() once the group has been signalled and waited for."""
        if not self._group_alive():
            self._remove_shm()

    def pids(self) -> list[int]:
        """Process ids of the server's process group (from /proc; Linux only)."""
        if self.proc is None:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    if int(fields[2]) == self.proc.pid:  # field 5: pgrp
                        out.append(int(entry.name))
        return sorted(out)

    def rss_bytes(self) -> int:
        """Sum of the resident sets of the group (shared pages counted once per process)."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        return total * os.sysconf("SC_PAGE_SIZE")

    def _note_shm(self) -> None:
        """Remember the /dev/shm files the group has mapped, to remove them in stop().

        Both engines leave them behind: SGLang even when it exits cleanly (a
        load-snapshot file per server, sglang_loads_*.shm, 16-32 KB, and with
        attention DP a 24 MB message queue, sgl_shm_mq_*), vLLM when it is killed
        (psm_* shared memory, about 0.8 GB of RAM per killed DP=2 server).  Reading
        the maps of our own processes keeps a second server's files out of it.
        """
        self._shm |= _mapped_shm(self.pids())

    def _remove_shm(self) -> None:
        for path in self._shm:
            with contextlib.suppress(OSError):
                path.unlink()
        self._shm.clear()
        # multiprocessing's named semaphores (sem.mp-*) that SGLang's shutdown leaves
        # (it SIGKILLs its resource tracker) stay: a few bytes each. They cannot be told
        # apart by owner -- glibc maps a semaphore under a temporary name, so a live one
        # looks unmapped -- and sweeping the new unmapped ones deleted other processes'
        # live semaphores (a --processes router's in a test suite running beside).

    # The life of the process.

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    def start(self) -> Self:
        if self.proc is not None:
            raise RuntimeError("server already started")
        reason = self._unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        logs = self._home() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (self._home() / "cache").mkdir(parents=True, exist_ok=True)
        # Short path: ZMQ ipc:// socket paths must stay under ~107 bytes.
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.tmp_prefix}{self.port}-"))
        self._before_start()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = logs / f"{self._log_name()}-{self.port}-{stamp}.log"
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        env = self.environment(self._tmp)
        cmd = self.command()
        self._log_file.write(f"# {self._log_header(env)} cmd={cmd}\n".encode())
        self._log_file.flush()
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
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
            url, timeout = self.url + "/health", self.health_timeout
            with urllib.request.urlopen(url, timeout=timeout, context=self.tls) as resp:
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
            self._while_running()
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.engine} server on port {self.port} exited with {code} before ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy():
                self.ready_seconds = time.monotonic() - self._started_at
                return self.ready_seconds
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.engine} server on port {self.port} not ready after {timeout:.0f} s; "
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
            self._while_running()
            self._signal_group(signal.SIGKILL)
        self.stop(timeout=5)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left."""
        if self.proc is not None:
            if self.proc.poll() is None or self._group_alive():
                self._while_running()
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
            self._after_stop()
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
        fields = {**self._repr_fields(), "pid": self.proc.pid if self.proc else None}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def _banner(self) -> str:
        """What run_by_hand() prints once the process has started."""
        return f"starting {self!r}, log {self.log_path}"

    def run_by_hand(self) -> int:
        """Start, wait until ready, and run until Ctrl-C or SIGTERM (each helper's main())."""

        def _stop_on_sigterm(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _stop_on_sigterm)  # `kill PID` stops the server too
        with self:
            print(self._banner(), flush=True)
            try:
                print(
                    f"ready in {self.wait_ready():.1f} s at {self.url} (Ctrl-C stops)", flush=True
                )
                while self.proc is not None and self.proc.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return 0
