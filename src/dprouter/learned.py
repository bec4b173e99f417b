"""What one serving process of ``--processes N`` learns that the others must know too.

Each is told through the parent (``Channel`` up, the state stream down), batched per
loop turn: where ``cache_aware`` sent each prompt, and how many output tokens each
answer ran to (``estimate``). The board needs none of this: it is shared memory.
"""

from __future__ import annotations

from dprouter.estimate import OutputEstimate
from dprouter.follower import Follower
from dprouter.policies.cache_aware import CacheAware
from dprouter.targets import Target


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

    def tell(generated: int, model: str | None) -> None:
        channel.send({"kind": "output", "row": row, "model": model, "tokens": generated})

    estimate.tell = tell
    follower.on_output = estimate.update
