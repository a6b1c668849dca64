"""Server-sent events for every protocol: TGI framing (``data:`` + one line of JSON + blank line)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.context import ServerContext
from api.errors import PipelineError
from common.protocol import TokenEvent

SSE_KEEPALIVE_SECONDS = 15
MAX_EVENTS_PER_WRITE = 64
SHUTDOWN_WRITE_SECONDS = 2.0
"""Past shutdownGraceSeconds, how long a stream has to write the error that ends it (the pod ends its requests then:
:class:`api.main.PodServer`) before sse-starlette cancels it."""


class StreamSource(Protocol):
    """What a stream reads of a queued request (:class:`api.pipeline.Submission`), so that streams do not
    depend on the pipeline."""

    ctx: ServerContext

    @property
    def ready(self) -> bool: ...

    def events(self) -> AsyncIterator[TokenEvent]: ...

    async def close(self) -> None: ...


def _frame(payload: str) -> bytes:
    return ServerSentEvent(payload, sep="\n").encode()


def event_stream(
    submission: StreamSource,
    render: Callable[[AsyncIterator[TokenEvent]], AsyncIterator[str]],
    render_error: Callable[[PipelineError], str],
    headers: Mapping[str, str] | None = None,
) -> EventSourceResponse:
    """Stream a submitted request: ``render`` turns its token events into event payloads, a failure after
    the start becomes one last ``render_error`` event. The submission is closed however the stream ends
    (a client that disconnects cancels the stream, and closing then cancels the request at the worker).

    Events that are already here when one is sent go out with it in one write: a pod that falls behind
    catches up with fewer, larger writes instead of one per token (each write is a system call and a pass
    through the ASGI stack). On shutdown open streams get ``shutdownGraceSeconds`` to finish; then the pod ends
    their requests, and each stream's last event is the error that says so.
    """

    async def body() -> AsyncIterator[bytes]:
        frames: list[bytes] = []
        try:
            try:
                async for payload in render(submission.events()):
                    frames.append(_frame(payload))
                    if not submission.ready or len(frames) >= MAX_EVENTS_PER_WRITE:
                        yield b"".join(frames)
                        frames.clear()
            except PipelineError as exc:
                frames.append(_frame(render_error(exc)))
            if frames:
                yield b"".join(frames)
        finally:
            await submission.close()

    return EventSourceResponse(
        body(),
        sep="\n",
        ping=SSE_KEEPALIVE_SECONDS,
        headers=dict(headers or {}),
        shutdown_grace_period=submission.ctx.settings.shutdown_grace_seconds + SHUTDOWN_WRITE_SECONDS,
        background=BackgroundTask(submission.close),  # in case the body never ran
    )
