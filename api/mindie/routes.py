"""MindIE's native inference routes: ``POST /generate`` in vLLM 0.2.6's dialect, ``POST /infer`` and
``/infer_token``, ``POST /v1/tokenizer``.

A thin translation like :mod:`api.tgi.routes`: each body becomes an :class:`api.request.InferenceRequest`; errors
are TGI's (``{"error", "error_type"}``, 422 for a bad input: :mod:`api.tgi_format`), as MindIE answers them.

``POST /generate`` is shared with TGI. Its one route here (:func:`generate_router`) reads the body once and picks
the dialect by its prompt field (:data:`api.mindie.schemas.GenerateBody`): ``inputs`` is TGI's body, handed to
TGI's handler (:func:`api.tgi.routes.generate_route`, which the app wires in: TGI's module keeps its handler and
rules); ``prompt`` is vLLM's; both or neither is a 422. TGI's router declares no ``/generate`` route of its own.

vLLM dialect: ``{"text": [prompt + completion]}`` as vLLM 0.2.6's api_server answers. Its stream (``stream``:
true) is vLLM's framing, JSON objects each followed by a NUL byte (not SSE), but each object holds the
DELTA of that step, ``{"text": ["<new text>"]}`` (the issue's choice; vLLM 0.2.6 itself sends the prompt and
all the text so far each time): a client joins the deltas, after the prompt it sent. A failure after the
stream started is a last ``{"error", "error_type"}`` object.

``/infer`` and ``/infer_token`` take the same body: a text ``inputs`` or token ids ``input_id``, TGI's
``parameters`` plus ``priority`` (1 to 5, default 5: workers take a queued job of a lower number first, first
come first served within one; running requests are not preempted) and ``timeout`` (seconds, the request's own
deadline: past it a request answers 500 ``incomplete_generation``, or ends its stream with that error event;
``e2eTimeout`` and ``tokenTimeout`` still apply, the earliest wins). Their stream is SSE, one event per token
with the pod's timings in ms: ``prefill_time`` on the first event (queueing to first token), ``decode_time`` on
the others (since the previous token).

MindIE's status, health and metrics routes (GET), each read from the live workers' reports in Redis
(:func:`api.health.model_states`, the reader of ``/health`` and ``/metrics``) and the pod's own
:class:`api.metrics.ApiMetrics`; Redis unreachable is a 503 ``unavailable``:

- ``/v2/models/{m}/getSlotCount``: ``{"total_slots", "free_slots", "available_tokens_length"}`` summed over
  the model's live workers (maxBatchSize, minus the requests running; KV tokens free). Unknown model: 404
  ``{"error": "Model X not found.", "error_type": "NotFoundError"}``.
- ``/v1/status`` and ``/v2/status`` (the same answer): :class:`api.mindie.schemas.StatusResponse`.
- ``/health/timed`` and ``/health/timed-{N}`` (N seconds, 1 to 3600, default 10; anything else is a 422):
  one real one-token generation through the pipeline within N seconds: 200 ``{"status": "healthy"}``, else
  500 ``{"status": "unhealthy", "error"}`` (at once when no worker of the default model is alive). The probe
  is a request like any other: it counts in the metrics. Open without an API key (kubelets send none), so
  bounded: one probe at a time per pod, whose result every caller waiting shares and which answers the calls
  of the next ``timedHealthCacheSeconds`` (:class:`api.context.TimedHealthProbe`).
- ``/metrics-json``: :class:`api.mindie.schemas.MetricsJsonResponse`, the means read from the pod's
  histograms (``collect()``), the counts from the workers' reports.

Every response of these routes, errors included, carries a ``RequestUUID`` header (:mod:`api.mindie_format`):
the pipeline's request id on the inference routes (``x-request-id`` when TGI's ``/generate`` got one), a new
id on the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from api import pipeline
from api.context import ProbeResult, ServerContext, get_ctx
from api.errors import OpenApiResponses, PipelineError, ProtocolError
from api.health import model_states
from api.mindie.schemas import (
    NUL,
    GenerateBody,
    MetricsJsonResponse,
    MindIEDetails,
    MindIEInferRequest,
    MindIEInferResponse,
    MindIEPrefillToken,
    MindIEStreamDetails,
    MindIEStreamResponse,
    MindIEStreamToken,
    ModelLoad,
    ModelMetrics,
    SlotCountResponse,
    StatusResponse,
    TimedHealthResponse,
    TokenizeRequest,
    TokenizeResponse,
    VLLMGenerateRequest,
    VLLMGenerateResponse,
)
from api.mindie_format import MindIERoute
from api.pipeline import Submission, generate_for, submit_for, unready_reason
from api.request import InferenceRequest, QueuedRequest, new_request_id
from api.resolve import resolve, tokenize
from api.rules import GREEDY_TEMPERATURE
from api.sse import event_stream
from api.tgi_format import (
    ERROR_RESPONSES,
    SSE_CONTENT,
    TGI,
    RequestIdHeader,
    TGIErrorResponse,
    TGIGenerateResponse,
    TGIRequest,
    client_request_id,
)
from common.cluster import ModelState
from common.protocol import DEFAULT_PRIORITY, TokenEvent

log = logging.getLogger(__name__)

NUL_STREAM = "application/octet-stream"  # vLLM 0.2.6 sets none; its client splits the body on NUL bytes
DEFAULT_HEALTH_SECONDS = 10  # GET /health/timed
MAX_HEALTH_SECONDS = 3600
HEALTH_PROMPT = "hi"


router = APIRouter(route_class=MindIERoute, tags=["MindIE"])
Ctx = Annotated[ServerContext, Depends(get_ctx)]


def _error_event(exc: PipelineError) -> dict[str, str]:
    return {"error": exc.message, "error_type": exc.error_type}


def _timed_out(timeout: int) -> PipelineError:
    return PipelineError(f"request timed out: its `timeout` of {timeout} s passed", "incomplete_generation")


# ------------------------------------------------------------------------------- POST /generate


TGIGenerate = Callable[[TGIRequest, ServerContext, Request, str | None], Awaitable[Response]]
"""TGI's answer to a TGI body of ``POST /generate`` (:func:`api.tgi.routes.generate_route`)."""


