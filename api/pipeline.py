"""The job path under every protocol: queue a resolved request (:class:`api.request.QueuedRequest`), relay its
events.

Adapters reach it with a request :mod:`api.resolve` made: :func:`generate_for`, or :func:`submit_for` and
:meth:`Submission.events` to stream, each mapping a :class:`~api.errors.PipelineError` to their protocol's status.
Nothing else touches the job stream or the reply channels.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from pydantic import BaseModel, Field
from starlette.requests import Request

from api.context import ServerContext
from api.errors import PipelineError, Protocol
from api.relay import RelayUnavailable
from api.request import QueuedRequest
from common import keys
from common.cluster import live_workers
from common.connection import REDIS_ERRORS, as_text, publish, publish_command
from common.logs import bind_request_id
from common.protocol import (
    Control,
    ErrorEvent,
    Finish,
    Job,
    MediaRef,
    TokenEvent,
    TokenInfo,
    decode_event,
)

log = logging.getLogger(__name__)


class GenerationResult(BaseModel):
    """The collected output of a non-stream request."""

    tokens: list[TokenInfo]
    finish: Finish
    duration: float = Field(0.0, ge=0, description="seconds from queueing to the last token, as this pod saw them")


async def unready_reason(ctx: ServerContext) -> str | None:
    """Why the pod cannot serve now (draining after stopService, Redis down, no live worker of the model), or
    None when it can: /health answers 503 then, so a load balancer stops sending requests here."""
    if ctx.drain.stopping:
        return "the pod is stopping (stopService): it takes no new request"
    try:
        workers = await live_workers(ctx.redis, ctx.model.model_id, time.time())
    except Exception as exc:  # Redis unreachable: not ready, never a 500
        return f"Redis is unreachable: {exc}"
    if workers == 0:
        return f"no live worker serves model {ctx.model.model_id}"
    return None


CLOSE_TIMEOUT_SECONDS = 5.0


class Submission:
    """A queued request: its token events, and what happens when the caller stops listening.

    Made by :func:`submit`, which has already checked the limits and queued the job, so adapters can answer
    overload or a duplicate id with a status before a stream starts. :meth:`close` must follow (it is
    idempotent): it releases the request id and, when the request did not finish, tells the workers to
    drop it so no compute is spent on a client that left.
    """

    def __init__(self, ctx: ServerContext, job: Job, queue: asyncio.Queue[bytes], request_id: str,
                 queued_at: float) -> None:
        self.ctx = ctx
        self.job = job
        # The client's id (x-request-id, KServe `id`); the job's own id adds a nonce to it (see _queue).
        self.request_id = request_id
        self._queue = queue
        # Monotonic time taken before the job was queued: a worker may start it before XADD returns here, and
        # the request's duration must cover the worker's (Triton's statistics: success >= compute_infer).
        self.queued_at = queued_at
        self._expires_at = job.local_deadline()
        self.finish: Finish | None = None  # the last event's, once it came
        self.failure: str | None = None  # the error type that ended the request, if one did
        self._closed = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The token events in order, each index once; the last carries ``finish``.

        Raises :class:`PipelineError` on a worker error, a timeout (tokenTimeout between events, e2eTimeout
        overall) or a lost Redis connection.
        """
        next_index = 0
        last_token_at = self.queued_at
        while True:
            event = await self._receive()
            if event.index < next_index:  # a re-delivered job replays from index 0
                continue
            next_index = event.index + 1
            now = time.monotonic()
            self.ctx.metrics.token_received(self.job.model, now - last_token_at, first=event.index == 0)
            last_token_at = now
            if event.finish is not None:
                self.finish = event.finish
            yield event
            if event.finish is not None:
                return

    @property
    def elapsed(self) -> float:
        """Seconds since the job was queued."""
        return time.monotonic() - self.queued_at

    async def _receive(self) -> TokenEvent:
        """The next token event; a failure (worker error, timeout) is noted for the metrics."""
        try:
            event = decode_event(await self._next())
            if isinstance(event, ErrorEvent):
                raise PipelineError(event.message, event.error_type)
        except PipelineError as exc:
            self.failure = exc.error_type
            raise
        return event

    @property
    def ready(self) -> bool:
        """Whether an event is already here (the next one is had without waiting)."""
        return not self._queue.empty()

    async def _next(self) -> bytes:
        settings = self.ctx.settings
        wait = min(settings.token_timeout, self._expires_at - time.monotonic())
        try:
            if wait <= 0:  # past the deadline: even an event that is here comes too late
                raise TimeoutError
            if self.ready:  # no timer for an event that is here (a busy pod catching up)
                return self._queue.get_nowait()
            async with asyncio.timeout(None if math.isinf(wait) else wait):  # not wait_for: no task per token
                return await self._queue.get()
        except TimeoutError:
            raise PipelineError(
                f"request timed out: no token within {max(wait, 0):.3g} s (tokenTimeout {settings.token_timeout:g} s, "
                f"e2eTimeout {settings.e2e_timeout:g} s)",
                "incomplete_generation",
            ) from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._record()
        ctx, model = self.ctx, self.job.model
        ctx.relay.release(self.job.request_id)
        # Often called from a cancelled task (the body of a stream whose client left), where every await
        # would be cancelled too: shield the clean-up, but never wait long for Redis.
        with anyio.move_on_after(CLOSE_TIMEOUT_SECONDS, shield=True):
            try:
                if self.finish is None:
                    await send_control(ctx, Control(request_id=self.job.request_id, action="cancel"))
                await ctx.redis.delete(keys.inflight_key(model, self.request_id), *(ref.key for ref in self.job.media))
            except REDIS_ERRORS:
                log.warning("could not release request %s: Redis unreachable", self.request_id)

    def _record(self) -> None:
        """The request's outcome, in the metrics and one log line (the one place every protocol's requests end)."""
        model, finish, extra = self.job.model, self.finish, {"request_id": self.request_id, "user": self.job.user}
        if finish is None:
            failure = self.failure or "cancelled"
            self.ctx.metrics.request_failed(model, failure, self.elapsed)
            log.info("request ended unfinished (%s) after %.3f s", failure, self.elapsed, extra=extra)
            return
        self.ctx.metrics.request_finished(model, finish, self.elapsed)
        log.info(
            "request finished (%s): %d prompt + %d generated tokens, queue %.3f s, inference %.3f s, total %.3f s",
            finish.finish_reason, finish.prompt_tokens, finish.generated_tokens, finish.queue_time,
            finish.inference_time, self.elapsed, extra=extra,
        )


