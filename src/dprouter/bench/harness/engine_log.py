"""Decode steps per DP rank, counted in a real SGLang engine's log.

With ``--decode-log-interval 1`` every scheduler rank writes one line per decode step it
runs (``[2026-12-03 17:21:32 DP0 TP0] Decode batch, #running-req: 1, ...``); an idle rank
writes none, and a request of N output tokens costs N - 1 of them (its first token comes
from prefill). Under attention DP the engine steps until its busiest rank is done, so
that rank's count is the cost of a burst -- the same whatever the machine's speed.

The ranks write to one file as they go: a window is taken between two offsets at line
ends (``offset``), and a line still being written is never counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from dprouter.sim.calibrate import LINE  # the one statement of a decode step's line

CHUNK = 1 << 16


def offset(path: Path) -> int:
    """Where the log's last complete line ends: the start of a window that no line
    straddles."""
    with path.open("rb") as f:
        end = f.seek(0, 2)
        while end > 0:
            start = max(0, end - CHUNK)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
    return 0


def steps(path: Path, start: int, end: int) -> dict[int, int]:
    """Decode lines per rank in bytes ``start:end`` of the log; a partial last line (one
    still being written) does not count."""
    with path.open("rb") as f:
        f.seek(start)
        data = f.read(max(0, end - start))
    counts: Counter[int] = Counter()
    for line in data.split(b"\n")[:-1]:  # the last piece is empty or unfinished
        found = LINE.match(line.decode(errors="replace"))
        if found is not None:
            counts[int(found["rank"] or 0)] += 1
    return dict(sorted(counts.items()))


async def settled(path: Path, start: int, quiet: float = 1.0, limit: float = 30.0) -> int:
    """Wait until no decode line has been added since ``start`` for ``quiet`` seconds (the
    ranks flush their lines a little after the answers), at most ``limit`` seconds; return
    the offset that ends the window. Decode lines, not bytes: a router scraping
    ``/v1/loads`` keeps the access log growing."""
    deadline = time.monotonic() + limit
    seen, calm_since = -1, time.monotonic()
    while True:
        end = offset(path)
        counted = sum(steps(path, start, end).values())
        if counted != seen:
            seen, calm_since = counted, time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return end
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: decode lines still growing after {limit:.0f} s")
        await asyncio.sleep(0.2)
