"""Block keys from token ids, so the router never needs an engine's hash seed.

A block's key stands for every token from the start of the sequence to the block's
end: the sum, modulo 2**64, of one mixed value per (position, token) pair (the
splitmix64 finaliser of ``position << 32 | token``, a bijection, so distinct pairs give
distinct values). It chains like the engines' hashes -- a block's key is its parent's
plus its own tokens' values -- and a whole prompt's keys are one cumulative sum,
computed in numpy (a 20k-token prompt: about 0.3 ms). Events and prompts go through the
same two functions; ``test_kv_keys`` pins that they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np
import numpy.typing as npt

M64 = (1 << 64) - 1
SMALL = 64  # tokens below which plain Python beats numpy's per-call cost (measured)
U64 = npt.NDArray[np.uint64]


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _mixed(tokens: npt.NDArray[np.integer], start: int) -> U64:
    x = np.arange(start, start + len(tokens), dtype=np.uint64) << np.uint64(32)
    x |= tokens.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def root(lora: int | str | None) -> int:
    """Where a chain starts: 0 for the base model; an adapter's blocks start at a digest
    of its name, so they match only prompts sent to that adapter (a name and an integer
    id are digested apart: an event that says only ``lora_id`` is matched by no prompt,
    as a request names its adapter, never its id)."""
    if lora is None or lora == 0 or lora == "":
        return 0
    text = (b"id:%d" % lora) if isinstance(lora, int) else b"name:" + lora.encode()
    return int.from_bytes(blake2b(text, digest_size=8).digest(), "big") or 1


def chain(parent: int, depth: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys of the full blocks of ``tokens``, which follow ``depth`` tokens whose
    last block's key is ``parent``."""
    n = len(tokens) - len(tokens) % block_size
    if n <= 0:
        return []
    if n < SMALL:
        keys = []
        total = parent
        for i in range(n):
            total = (total + _mix(((depth + i) << 32) | (tokens[i] & 0xFFFFFFFF))) & M64
            if (i + 1) % block_size == 0:
                keys.append(total)
        return keys
    ids = np.asarray(tokens[:n], dtype=np.int64)
    return prompt_keys(ids, block_size, parent, depth)


def prompt_keys(
    ids: npt.NDArray[np.integer], block_size: int, parent: int = 0, depth: int = 0
) -> list[int]:
    """The keys of a prompt's full blocks, in order (what a lookup walks)."""
    n = len(ids) - len(ids) % block_size
    if n <= 0:
        return []
    sums = np.cumsum(_mixed(ids[:n], depth), dtype=np.uint64)[block_size - 1 :: block_size]
    if parent:
        sums += np.uint64(parent)
    keys: list[int] = sums.tolist()
    return keys
