"""Reading a ``multipart/form-data`` body (the audio endpoints) just enough to route it.

The router takes the form's ``model`` and ``stream`` fields and leaves the bytes
alone: the file goes to the engine exactly as the client sent it, never re-encoded.
Parts are found by scanning for the boundary, so a large file is not copied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dprouter.parse import DEFAULT_OUTPUT, BadRequest, Incoming, routing_key

BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)
FIELDS = (b"model", b"stream")  # the small fields the router reads
FIELD_MAX = 1024  # a routing field longer than this is not one


def fields(raw: bytes, content_type: str) -> dict[str, str]:
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(f"this endpoint takes multipart/form-data, not {content_type or 'none'}")
    found = BOUNDARY.search(content_type)
    if found is None:
        raise BadRequest("multipart/form-data without a boundary")
    delimiter = b"--" + found.group(1).encode()
    out: dict[str, str] = {}
    at = raw.find(delimiter)
    if at < 0:
        raise BadRequest("the form has no parts (its boundary never occurs)")
    while at >= 0:
        start = at + len(delimiter)
        if raw[start : start + 2] == b"--":
            break  # the closing delimiter
        end = raw.find(b"\r\n" + delimiter, start)
        head_end = raw.find(b"\r\n\r\n", start, end if end >= 0 else len(raw))
        if head_end < 0:
            break
        head = raw[start:head_end]
        name = NAME.search(head)
        if name is not None and name.group(1) == b"file" and b"filename=" in head:
            out["file"] = ""  # there is one (its bytes stay where they are)
        if name is not None and b"filename=" not in head and name.group(1) in FIELDS:
            value = raw[head_end + 4 : end if end >= 0 else len(raw)]
            if len(value) <= FIELD_MAX:
                out[name.group(1).decode()] = value.decode(errors="replace")
        at = end + 2 if end >= 0 else -1
    return out


def parse_form(raw: bytes, headers: Mapping[str, str]) -> Incoming:
    form = fields(raw, headers.get("Content-Type", ""))
    if "file" not in form:
        raise BadRequest("the form has no file part (a field named file, with a filename)", "file")
    stream = form.get("stream", "false").strip().lower() in ("true", "1")
    return Incoming(
        body={},  # nothing the router writes into: a rank goes in a header
        model=form.get("model"),
        stream=stream,
        key=routing_key(headers, {}),
        text="",
        tokens=DEFAULT_OUTPUT,
        output=DEFAULT_OUTPUT,
    )
