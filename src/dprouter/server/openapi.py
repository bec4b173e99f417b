"""The router's own HTTP surface as an OpenAPI 3.1 description, served at ``/openapi.json``.

It describes what the router itself checks and answers; fields it does not
read pass through to the engine untouched, so request bodies stay open
(``additionalProperties``). The property tests run schemathesis against it.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from dprouter.server.commands import COMMANDS
from dprouter.server.endpoints import ENDPOINTS

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
        }
    },
}
COMMON = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "user": {"type": "string", "maxLength": 64},
    "session_id": {"type": "string", "maxLength": 64},
}
PROMPT = {
    "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": 2000},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}
MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"type": "string", "maxLength": 2000},
        },
    },
}

FORM = {
    "type": "object",
    "required": ["file"],
    "properties": {"model": {"type": "string"}, "file": {"type": "string", "format": "binary"}},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR}}}


def _routed(summary: str, required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    body = {"type": "object", "required": required, "properties": {**COMMON, **properties}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "the engine's answer, passed through (JSON, or an SSE stream)",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                "400": _error("invalid JSON, a wrong field type, a bad rank or routing header"),
                "404": _error("no worker serves this model"),
                "413": _error("body over --max-body"),
                "429": _error("over --max-concurrent with the queue full, or the engine's own"),
                "502": _error("every attempt on the engines failed"),
                "503": _error("no worker ready or reachable"),
            },
        }
    }


def _get(summary: str, media: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": summary, "content": {media: {"schema": schema}}},
                "503": _error("not ready"),
            },
        }
    }


def _answers(*statuses: int) -> dict[str, Any]:
    ok = {"description": "the answer", "content": {"application/json": {"schema": {}}}}
    return {str(s): ok if s < 300 else _error(f"HTTP {s}") for s in statuses}


def _operation(summary: str, body: bool, *statuses: int, param: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _answers(*statuses)}
    if body:
        schema = {"type": "object", "properties": {**COMMON, "input": PROMPT}}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if param:
        op["parameters"] = [
            {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    return op


ROUTED = (200, 400, 404, 413, 429, 502, 503)
ADMIN = (200, 201, 400, 401, 403, 404, 409, 502, 503)
COMMANDED = (200, 400, 401, 403, 404, 502, 503)


def _engine_paths() -> dict[str, Any]:
    """The engine endpoints of ``endpoints.ENDPOINTS``, as the router checks them."""
    paths: dict[str, Any] = {}
    for e in ENDPOINTS:
        if e.routing == "each":
            statuses: tuple[int, ...] = (200, 404, 502, 503)
        else:
            statuses = ROUTED
        op = _operation(e.summary, e.kind is not None, *statuses, param="{id}" in e.path)
        if e.kind == "audio":
            op["requestBody"]["content"] = {"multipart/form-data": {"schema": FORM}}
        paths.setdefault(e.path, {})[e.method.lower()] = op
    return paths


def _commands() -> dict[str, Any]:
    """The engine commands of ``commands.COMMANDS``: admin calls, fanned out."""
    paths: dict[str, Any] = {}
    for c in COMMANDS:
        statuses = (200, 400, 401, 403, 404, 409, 502, 503) if c.exclusive else COMMANDED
        for method in c.methods:
            op = _operation(f"Admin: {c.summary}", False, *statuses)
            paths.setdefault(c.path, {})[method.lower()] = op
    return paths


def _smg_shaped(summary: str, *names: str) -> dict[str, Any]:
    """smg's RL fan-out routes: the commands under its paths (docs/rl.md)."""
    params = [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
    ]
    ops = {}
    for method in ("get", "post"):
        op = _operation(f"Admin: {summary}, smg's shape", False, *ADMIN)
        op["parameters"] = params
        ops[method] = op
    return ops


def _dashboard() -> dict[str, Any]:
    """The live view's routes: served only under ``--dashboard``, behind the admin token."""
    html = {"text/html": {"schema": {"type": "string"}}}
    answers = {"200": {"description": "the page", "content": html}, "401": _error("HTTP 401")}
    page = {"get": {"summary": "The live view's page", "responses": answers}}
    files = _operation("The page's script, style and icon", False, 200, 401, 404)
    files["parameters"] = [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    data = _operation("The live view's data (docs/router.md, Dashboard)", False, 200, 401)
    return {
        "/dashboard": page,
        "/dashboard/data": {"get": data},
        "/dashboard/{name}": {"get": files},
    }


def describe(dashboard: bool = False) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "dprouter", "version": version("dprouter")},
        "paths": {
            "/v1/completions": _routed("Text completion", ["prompt"], {"prompt": PROMPT}),
            "/v1/chat/completions": _routed(
                "Chat completion", ["messages"], {"messages": MESSAGES}
            ),
            "/generate": _routed("SGLang's native generation", ["text"], {"text": PROMPT}),
            **_engine_paths(),
            "/v1/models": _get("Models the workers serve", "application/json", {"type": "object"}),
            "/v1/models/{id}": {"get": _operation("One model's card", False, 200, 404, param=True)},
            "/health": _get("The router is up", "application/json", {"type": "object"}),
            "/readiness": _get(
                "A worker is ready per role", "application/json", {"type": "object"}
            ),
            "/ping": {
                "get": _operation("The router's readiness (SageMaker)", False, 200, 503),
                "post": _operation("The router's readiness (SageMaker)", False, 200, 503),
            },
            "/version": {"get": _operation("The router's and each worker's version", False, 200)},
            "/metrics": _get("Prometheus metrics", "text/plain", {"type": "string"}),
            "/workers": {
                "get": _operation("Admin: the workers", False, *ADMIN),
                "post": _operation("Admin: add a worker", True, *ADMIN),
            },
            "/workers/{id}": {
                "delete": _operation(
                    "Admin: remove a worker (id or URL)", False, *ADMIN, param=True
                )
            },
            "/add_worker": {"post": _operation("Admin: add a worker (?url=)", False, *ADMIN)},
            "/remove_worker": {"post": _operation("Admin: remove a worker (?url=)", False, *ADMIN)},
            "/list_workers": {"get": _operation("Admin: the workers' URLs", False, *ADMIN)},
            "/v1/rl/workers": {
                "get": _operation("Admin: workers, weights' versions, capabilities", False, *ADMIN)
            },
            **_commands(),
            "/v1/rl/engine/{path}": _smg_shaped("a command (?selector=k=v)", "path"),
            "/v1/rl/workers/{id}/engine/{path}": _smg_shaped(
                "a command to one worker", "id", "path"
            ),
            **(_dashboard() if dashboard else {}),
        },
    }
