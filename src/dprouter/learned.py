"""What one serving process of ``--processes N`` learns that the others must know too,
beyond the board (shared memory: counts, engine reports, the typical output lengths):
where ``cache_aware`` sent each prompt, told through the parent (``Channel`` up, the
state stream down), batched per loop turn, so that the next decision in another process
knows it.
"""

from __future__ import annotations

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
