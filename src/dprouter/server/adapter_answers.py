"""What a LoRA adapter command fanned out to several engines did, in one status beside
each engine's row: a partial fan-out says what happened rather than 502.

- unload: each engine that had the adapter unloaded it (those that did not have it said
  so: vLLM's 404 "cannot be found", SGLang's 400 "does not exist", or its list, read
  again, lacks it) -> 200, with ``unloaded`` and ``not_loaded``; no engine had it -> 404;
- load: every engine loaded it -> 200, with ``loaded``;
- otherwise the engines that did not do it are named: their status when they all
  refused alike (the client's to fix: a name already loaded, say), 502 when some engine
  failed on its own (an error, no answer).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from dprouter.core.errors import error_body


def answer(path: str, rows: list[dict[str, Any]], body: dict[str, Any]) -> web.Response:
    """The answer to the adapter command ``path`` sent with ``body``, from the engines'
    ``rows`` (each with ``models``, its list read again after the call, where it answered)."""
    name = body.get("lora_name")
    unload = "unload" in path
    done = [r["worker"] for r in rows if _ok(r)]
    absent = [r["worker"] for r in rows if unload and not _ok(r) and _lacked(r, name)]
    failed = [r for r in rows if not _ok(r) and r["worker"] not in absent]
    said: dict[str, Any] = {"workers": rows, "unloaded" if unload else "loaded": done}
    if unload:
        said["not_loaded"] = absent
    if not failed and done:
        return _json(said, 200)
    if not failed:
        message = f"LoRA adapter {name!r} is loaded on none of the {len(rows)} worker(s)"
        return _json({**said, **orjson.loads(error_body(404, message, "lora_name"))}, 404)
    statuses = {r.get("status") for r in failed}
    status = 502
    if len(statuses) == 1 and (only := statuses.pop()) is not None and 400 <= only < 500:
        status = only  # every engine that did not do it refused it alike: the client's to fix
    what = "unloaded from" if unload else "loaded on"
    parts = [f"{what} {', '.join(done) or 'none'}"]
    if absent:
        parts.append(f"not loaded on {', '.join(absent)}")
    parts.append("failed on " + ", ".join(f"{r['worker']} ({_why(r)})" for r in failed))
    message = f"{path}: {'; '.join(parts)}"
    return _json({**said, **orjson.loads(error_body(status, message))}, status)


def _ok(row: dict[str, Any]) -> bool:
    return row.get("status") is not None and row["status"] < 300


def _lacked(row: dict[str, Any], name: object) -> bool:
    """The row's engine did not have the adapter: its list, read after, lacks it (else its
    answer says "not found", in vLLM's or SGLang's words)."""
    models = row.get("models")
    if models is not None:
        return name not in models
    said = str(row.get("body"))
    return row.get("status") == 404 or "does not exist" in said or "cannot be found" in said


def _why(row: dict[str, Any]) -> str:
    return str(row.get("status") or row.get("error"))


def _json(answer: dict[str, Any], status: int) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(answer), content_type="application/json")
