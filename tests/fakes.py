"""A stand-in for the queue and the workers, for adapter tests that need no Redis and no model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

import api.pipeline
from api.context import ServerContext
from api.errors import PipelineError
from api.request import QueuedRequest
from common.protocol import Finish, TokenEvent, TokenInfo

SubmitFn = Callable[[ServerContext, QueuedRequest], Awaitable["FakeSubmission"]]


class FakeSubmission:
    """Replays the given events like :class:`api.pipeline.Submission`, then raises ``error`` if given."""

    def __init__(self, ctx: ServerContext, events: list[TokenEvent], error: PipelineError | None = None) -> None:
        self.ctx = ctx
        self._events = events
        self._error = error
        self._taken = 0
        self.closed = False
        self.elapsed = 0.0  # seconds since queueing: none pass here

    @property
    def ready(self) -> bool:
        """Every replayed event (and the error) is here from the start, as when a busy pod falls behind."""
        return self._taken < len(self._events) or (self._error is not None and self._taken == len(self._events))

    async def events(self) -> AsyncIterator[TokenEvent]:
        for event in self._events:
            self._taken += 1
            yield event
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        self.closed = True


def patch_submit(monkeypatch: pytest.MonkeyPatch, submit: SubmitFn) -> None:
    """Route every adapter's queueing (whole generations and streams alike: both reach
    :func:`api.pipeline.submit`) through ``submit``."""
    monkeypatch.setattr(api.pipeline, "submit", submit)


async def one_token_submit(ctx: ServerContext, request: QueuedRequest) -> FakeSubmission:
    """A stand-in worker answering one token, "x", to every accepted request."""
    token = TokenInfo(id=5, text="x", logprob=-0.5, special=False)
    finish = Finish(finish_reason="length", generated_tokens=1, prompt_tokens=len(request.input_ids),
                    seed=request.params.seed, generated_text="x")
    return FakeSubmission(ctx, [TokenEvent(index=0, token=token, finish=finish)])
