"""The two engine personas: how each words errors, reads a pinned rank and an adapter."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

from dprouter.sim.http.protocol import Kind


class RankError(ValueError):
    """The client pinned a rank the engine rejects; the message is the engine's own."""


class Persona(Protocol):
    name: str

    def error_body(
        self, status: int, message: str, etype: str, param: str | None, kind: Kind
    ) -> dict[str, Any]: ...

    def pinned_rank(
        self, headers: Mapping[str, str], body: Mapping[str, Any], dp_size: int, kind: Kind
    ) -> int | None: ...

    def model_error(
        self, model: str | None, served: str, adapters: Collection[str] = ()
    ) -> str | None: ...

    def adapter(
        self, body: Mapping[str, Any], served: str, adapters: Collection[str]
    ) -> str | None:
        """The LoRA adapter the request asks to run with (None: the base model); whether
        the engine has it is ``Adapters.resolve``'s to say."""
        ...

    def answer_model(self, body: Mapping[str, Any], served: str, adapter: str | None) -> str:
        """The ``model`` an OpenAI answer names."""
        ...


class VllmPersona:
    """vLLM's OpenAI server: rank in header ``X-data-parallel-rank``, no body field."""

    name = "vllm"

    def error_body(
        self, status: int, message: str, etype: str, param: str | None, kind: Kind
    ) -> dict[str, Any]:
        return {"error": {"message": message, "type": etype, "param": param, "code": status}}

    def pinned_rank(
        self, headers: Mapping[str, str], body: Mapping[str, Any], dp_size: int, kind: Kind
    ) -> int | None:
        raw = headers.get("X-data-parallel-rank")
        if raw is None:
            return None
        try:
            rank = int(raw)
        except ValueError:
            return None  # vLLM silently ignores a non-integer header
        if not 0 <= rank < dp_size:
            raise RankError(f"data_parallel_rank {rank} is out of range [0, {dp_size}).")
        return rank

    def model_error(
        self, model: str | None, served: str, adapters: Collection[str] = ()
    ) -> str | None:
        if model is None or model == served or model in adapters:
            return None
        # 0.32 ``_check_model``: no LoRA resolver found it, so the served names are listed
        return f"The model `{model}` does not exist. Valid aliases: {served}."

    def adapter(
        self, body: Mapping[str, Any], served: str, adapters: Collection[str]
    ) -> str | None:
        """An adapter is served as a model of its own name (``_maybe_get_adapters``)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in adapters else None

    def answer_model(self, body: Mapping[str, Any], served: str, adapter: str | None) -> str:
        """The adapter's name, else the served one (``OpenAIServingModels.model_name``)."""
        return adapter or served


class SglangPersona:
    """SGLang: body ``routed_dp_rank`` (older ``data_parallel_rank``). On its OpenAI
    endpoints the header ``X-Data-Parallel-Rank`` overrides the body; ``/generate``
    ignores that header (SGLang 0.5.23, checked against the real engine)."""

    name = "sglang"

    def error_body(
        self, status: int, message: str, etype: str, param: str | None, kind: Kind
    ) -> dict[str, Any]:
        if kind == "generate":
            return {"error": {"message": message}}
        return {
            "object": "error",
            "message": message,
            "type": etype,
            "param": param,
            "code": status,
        }

    def pinned_rank(
        self, headers: Mapping[str, str], body: Mapping[str, Any], dp_size: int, kind: Kind
    ) -> int | None:
        raw = None if kind == "generate" else headers.get("X-Data-Parallel-Rank")
        rank: Any
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                raise RankError(
                    f"Invalid X-Data-Parallel-Rank header: must be an integer, got {raw!r}"
                ) from None
        else:
            rank = body.get("routed_dp_rank")
            if rank is None:
                rank = body.get("data_parallel_rank")
            if rank is None:
                return None
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise RankError(f"routed_dp_rank must be an integer, got {rank!r}")
        if dp_size <= 1 and rank == 0:
            return None  # SGLang ignores rank 0 on a single-rank engine
        if not 0 <= rank < dp_size:
            raise RankError(f"routed_dp_rank={rank} out of range [0, {dp_size})")
        return int(rank)

    def model_error(
        self, model: str | None, served: str, adapters: Collection[str] = ()
    ) -> str | None:
        return None  # SGLang serves whatever model name the client writes

    def adapter(
        self, body: Mapping[str, Any], served: str, adapters: Collection[str]
    ) -> str | None:
        """``model`` written ``base:adapter``, else ``lora_path`` (a batch's first); a bare
        adapter name in ``model`` runs the base model (``_resolve_lora_path``)."""
        model, name = body.get("model"), None
        if isinstance(model, str) and ":" in model and model != served:
            at = len(served) if model.startswith(served + ":") else model.index(":")
            name = model[at + 1 :].strip()
        path = body.get("lora_path")
        if not name and isinstance(path, list):
            path = path[0] if path else None
        return name or (path if isinstance(path, str) else None) or None

    def answer_model(self, body: Mapping[str, Any], served: str, adapter: str | None) -> str:
        """``model`` as the client wrote it, ``base:adapter`` and all; "default" when it wrote
        none (``CompletionRequest.model``'s default)."""
        model = body.get("model")
        return model if isinstance(model, str) else "default"


def persona_for(name: str) -> Persona:
    if name == "vllm":
        return VllmPersona()
    if name == "sglang":
        return SglangPersona()
    raise ValueError(f"unknown persona {name!r}")
