"""The garbage collector tuned for a serving process (``dprouter serve`` only).

Measured under 64 connections of plain requests (``bench overhead``'s load,
one core): with Python's default gen-0 threshold (700) a young collection ran
every ~25 requests, and each traversed every object of the requests in flight
-- about 1 ms each, 61 us per request in all, 7 % of the router's CPU. Objects
that live as long as the process (modules, the app, the registry) are frozen
out of collections once started, and the young threshold is raised so that a
collection runs about once per 20,000 container objects that outlive their
request (cyclic garbage, bounded by that count). A router embedded in another
program (``Router``) leaves its host's collector alone.
"""

from __future__ import annotations

import gc

YOUNG = 20_000  # container objects allocated (net) between young collections


def tune() -> None:
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
