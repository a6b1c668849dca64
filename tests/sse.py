"""Parsing server-sent event bodies in tests: TGI framing, ``data:`` + one line + blank line."""

from __future__ import annotations

import json
from typing import Any


def sse_data(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON decoded but ``[DONE]``; every line is data, comment or blank."""
    payloads = []
    for line in text.split("\n"):
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            payloads.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return payloads
