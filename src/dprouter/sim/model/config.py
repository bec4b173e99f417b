"""Configuration of a simulated engine: cost model, per-rank limits, persona, faults.

Defaults are the order of magnitude of an 8B model in bf16 on one H100 per rank:
weights (~16 GB) are read once per forward step at ~3 TB/s, prefill runs at
~25k tokens/s, and each decoding sequence adds its KV reads to the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dprouter.core.types import PD_MODES, PdMode
from dprouter.sim.model.kvevents import Adapter, KvEventsConfig

Persona = Literal["vllm", "sglang"]
Dispatch = Literal[
    "vllm",
    "round_robin",
    "total_requests",
    "total_tokens",
    "shortest_queue",
    "follow_bootstrap_room",
]
# SGLang 0.5.23's --load-balance-method choices, and an older SGLang's
SGLANG_DISPATCH: tuple[Dispatch, ...] = (
    "round_robin",
    "total_requests",
    "total_tokens",
    "follow_bootstrap_room",
)
LEGACY_SGLANG_DISPATCH: tuple[Dispatch, ...] = (
    "round_robin",
    "shortest_queue",
    "follow_bootstrap_room",
)


@dataclass(frozen=True)
class CostModel:
    """Seconds of (virtual) GPU time per forward step."""

    step_base: float = 6.0e-3  # every step reads all weights once
    decode_per_seq: float = 8.0e-5  # each decoding sequence reads its KV
    prefill_per_token: float = 4.0e-5  # each uncached prompt token computed
    decode_per_kv_token: float = 0.0  # each token of KV held by the batch, read every step
    max_batched_tokens: int = 8192  # chunked-prefill budget per step (decodes count 1 each)
    # Under DP attention the MLP (or MoE) layers run on every rank's tokens gathered
    # (SGLang's dp_gather, vLLM's expert all-to-all), split over all the engine's GPUs:
    # this share of a prompt token's cost is paid by the whole engine, not its rank alone.
    gathered_share: float = 0.6

    def __post_init__(self) -> None:
        if not 0.0 <= self.gathered_share <= 1.0:
            raise ValueError("gathered_share must be within [0, 1]")
        costs = (
            self.step_base,
            self.decode_per_seq,
            self.prefill_per_token,
            self.decode_per_kv_token,
        )
        if min(costs) < 0:
            raise ValueError("cost constants must be >= 0")
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")


@dataclass(frozen=True)
class RankLimits:
    """Capacity of one DP rank."""

    max_running: int = 256  # running batch cap (vLLM max_num_seqs)
    kv_tokens: int = 400_000  # KV budget: ~60 GB free / 128 KiB per token of an 8B model
    block_size: int = 16  # prefix cache granularity in tokens
    prefix_cache_blocks: int | None = None  # LRU capacity; None = kv_tokens // block_size
    max_model_len: int = 32_768  # prompt + max_tokens must fit

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.block_size < 1 or self.max_model_len < 2:
            raise ValueError("max_running, block_size must be >= 1 and max_model_len >= 2")
        if self.kv_tokens < self.max_model_len:
            raise ValueError(
                f"kv_tokens ({self.kv_tokens}) must hold one full request "
                f"(max_model_len {self.max_model_len})"
            )

    @property
    def cache_blocks(self) -> int:
        if self.prefix_cache_blocks is not None:
            return self.prefix_cache_blocks
        return self.kv_tokens // self.block_size


@dataclass(frozen=True)
class Faults:
    """Fault knobs for tests of the router's failure handling."""

    fail_rate: float = 0.0  # probability that a generation request gets HTTP 500
    fail_first: int = 0  # the first N generation requests get HTTP 500
    hang: bool = False  # accept generation requests and never answer
    delay: float = 0.0  # wall seconds each generation request waits before anything else
    crash_after: int | None = None  # the server dies when request N+1 arrives
    slow_ranks: dict[int, float] = field(default_factory=dict)  # rank -> step cost factor
    failing_ranks: frozenset[int] = frozenset()  # requests pinned to these get HTTP 500
    health_fail_after: float | None = None  # /health answers 503 after T wall seconds
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        if any(f <= 0 for f in self.slow_ranks.values()):
            raise ValueError("slow rank factors must be > 0")