def generate_router(tgi_generate: TGIGenerate) -> APIRouter:
    """The router of ``POST /generate``: vLLM's bodies answered here, TGI's by ``tgi_generate``, which the app
    hands in (:func:`api.app.create_app`) so that neither protocol imports the other."""
    generate = APIRouter(route_class=MindIERoute, tags=["MindIE"])

    @generate.post(
        "/generate",
        responses={**ERROR_RESPONSES, 200: {
            "model": TGIGenerateResponse | VLLMGenerateResponse,
            "content": {NUL_STREAM: {}},
            "description": "TGI's answer to an `inputs` body; vLLM 0.2.6's `{\"text\": [prompt + completion]}` to a "
                           "`prompt` body, or with stream=true its NUL-delimited JSON objects `{\"text\": [delta]}`",
        }},
        summary="Generate text: TGI's body (`inputs`) or vLLM 0.2.6's (`prompt`)",
    )
    async def generate_route(
        body: GenerateBody, ctx: Ctx, http: Request, x_request_id: RequestIdHeader = None
    ) -> Response:
        """One route, two dialects (see the module's docstring); ``x-request-id`` names the request in both."""
        request_id = client_request_id(x_request_id)  # TGI's rule for the header, shared by both dialects
        if request_id is not None:
            http.state.request_uuid = request_id
        if isinstance(body, VLLMGenerateRequest):
            return await _vllm_generate(ctx, body, http)
        return await tgi_generate(body, ctx, http, http.state.request_uuid)

    return generate


def vllm_inference_request(body: VLLMGenerateRequest, request_id: str) -> InferenceRequest:
    """vLLM's fields in the pipeline's meaning: ``temperature`` below 1e-5 is greedy (vLLM samples with 1.0
    when it is unset), ``top_k`` -1 or unset is off, ``max_tokens`` unset is maxIterTimes."""
    temperature = 1.0 if body.temperature is None else body.temperature
    greedy = temperature < GREEDY_TEMPERATURE
    return InferenceRequest(
        request_id=request_id,
        prompt_field="prompt",
        text=body.prompt,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_k=0 if body.top_k is None or body.top_k == -1 else body.top_k,
        top_p=body.top_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        max_new_tokens=body.max_tokens,
        default_max_new_tokens=None,
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=bool(body.ignore_eos),
    )


