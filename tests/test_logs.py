"""Log lines: one JSON object per line (LOG_FORMAT=json) or text, tagged with the request id when known."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from common.logs import bind_request_id, configure_logging


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_json_lines_with_request_ids(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "INFO")
    log = logging.getLogger("ferry.test")

    async def request(request_id: str) -> None:
        bind_request_id(request_id)  # per task: concurrent requests never mix
        await asyncio.sleep(0)
        log.info("handled %s", request_id)

    async def both() -> None:
        await asyncio.gather(request("req-a"), request("req-b"))

    asyncio.run(both())
    log.warning("from the worker", extra={"request_id": "job-7"})
    log.info("request finished", extra={"request_id": "req-c", "user": "ann"})
    log.debug("below the level")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    records = [json.loads(line) for line in lines(capsys.readouterr().err)]
    assert [(r["message"], r.get("request_id")) for r in records] == [
        ("handled req-a", "req-a"), ("handled req-b", "req-b"), ("from the worker", "job-7"),
        ("request finished", "req-c"), ("failed", None),
    ]
    assert records[3]["user"] == "ann" and all("user" not in r for r in records[:3])
    assert records[0]["level"] == "INFO" and records[0]["logger"] == "ferry.test"
    assert records[0]["time"].endswith("Z") and "T" in records[0]["time"]
    assert "ValueError: boom" in records[-1]["exception"]


def test_text_lines(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("text", "INFO")
    logging.getLogger("ferry.test").info("hello", extra={"request_id": "r1"})
    logging.getLogger("ferry.test").info("no request")
    logging.getLogger("ferry.test").info("done", extra={"request_id": "r2", "user": "ann"})
    first, second, third = lines(capsys.readouterr().err)
    assert first.endswith("INFO ferry.test [r1]: hello") and second.endswith("INFO ferry.test: no request")
    assert third.endswith("INFO ferry.test [r2 user=ann]: done")
