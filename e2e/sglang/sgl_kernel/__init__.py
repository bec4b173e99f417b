"""Plain-torch stand-in for SGLang's `sgl_kernel` extension, for CPU e2e tests only.

No PyPI package ships SGLang's CPU kernels (CPU builds of sgl-kernel are made
from source and target Intel AMX).  e2e/sglang/server.py puts the folder that
holds this package on PYTHONPATH of the SGLang server only.

What SGLang 0.5.23 takes from `sgl_kernel` when it serves a plain Llama / Qwen3
with `--device cpu --attention-backend torch_native --sampling-backend pytorch`
(found by running it with a tracing stand-in, one rank, --dp-size 2 and
attention DP; every import below happens at start-up, under `if _is_cpu:`):

  called on every batch, implemented here in torch:
    assign_req_to_token_pool_cpu      sglang/srt/mem_cache/allocation.py

  imported at start-up, never called on this path (speculative decoding and
  KV-cache moves); here they raise NotImplementedError if ever called:
    copy_all_layer_kv_cache_cpu       sglang/kernels/ops/kvcache/cache_move.py
    assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu
                                      sglang/kernels/ops/speculative/cache_locs.py
    fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu
                                      sglang/kernels/ops/speculative/eagle.py
    build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu
                                      sglang/kernels/ops/speculative/spec_tree.py

Any other name is refused: `from sgl_kernel import X` raises ImportError and
`getattr(sgl_kernel, "X")` raises AttributeError naming X (and a line goes to
the server log), so SGLang code that probes for an optional kernel falls back
as it would without sgl_kernel, and code that needs one fails at once instead
of running something made up.  Kernels that SGLang reaches through
`torch.ops.sgl_kernel.*` are not registered either: those are the AMX paths,
not taken on a CPU without AMX (SGLang logs "Ignore import error when loading
sglang.srt.models.qwen3_5 ..." for the few model files that touch them at
import; Llama and Qwen3 do not).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+dprouter.standin"

_NOT_HERE = (
    "the dprouter e2e stand-in for sgl_kernel (e2e/sglang/sgl_kernel) implements only "
    "assign_req_to_token_pool_cpu; SGLang {what} {name!r}, a kernel that is not "
    "available on this CPU (speculative decoding, KV-cache moves, quantisation, MoE, "
    "AMX and torch.compile paths are not supported here)"
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of req_to_token, in place.

    Same semantics as the Triton kernel `assign_req_to_token_pool` in
    sglang/srt/mem_cache/allocation.py: for request i,
    req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] receives
    the next end_offset[i] - start_offset[i] entries of out_cache_loc, taken in
    order over the requests.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"req_to_token must be (rows, {pool_len}), got {tuple(req_to_token.shape)}"
        )
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError(f"batch sizes differ: {len(rows)}, {len(starts)}, {len(ends)}")
    src = out_cache_loc.reshape(-1)
    total = sum(max(e - s, 0) for s, e in zip(starts, ends, strict=True))
    if total > src.numel():
        raise ValueError(f"out_cache_loc has {src.numel()} slots, need {total}")
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n <= 0:
            continue
        if start < 0 or end > pool_len:
            raise ValueError(f"slot range [{start}, {end}) outside [0, {pool_len})")
        req_to_token[row, start:end] = src[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _not_implemented(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_NOT_HERE.format(what="called", name=name))

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"Imported by SGLang at start-up on CPU; raises if called ({name})."
    return kernel


# Imported at start-up, never called on the tested path: importable, but raise if called.
_IMPORTED_NOT_CALLED = (
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _IMPORTED_NOT_CALLED:
    globals()[_name] = _not_implemented(_name)
del _name

__all__ = ["assign_req_to_token_pool_cpu", *_IMPORTED_NOT_CALLED]


def __getattr__(name: str) -> NoReturn:
    # Dunder look-ups (__path__, __spec__, ...) must answer the plain way.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    # Also leave a line in the server log: `from sgl_kernel import X` turns the
    # AttributeError into a bare ImportError that SGLang may catch and hide.
    print(f"[sgl_kernel stand-in] refused {name!r}", file=sys.stderr, flush=True)
    raise AttributeError(_NOT_HERE.format(what="asked for", name=name))