async def _vllm_generate(ctx: ServerContext, body: VLLMGenerateRequest, http: Request) -> Response:
    request = await resolve(ctx, TGI, vllm_inference_request(body, http.state.request_uuid))
    if not body.stream:
        result = await generate_for(ctx, TGI, request, http)
        return JSONResponse(VLLMGenerateResponse(text=[body.prompt + result.finish.generated_text]).model_dump())
    submission = await submit_for(ctx, TGI, request)
    return StreamingResponse(_nul_stream(submission), media_type=NUL_STREAM,
                             background=BackgroundTask(submission.close))  # in case the body never ran


async def _nul_stream(submission: Submission) -> AsyncIterator[bytes]:
    """Each token's text delta as ``{"text": [delta]}`` and a NUL byte; a failure as a last error object."""
    try:
        try:
            async for event in submission.events():
                yield orjson.dumps({"text": [event.token.text]}) + NUL
        except PipelineError as exc:
            yield orjson.dumps(_error_event(exc)) + NUL
    finally:
        await submission.close()


# ------------------------------------------------------------------------------- POST /infer, /infer_token


def infer_inference_request(body: MindIEInferRequest, request_id: str, stream: bool) -> InferenceRequest:
    """The ``/infer`` body as TGI's parameters read (sampling on when a warper is set, ...)."""
    params = body.parameters
    if stream and params.decoder_input_details:
        raise TGI.invalid("`decoder_input_details` == true is not supported when streaming tokens",
                          "decoder_input_details")
    if params.return_full_text and body.inputs is None:
        raise TGI.invalid("`return_full_text` needs a text prompt (`inputs`), not `input_id`", "return_full_text")
    prompt = {"prompt_field": "inputs", "text": body.inputs} if body.inputs is not None else {
        "prompt_field": "input_id", "token_ids": body.input_id}
    return InferenceRequest(request_id=request_id, **prompt, **params.request_fields(),
                            priority=DEFAULT_PRIORITY if params.priority is None else params.priority)


def _full_text(body: MindIEInferRequest, generated: str) -> str:
    return f"{body.inputs}{generated}" if body.parameters.return_full_text else generated


INFER_RESPONSES: OpenApiResponses = {
    **ERROR_RESPONSES,
    200: {"model": MindIEInferResponse, **SSE_CONTENT,
          "description": "the generation, or with stream=true an SSE stream of MindIEStreamResponse events"},
}


@router.post("/infer", responses=INFER_RESPONSES, summary="Generate (MindIE): text `inputs` or token ids `input_id`")
@router.post("/infer_token", responses=INFER_RESPONSES, summary="Generate (MindIE): same body as /infer")
async def infer(body: MindIEInferRequest, ctx: Ctx, http: Request) -> Response:
    timeout = body.parameters.timeout
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    request = await resolve(ctx, TGI, infer_inference_request(body, http.state.request_uuid, body.stream))
    if body.stream:
        return await _infer_stream(ctx, body, request, deadline)
    try:
        async with asyncio.timeout_at(deadline):
            result = await generate_for(ctx, TGI, request, http)
    except TimeoutError:
        assert timeout is not None
        raise TGI.failure(_timed_out(timeout)) from None
    finish = result.finish
    prefill = [MindIEPrefillToken(id=t.id, text=t.text, logprob=t.logprob) for t in finish.prefill]
    details = MindIEDetails(
        finish_reason=finish.finish_reason,
        generated_tokens=finish.generated_tokens,
        generated_token_ids=[t.id for t in result.tokens],
        seed=finish.seed,
        prefill=prefill if body.parameters.decoder_input_details else None,
    )
    response = MindIEInferResponse(generated_text=_full_text(body, finish.generated_text), details=details)
    return JSONResponse(response.model_dump(exclude=None if details.prefill is not None else {"details": {"prefill"}}))


async def _infer_stream(
    ctx: ServerContext, body: MindIEInferRequest, request: QueuedRequest, deadline: float | None
) -> Response:
    """Queue first (a refusal answers with a status), then one SSE event per token."""
    queued_at = time.monotonic()
    submission = await submit_for(ctx, TGI, request)

    async def render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
        last, first, iterator = queued_at, True, aiter(events)
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                submission.failure = "incomplete_generation"
                assert body.parameters.timeout is not None
                raise _timed_out(body.parameters.timeout) from None
            now = time.monotonic()
            millis, last = (now - last) * 1000, now
            payload = MindIEStreamResponse(
                prefill_time=millis if first else None,
                decode_time=None if first else millis,
                token=MindIEStreamToken(id=event.token.id, text=event.token.text),
            )
            first = False
            if (finish := event.finish) is not None:
                payload.generated_text = _full_text(body, finish.generated_text)
                payload.details = MindIEStreamDetails(finish_reason=finish.finish_reason,
                                                      generated_tokens=finish.generated_tokens, seed=finish.seed)
            yield payload.model_dump_json(exclude=None if event.finish is not None else {"generated_text", "details"})

    return event_stream(submission, render, lambda exc: orjson.dumps(_error_event(exc)).decode())


