"""api.sse: events that are already here when one is sent share its write (bench/serve_bench.py fan-out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from api.errors import PipelineError
from api.sse import event_stream
from common.protocol import TokenEvent, TokenInfo
from common.settings import Settings
from tests.fakes import FakeSubmission


def _events(count: int) -> list[TokenEvent]:
    return [TokenEvent(index=i, token=TokenInfo(id=i, text=f"t{i}", logprob=0.0, special=False)) for i in range(count)]


async def _render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
    async for event in events:
        yield event.token.text


async def _writes(submission: FakeSubmission) -> list[bytes]:
    """The body writes the stream makes, as the ASGI server receives them."""
    writes: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)  # the client stays until the stream ends
        return {"type": "http.disconnect"}

    response = event_stream(submission, _render, lambda exc: f"error: {exc.message}")
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    await asyncio.wait_for(response(scope, receive, send), 10)
    return writes


def _submission(events: list[TokenEvent], error: PipelineError | None = None) -> FakeSubmission:
    ctx: Any = SimpleNamespace(settings=Settings(model_path=Path("unused")))
    return FakeSubmission(ctx, events, error)


async def test_events_already_here_go_out_in_one_write() -> None:
    submission = _submission(_events(3))
    assert await _writes(submission) == [b"data: t0\n\ndata: t1\n\ndata: t2\n\n"]
    assert submission.closed


async def test_a_failure_goes_out_with_the_events_before_it() -> None:
    writes = await _writes(_submission(_events(2), PipelineError("the worker died", "generation")))
    assert writes == [b"data: t0\n\ndata: t1\n\ndata: error: the worker died\n\n"]