@dataclass(frozen=True)
class PdConfig:
    """A prefill or decode engine of a disaggregated deployment."""

    mode: PdMode
    role: Literal["prefill", "decode"]
    transfer_mode: Literal["READ", "WRITE"] = "READ"  # MoRIIO
    registration: str | None = None  # MoRIIO: where to send registration heartbeats
    heartbeat: float = 3.0  # MoRIIO: seconds between heartbeats
    bootstrap_port: int = 0  # SGLang, Mooncake prefill: the bootstrap listener (0: any port)
    kv_wait: float = 5.0  # decode: wall seconds to wait for the KV to be produced

    def __post_init__(self) -> None:
        if self.mode not in PD_MODES:
            raise ValueError(f"P/D mode must be one of {', '.join(PD_MODES)}")
        if self.role not in ("prefill", "decode"):
            raise ValueError("a P/D engine's role is prefill or decode")
        if self.transfer_mode not in ("READ", "WRITE"):
            raise ValueError("transfer_mode must be READ or WRITE")

    @property
    def persona(self) -> Persona:
        return "sglang" if self.mode == "sglang" else "vllm"


@dataclass(frozen=True)
class EngineConfig:
    persona: Persona = "vllm"
    dp_size: int = 1
    tp_size: int = 1
    dp_attention: bool = False
    dispatch: Dispatch | None = None  # None: the persona's default
    # SGLang before attn_dp_size: /server_info counts attention-DP ranks in dp_size,
    # /get_load answers, shortest_queue balances; otherwise SGLang 0.5.23
    legacy_sglang: bool = False
    stats_interval: float = 0.1  # vLLM: coordinator publishes rank counts this often
    reserve_locally: bool = False  # vLLM >= 0.10 adds +1 waiting per dispatch between snapshots
    # a prefill chunk shares its step with the decodes (vLLM); None: the persona's way,
    # SGLang's being a prefill batch that runs alone and first (no --enable-mixed-chunk)
    mixed_chunk: bool | None = None
    model: str = "sim-model"
    lora_modules: tuple[str, ...] = ()  # adapters served beside the model, by name
    time_scale: float = 1.0  # wall seconds per virtual second (0.1 runs 10x faster)
    cost: CostModel = field(default_factory=CostModel)
    limits: RankLimits = field(default_factory=RankLimits)
    faults: Faults = field(default_factory=Faults)
    pd: PdConfig | None = None  # None: a regular engine
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)  # off by default
    tokenizer: str | None = None  # a tokenizer.json directory; None: the built-in CRC rule

    def __post_init__(self) -> None:
        if self.pd is not None and self.pd.persona != self.persona:
            raise ValueError(f"P/D mode {self.pd.mode} runs on {self.pd.persona} engines")
        if self.dp_size < 1 or self.tp_size < 1:
            raise ValueError("dp_size and tp_size must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.persona == "vllm" and self.dispatch not in (None, "vllm"):
            raise ValueError(f"the vllm persona dispatches by load score, not {self.dispatch!r}")
        if self.persona == "sglang" and self.dispatch not in (None, *self.dispatch_choices):
            raise ValueError(
                f"{'older ' if self.legacy_sglang else ''}sglang dispatch must be one of "
                f"{', '.join(self.dispatch_choices)}, not {self.dispatch!r}"
            )
        bad = [r for r in self.faults.slow_ranks if not 0 <= r < self.dp_size]
        if bad:
            raise ValueError(f"slow ranks {bad} out of range [0, {self.dp_size})")

    @property
    def adapters(self) -> dict[str, Adapter]:
        """By name; vLLM numbers them 1, 2, ... as it loads them (``lora_id_counter``)."""
        return {name: Adapter(i, name) for i, name in enumerate(self.lora_modules, 1)}

    @property
    def dispatch_choices(self) -> tuple[Dispatch, ...]:
        return LEGACY_SGLANG_DISPATCH if self.legacy_sglang else SGLANG_DISPATCH

    @property
    def mixes_chunks(self) -> bool:
        if self.mixed_chunk is not None:
            return self.mixed_chunk
        return self.persona == "vllm"

    @property
    def dispatch_mode(self) -> Dispatch:
        """As SGLang 0.5.23 resolves ``--load-balance-method auto``: a P/D prefill engine
        follows the bootstrap room, every other one takes turns."""
        if self.dispatch is not None:
            return self.dispatch
        if self.persona == "vllm":
            return "vllm"
        prefill = self.pd is not None and self.pd.role == "prefill"
        return "follow_bootstrap_room" if prefill else "round_robin"