# ------------------------------------------------------------------------------- POST /v1/tokenizer


@router.post("/v1/tokenizer", response_model=TokenizeResponse, responses={422: ERROR_RESPONSES[422]},
             summary="Tokenize a text with the served model's tokenizer (MindIE)")
async def tokenizer(body: TokenizeRequest, ctx: Ctx) -> TokenizeResponse:
    ids = await tokenize(ctx, body.inputs)
    return TokenizeResponse(token_number=len(ids), tokens=ids)



# ------------------------------------------------------------------------------- status, health and metrics

UNAVAILABLE: OpenApiResponses = {503: {"model": TGIErrorResponse, "description": "Redis is unreachable"}}


async def _states(ctx: ServerContext) -> dict[str, ModelState]:
    """Every served model's workers and queue, by name; Redis unreachable is a 503."""
    states = await model_states(ctx)
    if states is None:
        raise ProtocolError(503, "cannot read the workers' status: Redis is unreachable", "unavailable")
    return {state.model: state for state in states}


def _kv_free(state: ModelState) -> int:
    return max(state.kv_budget_tokens - state.kv_reserved_tokens, 0)


@router.get(
    "/v2/models/{model}/getSlotCount",
    response_model=SlotCountResponse,
    responses={404: {"model": TGIErrorResponse, "description": "Unknown model"}, **UNAVAILABLE},
    summary="Batch slots and KV tokens of the model's live workers (MindIE)",
)
async def slot_count(model: str, ctx: Ctx) -> SlotCountResponse:
    """Summed over the live workers' last reports: ``total_slots`` their maxBatchSize (this pod's setting for
    a worker too old to report it), ``free_slots`` those not running a request, ``available_tokens_length``
    the KV tokens not held."""
    if model not in ctx.models:
        raise ProtocolError(404, f"Model {model} not found.", "NotFoundError")
    state = (await _states(ctx))[model]
    total = free = 0
    for worker in state.workers:
        if worker.status is not None:
            slots = worker.status.max_batch_size or ctx.settings.max_batch_size
            total += slots
            free += max(slots - worker.status.batch_size, 0)
    return SlotCountResponse(total_slots=total, free_slots=free, available_tokens_length=_kv_free(state))


def _load(state: ModelState) -> ModelLoad:
    return ModelLoad(live_workers=len(state.workers), waiting_requests=state.waiting,
                     running_requests=state.batch_size, free_kv_tokens=_kv_free(state),
                     total_kv_tokens=state.kv_budget_tokens)


@router.get("/v1/status", response_model=StatusResponse, responses=UNAVAILABLE,
            summary="Waiting and running requests and KV tokens of the served models (MindIE)")
@router.get("/v2/status", response_model=StatusResponse, responses=UNAVAILABLE,
            summary="Same as /v1/status (MindIE)")
async def status(ctx: Ctx) -> StatusResponse:
    """The default model's ``live_workers``, ``waiting_requests`` (queued, not running), ``running_requests``,
    ``free_kv_tokens`` and ``total_kv_tokens`` (summed over its live workers' last reports) at the top level,
    with ``model`` naming it; ``models`` maps every served model, the default included, to the same fields."""
    models = {name: _load(state) for name, state in (await _states(ctx)).items()}
    return StatusResponse(model=ctx.model.model_id, models=models, **models[ctx.model.model_id].model_dump())


HealthSeconds = Annotated[int, Path(ge=1, le=MAX_HEALTH_SECONDS, description="seconds the generation may take")]
TIMED_HEALTH_RESPONSES: OpenApiResponses = {
    200: {"model": TimedHealthResponse, "description": "a one-token generation answered in time"},
    500: {"model": TimedHealthResponse, "description": "it failed or did not answer in time"},
    422: ERROR_RESPONSES[422],
}


