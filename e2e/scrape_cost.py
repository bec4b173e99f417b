"""What a load scrape costs a real vLLM engine: its processes' CPU time (from ``/proc``)
while ``/metrics`` is read at 0, 1, 4 and 10 Hz for 20 s each, the engine idle.

Run after ``bash e2e/prepare.sh``: ``.venv/bin/python -m e2e.scrape_cost``.
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

from e2e import vllm_server

TICK = os.sysconf("SC_CLK_TCK")
SECONDS = 20.0


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICK


def main() -> None:
    with vllm_server.VllmServer(vllm_server.free_port(), dp_size=2) as server:
        server.wait_ready()
        time.sleep(5)  # past the start-up's own work
        pids = server.pids()
        for hz in (0, 1, 4, 10):
            before, start, scrapes = cpu_seconds(pids), time.time(), 0
            while time.time() - start < SECONDS:
                if hz:
                    urllib.request.urlopen(server.url + "/metrics").read()
                    scrapes += 1
                time.sleep(1 / hz if hz else 0.5)
            share = (cpu_seconds(pids) - before) / (time.time() - start)
            print(f"{hz:>3} Hz: {scrapes} scrapes, the engine's CPU {share * 100:.1f} % of a core")


if __name__ == "__main__":
    main()
