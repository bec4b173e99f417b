"""The router's own HTTP surface as an OpenAPI 3.1 description, served at ``/openapi.json``.

It describes what the router itself checks and answers; fields it does not
read pass through to the engine untouched, so request bodies stay open
(``additionalProperties``). The property tests run schemathesis against it.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

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


def describe() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "dprouter", "version": version("dprouter")},
        "paths": {
            "/v1/completions": _routed("Text completion", ["prompt"], {"prompt": PROMPT}),
            "/v1/chat/completions": _routed(
                "Chat completion", ["messages"], {"messages": MESSAGES}
            ),
            "/v1/models": _get("Models the workers serve", "application/json", {"type": "object"}),
            "/health": _get("The router is up", "application/json", {"type": "object"}),
            "/readiness": _get(
                "A worker is ready per role", "application/json", {"type": "object"}
            ),
            "/metrics": _get("Prometheus metrics", "text/plain", {"type": "string"}),
        },
    }
