"""How a request names a LoRA adapter, read as each engine reads it, in one spelling: the
name its pool is chosen by (``Snapshot.pool``) and its affinity is kept under
(``RequestInfo.model``), since an engine caches each adapter's prompts apart.

vLLM 0.32 serves an adapter as a model of its own name (``_maybe_get_adapters``). SGLang
0.5.23 reads ``model`` written ``base:adapter`` (``_parse_model_parameter``: the served
name when it is a prefix, else up to the first colon; the base's name itself is not
checked), else the body's ``lora_path`` (a batch: its first; ``_resolve_lora_path``); a
bare adapter name in ``model`` runs the base model. Here ``lora_path`` beside ``model``
is written ``model:adapter`` and beside none ``:adapter``: the same adapter on the same
base has one name however the client spelt it.
"""

from __future__ import annotations

from collections.abc import Collection


def split(model: str, known: Collection[str]) -> tuple[str, str] | None:
    """SGLang's reading of ``model`` as (base, adapter); None when it names no adapter (no
    colon, a name some worker lists, or nothing after the colon). ``known``: the names
    the workers list, whose longest prefix (a served name may hold a colon) is the base."""
    if ":" not in model or model in known:
        return None
    bases = [m for m in known if model.startswith(m + ":")]
    at = len(max(bases, key=len)) if bases else model.index(":")
    adapter = model[at + 1 :].strip()
    return (model[:at].strip(), adapter) if adapter else None


def named(model: str | None, lora_path: object, known: Collection[str]) -> str | None:
    """The name a request runs under: ``model``, or with SGLang's ``lora_path`` (a string,
    or a batch's first) ``model:adapter`` (``:adapter`` with no model). An adapter in
    ``model`` wins over ``lora_path``, as SGLang has it."""
    if model is not None and split(model, known) is not None:
        return model
    if isinstance(lora_path, list):
        lora_path = lora_path[0] if lora_path else None
    if not isinstance(lora_path, str) or not lora_path:
        return model
    return f"{model or ''}:{lora_path}"


def missing(name: str) -> str:
    """The router's words for a name no worker serves (vLLM's, for a model)."""
    if name.startswith(":"):
        return f"The LoRA adapter `{name[1:]}` does not exist."
    return f"The model `{name}` does not exist."
