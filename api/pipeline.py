"""The one request path every protocol adapter uses: queue a job, relay its events.

Adapters (TGI, KServe v2, ...) validate their own request shape, build a :class:`GenerationRequest` and
call :func:`stream_tokens` or :func:`generate`; they only translate shapes, never touch Redis themselves.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from pydantic import BaseModel, Field

from api.context import ServerContext
from api.health import live_workers
from common import keys
from common.protocol import ErrorEvent, Finish, Job, SamplingParams, TokenEvent, TokenInfo, decode_event

REQUEST_ID_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")
MAX_INPUT_CHARS = 4 * 1024 * 1024  # SPEC.md: a text prompt has at most 4 MiB of characters
# SPEC.md's limits on stop strings, the same on every route that takes them.
MAX_STOP_ITEMS = 1024
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 32768


class GenerationError(Exception):
    """The worker reported a failure for the request."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type


class GenerationRequest(BaseModel):
    """The protocol-independent request: what every adapter's input is translated to."""

    request_id: str
    input_ids: list[int] = Field(min_length=1)
    params: SamplingParams
    decoder_input_details: bool = False


class GenerationResult(BaseModel):
    """The collected output of a non-stream request."""

    tokens: list[TokenInfo]
    finish: Finish


def new_request_id() -> str:
    return uuid.uuid4().hex


def random_seed() -> int:
    """A server-chosen seed in the spec's range (0, 2^64-1], sent with the job so a retry reproduces it."""
    return secrets.randbelow(2**64 - 1) + 1


def check_text(field: str, value: str) -> str:
    """Reject text that is not valid Unicode (a JSON escape like "\\ud800" yields a lone surrogate), which
    neither the tokenizer nor the job's JSON could carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"`{field}` must be valid Unicode text: it contains an unpaired surrogate") from None
    return value


def validate_stop(value: list[str] | str | None) -> list[str]:
    """The stop strings as a list (a string is one item, null or [] none), within SPEC.md's limits."""
    stops = [check_text("stop", value)] if isinstance(value, str) else [check_text("stop", s) for s in value or []]
    if len(stops) > MAX_STOP_ITEMS:
        raise ValueError(f"`stop` supports up to {MAX_STOP_ITEMS} stop sequences. Given: {len(stops)}")
    for item in stops:
        if not 1 <= len(item) <= MAX_STOP_CHARS:
            raise ValueError(f"each `stop` sequence must have 1 to {MAX_STOP_CHARS} characters. Given: {len(item)}")
    total = sum(len(item) for item in stops)
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(f"`stop` sequences must total at most {MAX_STOP_TOTAL_CHARS} characters. Given: {total}")
    return stops


async def tokenize(ctx: ServerContext, text: str) -> list[int]:
    """The prompt's token ids, computed off the event loop (a long prompt takes a while)."""
    return (await anyio.to_thread.run_sync(ctx.model.tokenizer, text))["input_ids"]


async def unready_reason(ctx: ServerContext) -> str | None:
    """Why the pod cannot serve now (Redis down, no live worker of the model), or None when it can."""
    try:
        workers = await live_workers(ctx.redis, ctx.model.model_id, time.time())
    except Exception as exc:  # Redis unreachable: not ready, never a 500
        return f"Redis is unreachable: {exc}"
    if workers == 0:
        return f"no live worker serves model {ctx.model.model_id}"
    return None


def effective_max_new_tokens(ctx: ServerContext, requested: int | None, default: int = 20) -> int:
    """SPEC.md: the limit actually applied is min(maxIterTimes, max_new_tokens)."""
    return min(ctx.settings.max_iter_times, requested if requested is not None else default)


async def stream_tokens(ctx: ServerContext, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """Queue the request's job and yield its token events in order; the last one carries ``finish``.

    Raises :class:`GenerationError` when the worker reports a failure. Events already relayed (a
    re-delivered job replays from index 0) are dropped, so the caller sees each index exactly once.
    """
    job = Job(
        request_id=request.request_id,
        model=ctx.model.model_id,
        reply_channel=ctx.relay.channel(request.request_id),
        input_ids=request.input_ids,
        params=request.params,
        decoder_input_details=request.decoder_input_details,
        enqueued_at=time.time(),
    )
    async with ctx.relay.subscription(request.request_id) as queue:
        await ctx.redis.xadd(keys.job_stream(job.model), {keys.JOB_FIELD: job.model_dump_json()})
        next_index = 0
        while True:
            event = decode_event(await queue.get())
            if isinstance(event, ErrorEvent):
                raise GenerationError(event.message, event.error_type)
            if event.index < next_index:
                continue
            next_index = event.index + 1
            yield event
            if event.finish is not None:
                return


async def generate(ctx: ServerContext, request: GenerationRequest) -> GenerationResult:
    """Run the request to completion and return all its tokens."""
    tokens: list[TokenInfo] = []
    async for event in stream_tokens(ctx, request):
        tokens.append(event.token)
        if event.finish is not None:
            return GenerationResult(tokens=tokens, finish=event.finish)
    raise GenerationError("the token stream ended without a final event", "incomplete_generation")
