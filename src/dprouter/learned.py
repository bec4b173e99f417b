"""What one serving process of ``--processes N`` learns that the others must know too.

Each is told through the parent (``Channel`` up, the state stream down): where
``cache_aware`` sent each prompt, batched per loop turn (the next decision in another
process should know it), and how many output tokens each answer ran to
(``estimate``), batched every ``LENGTHS_EVERY`` seconds: told per loop turn, they cost
each plain request ~0.06-0.09 ms of CPU in the three processes (a batch is an HTTP call
up and a line down, and at a few thousand requests a second a loop turn holds few
answers), where an average of ~20 lengths loses nothing by arriving later. The
board needs none of this: it is shared memory.
"""

from __future__ import annotations

import asyncio

from dprouter.estimate import OutputEstimate
from dprouter.follower import Follower
from dprouter.policies.cache_aware import CacheAware
from dprouter.targets import Target

LENGTHS_EVERY = 0.25  # seconds between two messages of output lengths from one process


def share_prefixes(follower: Follower, policy: CacheAware) -> None:
    """Several serving processes: each ``cache_aware`` knows where all of them sent what."""
    row, channel = follower.row, follower.channel

    def tell(target: Target, blocks: list[int]) -> None:
        channel.send({"kind": "seen", "row": row, "slot": target.slot, "blocks": blocks})

    policy.tell = tell
    follower.on_seen = policy.learn


def share_outputs(follower: Follower, estimate: OutputEstimate) -> None:
    """Several serving processes: each counts a request by the output lengths all of them
    saw finish."""
    row, channel = follower.row, follower.channel
    lengths: list[tuple[str | None, int]] = []

    def send() -> None:
        if lengths:  # none: sent already, as the channel closed
            channel.send({"kind": "outputs", "row": row, "lengths": lengths.copy()})
            lengths.clear()

    def tell(generated: int, model: str | None) -> None:
        if not lengths:
            asyncio.get_running_loop().call_later(LENGTHS_EVERY, send)
        lengths.append((model, generated))

    estimate.tell = tell
    follower.on_output = estimate.update
    channel.before_close.append(send)