@router.get("/health/timed", response_model=TimedHealthResponse, responses=TIMED_HEALTH_RESPONSES,
            summary=f"A one-token generation within {DEFAULT_HEALTH_SECONDS} s (MindIE)")
async def timed_health(ctx: Ctx) -> Response:
    return await _timed_health(ctx, DEFAULT_HEALTH_SECONDS)


@router.get("/health/timed-{seconds}", response_model=TimedHealthResponse, responses=TIMED_HEALTH_RESPONSES,
            summary="A one-token generation within N seconds (MindIE)")
async def timed_health_within(seconds: HealthSeconds, ctx: Ctx) -> Response:
    return await _timed_health(ctx, seconds)


async def _timed_health(ctx: ServerContext, seconds: int) -> Response:
    """200 when the probe's token came within ``seconds``, else 500 with why."""
    result = await _probe_result(ctx, seconds)
    error = result.error
    if error is None and result.seconds > seconds:
        error = f"the probe's token took {result.seconds:.3g} s, more than {seconds} s"
    if error is None:
        return JSONResponse(TimedHealthResponse(status="healthy").model_dump(exclude_none=True))
    log.warning("timed health check failed: %s", error)
    return JSONResponse(TimedHealthResponse(status="unhealthy", error=error).model_dump(), status_code=500)


async def _probe_result(ctx: ServerContext, seconds: int) -> ProbeResult:
    """The last probe's result while it is fresh (timedHealthCacheSeconds), else the result of the probe running,
    started when none is, waited for ``seconds`` at most. The probe runs while a caller waits for it: when the
    last one gives up, it is cancelled (:meth:`api.pipeline.Submission.close`)."""
    probe = ctx.health_probe
    loop = asyncio.get_running_loop()
    if probe.last is not None and loop.time() - probe.last.at < ctx.settings.timed_health_cache_seconds:
        return probe.last
    if probe.running is None:
        probe.running = asyncio.create_task(_probe(ctx), name="timed-health-probe")
    running = probe.running
    probe.waiters += 1
    try:
        return await asyncio.wait_for(asyncio.shield(running), seconds)
    except TimeoutError:
        return ProbeResult(error=f"no token within {seconds} s", seconds=seconds, at=loop.time())
    finally:
        probe.waiters -= 1
        if not probe.waiters and not running.done():
            probe.running = None  # the next caller starts a new one
            running.cancel()
            await asyncio.wait([running])  # its request closed (and counted) before the answer


async def _probe(ctx: ServerContext) -> ProbeResult:
    """Generate one token of the default model through the pipeline (queue, a worker, the relay)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        error = await unready_reason(ctx)  # no live worker (or no Redis): unhealthy now, nothing queued
        if error is None:
            request = InferenceRequest(request_id=new_request_id(), prompt_field="inputs", text=HEALTH_PROMPT,
                                       max_new_tokens=1)
            try:
                await pipeline.generate(ctx, await resolve(ctx, TGI, request))
            except (PipelineError, ProtocolError) as exc:
                error = exc.message
        ctx.health_probe.last = ProbeResult(error=error, seconds=loop.time() - started, at=loop.time())
        return ctx.health_probe.last
    finally:
        if ctx.health_probe.running is asyncio.current_task():
            ctx.health_probe.running = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


@router.get("/metrics-json", response_model=MetricsJsonResponse, responses=UNAVAILABLE,
            summary="Mean TTFT and time between tokens, waiting and running requests, as JSON (MindIE)")
async def metrics_json(ctx: Ctx) -> MetricsJsonResponse:
    """For the default model at the top level (``model`` names it) and every served model under ``models``:
    ``avg_ttft_ms`` (queueing to the first token) and ``avg_tbt_ms`` (between two tokens of a request), the
    means of this pod's observations since it started (null before the first), and ``waiting_requests`` /
    ``processing_requests`` read from the workers' reports."""
    metrics = ctx.metrics
    models = {
        name: ModelMetrics(
            avg_ttft_ms=_ms(metrics.mean(metrics.time_to_first_token, name)),
            avg_tbt_ms=_ms(metrics.mean(metrics.inter_token_latency, name)),
            waiting_requests=state.waiting,
            processing_requests=state.batch_size,
        )
        for name, state in (await _states(ctx)).items()
    }
    return MetricsJsonResponse(model=ctx.model.model_id, models=models, **models[ctx.model.model_id].model_dump())
