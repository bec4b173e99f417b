"""Reading a ``multipart/form-data`` body (the audio endpoints) just enough to route it.

The router takes the form's ``model`` and ``stream`` fields and leaves the bytes
alone: the file goes to the engine exactly as the client sent it, never re-encoded.
Parts are found by scanning for the boundary, so a large file is not copied. The
scan also reads the start of a body (``complete=False``): what is known so far.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from dprouter.core.errors import BadRequest
from dprouter.core.types import Incoming
from dprouter.proxy.parse import DEFAULT_OUTPUT, routing_key

BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)
FIELDS = (b"model", b"stream")  # the small fields the router reads
FIELD_MAX = 1024  # a routing field longer than this is not one
Buffer = bytes | bytearray


@dataclass(slots=True)
class Seen:
    """What a scan found in a form (or in its start)."""

    fields: dict[str, str] = field(default_factory=dict)
    file: bool = False  # the file part has begun (its headers are in)
    parts: bool = False  # the boundary occurs at all


def delimiter(content_type: str) -> bytes:
    """The delimiter line the parts are separated by; 400 when it is not a form."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(f"this endpoint takes multipart/form-data, not {content_type or 'none'}")
    found = BOUNDARY.search(content_type)
    if found is None:
        raise BadRequest("multipart/form-data without a boundary")
    return b"--" + found.group(1).encode()


def scan(raw: Buffer, delim: bytes, complete: bool = True) -> Seen:
    """The routing fields and whether the file part has begun. Of a body's start
    (``complete`` False) a field counts only once its closing delimiter has arrived:
    a value cut by the end of what was read is not the value."""
    seen = Seen()
    at = raw.find(delim)
    seen.parts = at >= 0
    while at >= 0:
        start = at + len(delim)
        if raw[start : start + 2] == b"--":
            break  # the closing delimiter
        end = raw.find(b"\r\n" + delim, start)
        head_end = raw.find(b"\r\n\r\n", start, end if end >= 0 else len(raw))
        if head_end < 0:
            break
        head = bytes(raw[start:head_end])
        name = NAME.search(head)
        if name is not None and name.group(1) == b"file" and b"filename=" in head:
            seen.file = True  # there is one (its bytes stay where they are)
        elif name is not None and b"filename=" not in head and name.group(1) in FIELDS:
            if end < 0 and not complete:
                break  # its value is still to come
            value = raw[head_end + 4 : end if end >= 0 else len(raw)]
            if len(value) <= FIELD_MAX:
                seen.fields[name.group(1).decode()] = bytes(value).decode(errors="replace")
        at = end + 2 if end >= 0 else -1
    return seen


def incoming(seen: Seen, headers: Mapping[str, str]) -> Incoming:
    """The request as the router routes it; 400 when the form has no file part."""
    if not seen.parts:
        raise BadRequest("the form has no parts (its boundary never occurs)")
    if not seen.file:
        raise BadRequest("the form has no file part (a field named file, with a filename)", "file")
    stream = seen.fields.get("stream", "false").strip().lower() in ("true", "1")
    return Incoming(
        body={},  # nothing the router writes into: a rank goes in a header
        model=seen.fields.get("model"),
        stream=stream,
        key=routing_key(headers, {}),
        text="",
        tokens=DEFAULT_OUTPUT,
        output=DEFAULT_OUTPUT,
    )