async def send_control(ctx: ServerContext, control: Control) -> None:
    """Tell the model's workers to cancel or stop a request, whether it is running or still queued."""
    model = ctx.model.model_id
    payload = control.model_dump_json()
    pipe = ctx.redis.pipeline(transaction=False)
    pipe.set(keys.control_key(model, control.request_id), payload, ex=int(ctx.settings.e2e_timeout) + 60)
    publish(pipe, ctx.settings.redis_cluster, keys.control_channel(model), payload)
    await pipe.execute()


async def submit(ctx: ServerContext, request: QueuedRequest) -> Submission:
    """Check the pod's and the queue's limits, then queue the request's job (see :func:`_queue`); counted in
    the metrics either way, and the request id tags the handler's log lines from here on."""
    bind_request_id(request.request_id)
    model = ctx.model.model_id
    try:
        submission = await _queue(ctx, request)
    except PipelineError as exc:
        ctx.metrics.request_refused(model, exc.error_type)
        raise
    ctx.metrics.request_queued(model, len(request.input_ids), request.params.max_new_tokens, request.adapter)
    if request.adapter is not None:
        log.info("queued with the LoRA adapter %s", request.adapter)
    return submission


# Admission in one step of Redis, so that requests arriving together on any number of pods cannot all pass the
# queue bound: the in-flight id is taken, the depth read and the job added without any other command between
# (every key is the model's, one slot of a cluster). KEYS: the in-flight key, the job's stream, then every job
# stream; ARGV: the job id, the in-flight key's TTL, maxQueueSize, the entry's field and the job's JSON, the queued
# notice's publish command, channel and message. Answers {"ok"|"duplicate"|"full", depth}.
ADMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'duplicate', 0} end
local depth = 0
for i = 3, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
if depth >= tonumber(ARGV[3]) then return {'full', depth} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[5])
redis.call(ARGV[6], ARGV[7], ARGV[8])
return {'ok', depth}
"""


async def _adapter_path(ctx: ServerContext, name: str | None) -> str | None:
    """The folder of the model's LoRA adapter ``name`` (None: the base model, no folder); a ``validation``
    error when the model does not have it."""
    if name is None:
        return None
    model = ctx.model.model_id
    path = await ctx.redis.hget(keys.adapters_key(model), name)
    if path is None:
        raise PipelineError(f"the LoRA adapter `{name}` is not loaded for model `{model}` (configure it in "
                            "loraModules or load it with POST /v1/load_lora_adapter)", "validation")
    return as_text(path)


async def _admit(ctx: ServerContext, job: Job, request: QueuedRequest) -> None:
    """Queue the job with :data:`ADMIT_SCRIPT`, its media written first in the same round trip (a worker may
    take the job at once) and deleted when it is refused: ``validation`` for a request id in flight,
    ``overloaded`` at maxQueueSize jobs queued or running."""
    settings, model = ctx.settings, job.model
    ttl = int(settings.e2e_timeout) + 60
    pipe = ctx.redis.pipeline(transaction=False)
    for ref, item in zip(job.media, request.media, strict=True):
        pipe.set(ref.key, item.data, ex=ttl)
    notice = publish_command(settings.redis_cluster, keys.control_channel(model),
                             Control(request_id=job.request_id, action="queued").model_dump_json())
    streams = keys.job_streams(model)
    script_keys = [keys.inflight_key(model, request.request_id), keys.job_stream(model, job.priority), *streams]
    pipe.eval(ADMIT_SCRIPT, len(script_keys), *script_keys, job.request_id, ttl, settings.max_queue_size,
              keys.JOB_FIELD, job.model_dump_json(), *notice)
    verdict, depth = (await pipe.execute())[-1]
    if verdict == b"ok":
        return
    if job.media:
        await ctx.redis.delete(*(ref.key for ref in job.media))
    if verdict == b"duplicate":
        raise PipelineError(f"a request with id '{request.request_id}' is already in flight", "validation")
    raise PipelineError(f"the queue of model {model} is full ({depth} requests, maxQueueSize "
                        f"{settings.max_queue_size}); retry later", "overloaded")


async def _queue(ctx: ServerContext, request: QueuedRequest) -> Submission:
    """Check the pod's and the queue's limits, then queue the request's job.

    Raises :class:`PipelineError`: ``overloaded`` past maxLinkNum requests on this pod or maxQueueSize jobs
    queued or running for the model, ``validation`` for a request id already in flight or a LoRA adapter the
    model does not have, ``unavailable`` when Redis cannot be reached, ``stopping`` once stopService was
    called. The relay is listening before the job is queued.
    """
    settings = ctx.settings
    if ctx.drain.stopping:
        raise PipelineError("this server is stopping (stopService); send the request to another server", "stopping")
    if not ctx.relay.connected:
        raise PipelineError("not connected to Redis; retry later", "unavailable")
    if ctx.relay.in_flight >= settings.max_link_num:
        raise PipelineError(f"too many concurrent requests on this server (maxLinkNum {settings.max_link_num})",
                            "overloaded")
    now, queued_at = time.time(), time.monotonic()
    job_id = f"{request.request_id}.{uuid.uuid4().hex[:12]}"  # Job.request_id: unique to this submission
    # Registering takes one of the pod's maxLinkNum places with no await since the check above, so
    # concurrent requests cannot all pass the check; every failure below gives the place back.
    try:
        queue = await ctx.relay.register(job_id)
    except RelayUnavailable as exc:
        raise PipelineError(f"the events relay is unavailable: {exc}", "unavailable") from None
    try:
        job = Job(
            **{**request.resolved(), "request_id": job_id},
            model=ctx.model.model_id,
            reply_channel=ctx.relay.channel(job_id),
            media=[MediaRef(kind=item.kind, key=keys.media_key(ctx.model.model_id, job_id, index),
                            size=len(item.data)) for index, item in enumerate(request.media)],
            adapter_path=await _adapter_path(ctx, request.adapter),
            enqueued_at=now,
            deadline=now + settings.e2e_timeout,
        )
        await _admit(ctx, job, request)
    except BaseException as exc:
        ctx.relay.release(job_id)
        if isinstance(exc, REDIS_ERRORS):
            raise PipelineError(f"the job queue is unreachable: {exc}", "unavailable") from None
        raise
    return Submission(ctx, job, queue, request.request_id, queued_at)


async def generate(ctx: ServerContext, request: QueuedRequest, client: Request | None = None) -> GenerationResult:
    """Run the request to completion and return all its tokens (see :meth:`Submission.events`).

    When the HTTP ``client`` leaves first, collecting stops at once and :meth:`Submission.close` tells the
    worker to drop the request.
    """
    submission = await submit(ctx, request)
    try:
        if client is None:
            return await _collect(submission)
        collecting = asyncio.ensure_future(_collect(submission))
        watching = asyncio.ensure_future(_until_gone(client))
        try:
            done, _ = await asyncio.wait((collecting, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            collecting.cancel()  # no-op on the one that finished
            watching.cancel()
        if collecting in done:
            return collecting.result()  # or its PipelineError
        submission.failure = "client_disconnected"
        raise PipelineError("the client disconnected", "client_disconnected")
    finally:
        await submission.close()


async def _until_gone(client: Request) -> None:
    """Return when the client closes its connection. Its body is read, so the server's ``receive`` blocks
    until the disconnect (as Starlette's streaming responses wait for it): no polling, no delay."""
    while (await client.receive())["type"] != "http.disconnect":
        pass


async def _collect(submission: Submission) -> GenerationResult:
    tokens: list[TokenInfo] = []
    async for event in submission.events():
        tokens.append(event.token)
        if event.finish is not None:
            return GenerationResult(tokens=tokens, finish=event.finish, duration=submission.elapsed)
    raise PipelineError("the token stream ended without a final event", "incomplete_generation")


async def generate_for(
    ctx: ServerContext, protocol: Protocol, request: QueuedRequest, client: Request
) -> GenerationResult:
    """Run the request to completion (:func:`generate`); a failure as the protocol's error."""
    try:
        return await generate(ctx, request, client)
    except PipelineError as exc:
        raise protocol.failure(exc) from None


async def submit_for(ctx: ServerContext, protocol: Protocol, request: QueuedRequest) -> Submission:
    """Queue the request for a stream (:func:`submit`); a refusal as the protocol's error, so it answers with a
    status before the stream starts."""
    try:
        return await submit(ctx, request)
    except PipelineError as exc:
        raise protocol.failure(exc) from None
