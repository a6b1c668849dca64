"""Server-sent events for every protocol: TGI framing (``data:`` + one line of JSON + blank line)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from api.pipeline import PipelineError, Submission
from common.protocol import TokenEvent

SSE_KEEPALIVE_SECONDS = 15


def event_stream(
    submission: Submission,
    render: Callable[[AsyncIterator[TokenEvent]], AsyncIterator[str]],
    render_error: Callable[[PipelineError], str],
    headers: Mapping[str, str] | None = None,
) -> EventSourceResponse:
    """Stream a submitted request: ``render`` turns its token events into event payloads, a failure after
    the start becomes one last ``render_error`` event. The submission is closed however the stream ends
    (a client that disconnects cancels the stream, and closing then cancels the request at the worker).

    On shutdown open streams get ``shutdownGraceSeconds`` to finish before they are cut.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for payload in render(submission.events()):
                yield payload
        except PipelineError as exc:
            yield render_error(exc)
        finally:
            await submission.close()

    return EventSourceResponse(
        body(),
        sep="\n",
        ping=SSE_KEEPALIVE_SECONDS,
        headers=dict(headers or {}),
        shutdown_grace_period=submission.ctx.settings.shutdown_grace_seconds,
        background=BackgroundTask(submission.close),  # in case the body never ran
    )
