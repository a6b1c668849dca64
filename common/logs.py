"""Logging of API pods and workers: one JSON object per line (LOG_FORMAT=json) or plain text, with the id
of the request a line is about.

The API binds the request id to the handling task with :func:`bind_request_id` (a context variable, so
concurrent requests never mix); the worker, which interleaves many requests in one loop, passes it per call
as ``extra={"request_id": job.request_id}``. Either way the record gets a ``request_id`` attribute. The line
that ends a request also names the end ``user`` the client gave (OpenAI's ``user``), so that an operator can
follow one user's traffic.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Literal

_REQUEST_ID: ContextVar[str | None] = ContextVar("ferry_request_id", default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


def bind_request_id(request_id: str) -> None:
    """Tag every following log line of the current request (task) with its id."""
    _REQUEST_ID.set(request_id)


class RequestIdFilter(logging.Filter):
    """Gives every record a ``request_id`` (None when unknown) and the ``request_tag`` of the text form."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None)
        if request_id is None:
            request_id = record.request_id = _REQUEST_ID.get()
        user = getattr(record, "user", None)
        record.request_tag = f" [{request_id}{f' user={user}' if user else ''}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """time (ISO 8601, UTC), level, logger, message, request_id and user when known, exception when there is
    one."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, object] = {
            "time": f"{created}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "user"):
            if value := getattr(record, key, None):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(log_format: Literal["text", "json"], level: str = "INFO") -> None:
    """Send every logger's records (uvicorn's too: run it with ``log_config=None``) and Python's warnings to
    stderr in one format."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings too, so stderr holds nothing but log lines
