"""Every engine endpoint the router serves besides completions, chat and ``/generate``:
which engines serve it, and how the router routes it. One table; the routes, the
OpenAPI description and docs/router.md follow it. A path not in it is the router's
own 404 and never reaches an engine (profiling, say).

Routings:

- ``policy``: by the policy over the model's targets, like completions (rank written);
- ``any``: any ready worker serving the model, least busy first (no rank, no count);
- ``stored``: the target that made the response named in the path or body;
- ``each``: every ready worker, answered as one table.

Engine commands (pause, flush, weight updates...) are the admin API's (``commands``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dprouter.core.types import DialectName, Kind

Routing = Literal["policy", "any", "stored", "each"]
BOTH: tuple[DialectName, ...] = ("vllm", "sglang")
VLLM: tuple[DialectName, ...] = ("vllm",)
SGLANG: tuple[DialectName, ...] = ("sglang",)


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    engines: tuple[DialectName, ...]
    routing: Routing
    kind: Kind | None  # how the body is read; None: no body
    summary: str

    @property
    def dialect(self) -> DialectName | None:
        """The one dialect whose workers serve it (None: either)."""
        return self.engines[0] if len(self.engines) == 1 else None


def _pooling(path: str, engines: tuple[DialectName, ...], summary: str) -> Endpoint:
    return Endpoint("POST", path, engines, "policy", "pooling", summary)


ENDPOINTS: tuple[Endpoint, ...] = (
    _pooling("/v1/embeddings", BOTH, "Embeddings"),
    _pooling("/v1/score", BOTH, "Scores of text pairs"),
    _pooling("/score", VLLM, "Scores of text pairs (vLLM)"),
    _pooling("/v1/rerank", BOTH, "Rerank documents against a query"),
    _pooling("/rerank", VLLM, "Rerank (vLLM)"),
    _pooling("/v2/rerank", VLLM, "Rerank, Cohere v2 shape (vLLM)"),
    _pooling("/pooling", VLLM, "Pooled hidden states (vLLM)"),
    _pooling("/classify", BOTH, "Classification"),
    _pooling("/encode", SGLANG, "Embeddings, SGLang's native shape"),
    Endpoint("POST", "/v1/audio/transcriptions", BOTH, "policy", "audio", "Transcribe audio"),
    Endpoint("POST", "/v1/audio/translations", VLLM, "policy", "audio", "Translate audio (vLLM)"),
    Endpoint("POST", "/tokenize", VLLM, "any", "tokenizer", "Tokenize (vLLM)"),
    Endpoint("POST", "/detokenize", VLLM, "any", "tokenizer", "Detokenize (vLLM)"),
    Endpoint("POST", "/v1/tokenize", SGLANG, "any", "tokenizer", "Tokenize (SGLang)"),
    Endpoint("POST", "/v1/detokenize", SGLANG, "any", "tokenizer", "Detokenize (SGLang)"),
    Endpoint("POST", "/v1/responses", BOTH, "stored", "responses", "Create a response"),
    Endpoint("GET", "/v1/responses/{id}", BOTH, "stored", None, "A stored response"),
    Endpoint("POST", "/v1/responses/{id}/cancel", BOTH, "stored", None, "Cancel a response"),
    Endpoint("GET", "/health_generate", SGLANG, "any", None, "One worker generates a token"),
    Endpoint("GET", "/server_info", SGLANG, "any", None, "One worker's server info"),
    Endpoint("GET", "/get_server_info", SGLANG, "any", None, "One worker's server info"),
    Endpoint("GET", "/model_info", SGLANG, "any", None, "One worker's model info"),
    Endpoint("GET", "/get_model_info", SGLANG, "any", None, "One worker's model info"),
    Endpoint("GET", "/get_load", SGLANG, "each", None, "Each worker's load"),
)
