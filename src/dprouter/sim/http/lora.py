"""LoRA adapters loaded and unloaded while the engine runs, as each real engine answers.

SGLang 0.5.23: ``POST /load_lora_adapter`` and ``/unload_lora_adapter``
(``sglang/srt/entrypoints/http_server.py``), bodies ``{"lora_name", "lora_path"}`` and
``{"lora_name"}``, answered with ``LoRAUpdateOutput`` (``success``, ``error_message``,
``loaded_adapters``), 200 or 400; a name loaded twice is refused with the LoRA manager's
words (``lora/lora_manager.py``), one unloaded unknown with the registry's
(``lora/lora_registry.py``). A request for an adapter it has never loaded is refused
(400, ``managers/tokenizer_manager.py`` ``_resolve_lora_path``, naming every adapter it
ever loaded); one it loaded and then unloaded is loaded again from its path first (its
``lora_ref_cache``: "Reloading evicted adapter").

vLLM 0.32: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``vllm/entrypoints/serve/lora/api_router.py``, served with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which this persona takes as given), answered
with a text ``Success: ...`` or an OpenAI error: 400 for a missing field, a base model's
name or a name already loaded (unless ``load_inplace``), 404 for unloading an unknown one
(``openai/models/serving.py``). vLLM numbers each new adapter 1, 2, ... in load order
(``lora_id_counter``), which its KV events carry; a request naming a model it does not
serve takes a number too (``resolve_lora`` counts before it finds no resolver).

Both list what is loaded in ``/v1/models``. A restarted engine serves its start-up
adapters (``EngineConfig.lora_modules``) again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from dprouter.sim.http.auth import admin
from dprouter.sim.model.kvevents import Adapter

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer


def lora_root(name: str) -> str:
    """Where a start-up adapter says it was loaded from."""
    return f"/sim/lora/{name}"


class Adapters:
    """What one engine serves beside its model, by name, and where each came from."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.loaded: dict[str, Adapter] = dict(server.config.adapters)
        self.roots = {name: lora_root(name) for name in self.loaded}
        self.ever = dict(self.roots)  # SGLang's lora_ref_cache: every adapter it loaded
        self._next_id = len(self.loaded) + 1

    def routes(self) -> list[web.RouteDef]:
        if self.server.persona.name == "vllm":
            return [
                web.post("/v1/load_lora_adapter", self.vllm_load),
                web.post("/v1/unload_lora_adapter", self.vllm_unload),
            ]
        return [
            web.post("/load_lora_adapter", self.sglang_load),
            web.post("/unload_lora_adapter", self.sglang_unload),
        ]

    def _load(self, name: str, root: str, in_place: bool = False) -> None:
        known = self.loaded.get(name)
        self.loaded[name] = known if known is not None and in_place else self._new(name)
        self.roots[name] = self.ever[name] = root

    def resolve(self, name: str) -> Adapter:
        """SGLang: the adapter a request names, loaded again if it was unloaded; ValueError
        (the engine's 400) for one it never loaded."""
        found = self.loaded.get(name)
        if found is not None:
            return found
        root = self.ever.get(name)
        if root is None:
            raise ValueError(
                f"Got LoRA adapter that has never been loaded: {name}\n"
                f"All loaded adapters: dict_keys({list(self.ever)!r})."
            )
        self._load(name, root)  # "Reloading evicted adapter"
        return self.loaded[name]

    def missed(self) -> None:
        """vLLM: a request named a model it does not serve, which took an adapter number."""
        self._next_id += 1

    def _new(self, name: str) -> Adapter:
        adapter = Adapter(self._next_id, name)
        self._next_id += 1
        return adapter

    def _unload(self, name: str) -> None:
        del self.loaded[name]
        del self.roots[name]

    # -- SGLang ---------------------------------------------------------------------

    @admin
    async def sglang_load(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name, root = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(root, str):
            return self._sglang(False, "lora_name and lora_path must be strings")
        if name in self.loaded:
            return self._sglang(
                False, f"Failed to load LoRA adapter {name} because it is already loaded"
            )
        self._load(name, root)
        return self._sglang(True)

    @admin
    async def sglang_unload(self, request: web.Request) -> web.Response:
        name = (await _body(request)).get("lora_name")
        if not isinstance(name, str) or name not in self.loaded:
            return self._sglang(
                False, f"LoRA with name {name} does not exist. Loaded LoRAs: {self._names()}"
            )
        self._unload(name)
        return self._sglang(True)

    def _names(self) -> str:
        return f"dict_keys({list(self.loaded)!r})"

    def _sglang(self, success: bool, message: str = "") -> web.Response:
        answer = {"success": success, "error_message": message, "loaded_adapters": self.roots}
        return web.json_response(answer, status=200 if success else 400)

    # -- vLLM -----------------------------------------------------------------------

    async def vllm_load(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name, root = body.get("lora_name"), body.get("lora_path")
        if not name or not root or not isinstance(name, str) or not isinstance(root, str):
            return _vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.server.config.model:
            return _vllm_error(
                400, f"The lora adapter '{name}' conflicts with a served base model."
            )
        in_place = body.get("load_inplace") is True
        if name in self.loaded and not in_place:
            return _vllm_error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        self._load(name, root, in_place)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload(self, request: web.Request) -> web.Response:
        name = (await _body(request)).get("lora_name")
        if not name or not isinstance(name, str):
            return _vllm_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self.loaded:
            return _vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self._unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object sent, or an empty one (each engine's own check then refuses it)."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _vllm_error(status: int, message: str, kind: str = "InvalidUserInput") -> web.Response:
    error = {"message": message, "type": kind, "param": None, "code": status}
    return web.json_response({"error": error}, status=status)
