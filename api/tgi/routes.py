"""TGI 0.9.4 compatible routes: ``POST /``, ``/generate``, ``/generate_stream``, ``/info``, ``/health``.

A thin translation: the TGI body as an :class:`api.request.InferenceRequest`, its tokens shaped as TGI
does; :mod:`api.resolve` and :mod:`api.pipeline` do the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from api import __version__
from api.context import ServerContext, get_ctx
from api.errors import PipelineError, error_route_class
from api.health import HealthResponse, health_response, model_states
from api.pipeline import GenerationResult, generate_for, submit_for, unready_reason
from api.request import InferenceRequest, QueuedRequest
from api.resolve import resolve
from api.rules import MAX_STOP_ITEMS
from api.sse import event_stream
from api.tgi.schemas import InfoModel, TGIInfo, TGIStreamDetails, TGIStreamResponse, TGIStreamToken
from api.tgi_format import (
    ERROR_RESPONSES,
    SSE_CONTENT,
    TGI,
    RequestIdHeader,
    TextItem,
    TGIDetails,
    TGIGenerateResponse,
    TGIPrefillToken,
    TGIRequest,
    TGIToken,
    client_request_id,
    prompt_parts,
    render_tgi_error,
)
from common.protocol import TokenEvent

StreamIdFormat = Literal["list", "int"]

router = APIRouter(route_class=error_route_class(render_tgi_error), tags=["TGI"])
Ctx = Annotated[ServerContext, Depends(get_ctx)]


async def to_generation_request(
    ctx: ServerContext, body: TGIRequest, request_id: str | None, stream: bool
) -> QueuedRequest:
    """The TGI body as a pipeline request (:func:`api.resolve.resolve`)."""
    params = body.parameters
    if stream and params.decoder_input_details:
        raise TGI.invalid("`decoder_input_details` == true is not supported when streaming tokens",
                          "decoder_input_details")
    prompt = {"text": body.inputs} if isinstance(body.inputs, str) else {"parts": prompt_parts(body.inputs)}
    request = InferenceRequest(request_id=request_id, prompt_field="inputs", **prompt, **params.request_fields())
    return await resolve(ctx, TGI, request)


def _full_text(body: TGIRequest, generated: str) -> str:
    """``return_full_text``: the prompt's text (a list's text items), then the generated text."""
    if not body.parameters.return_full_text:
        return generated
    prompt = body.inputs if isinstance(body.inputs, str) else "".join(
        item.text for item in body.inputs if isinstance(item, TextItem))
    return f"{prompt}{generated}"


def _generate_response(body: TGIRequest, result: GenerationResult) -> TGIGenerateResponse:
    details = None
    if body.parameters.wants_details:
        finish = result.finish
        details = TGIDetails(
            finish_reason=finish.finish_reason,
            generated_tokens=finish.generated_tokens,
            prompt_tokens=finish.prompt_tokens,
            seed=finish.seed,
            prefill=[TGIPrefillToken(id=t.id, text=t.text, logprob=t.logprob) for t in finish.prefill],
            tokens=[TGIToken(**t.model_dump()) for t in result.tokens],
        )
    return TGIGenerateResponse(generated_text=_full_text(body, result.finish.generated_text), details=details)


async def _respond(
    ctx: ServerContext, body: TGIRequest, request_id: str | None, http: Request, listed: bool
) -> Response:
    """The whole generation with TGI's headers: one response, or (``POST /``) a list of one."""
    request = await to_generation_request(ctx, body, request_id, stream=False)
    result = await generate_for(ctx, TGI, request, http)
    payload = _dump(_generate_response(body, result))
    return JSONResponse([payload] if listed else payload, headers=_headers(request.request_id, result))


def _headers(request_id: str, result: GenerationResult) -> dict[str, str]:
    """TGI's timing headers (milliseconds; total and compute time run from queueing) and token counts."""
    finish = result.finish
    millis = {
        "x-compute-time": result.duration,
        "x-total-time": result.duration,
        "x-queue-time": finish.queue_time,
        "x-inference-time": finish.inference_time,
        "x-time-per-token": finish.inference_time / max(finish.generated_tokens, 1),
    }
    return {
        **{name: str(int(seconds * 1000)) for name, seconds in millis.items()},
        "x-prompt-tokens": str(finish.prompt_tokens),
        "x-generated-tokens": str(finish.generated_tokens),
        "x-request-id": request_id,
    }


def _dump(model: TGIGenerateResponse) -> dict:
    return model.model_dump(exclude={"details"} if model.details is None else set())


def _error_event(exc: PipelineError) -> str:
    return orjson.dumps({"error": exc.message, "error_type": exc.error_type}).decode()


def _stream_event(
    ctx: ServerContext, body: TGIRequest, event: TokenEvent, text_so_far: str, id_format: StreamIdFormat
) -> TGIStreamResponse:
    token = event.token
    text = text_so_far if ctx.settings.full_text_enabled else token.text
    response = TGIStreamResponse(
        token=TGIStreamToken(
            id=[token.id] if id_format == "list" else token.id,
            text=text,
            logprob=token.logprob,
            special=token.special,
        )
    )
    if event.finish is not None:
        response.generated_text = _full_text(body, event.finish.generated_text)
        if body.parameters.wants_details:
            response.details = TGIStreamDetails(
                finish_reason=event.finish.finish_reason,
                generated_tokens=event.finish.generated_tokens,
                prompt_tokens=event.finish.prompt_tokens,
                seed=event.finish.seed,
            )
    return response


async def _stream(
    ctx: ServerContext, body: TGIRequest, request_id: str | None, id_format: StreamIdFormat
) -> EventSourceResponse:
    """Validate and queue first (errors answer with a status), then stream TGI events."""
    request = await to_generation_request(ctx, body, request_id, stream=True)
    submission = await submit_for(ctx, TGI, request)

    async def render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
        text_so_far = ""
        async for event in events:
            text_so_far += event.token.text
            yield _stream_event(ctx, body, event, text_so_far, id_format).model_dump_json()

    return event_stream(submission, render, _error_event, headers={"x-request-id": request.request_id})


@router.post(
    "/",
    responses={**ERROR_RESPONSES, 200: {"model": list[TGIGenerateResponse], **SSE_CONTENT, "description": "list of one "
                                        "generation, or an SSE stream of TGIStreamResponse when stream=true"}},
    summary="Generate text (TGI compatible; list response, or SSE when stream is true)",
)
async def compat_generate(
    body: TGIRequest, ctx: Ctx, http: Request, x_request_id: RequestIdHeader = None
) -> Response:
    request_id = client_request_id(x_request_id)
    if body.stream:
        return await _stream(ctx, body, request_id, ctx.settings.tgi_stream_format)
    return await _respond(ctx, body, request_id, http, listed=True)


# POST /generate: MindIE's route answers it (it also takes vLLM's dialect) and hands TGI's bodies here; the app
# wires this handler into it (api.mindie.routes.generate_router), so neither protocol imports the other.
async def generate_route(
    body: TGIRequest, ctx: Ctx, http: Request, x_request_id: RequestIdHeader = None
) -> Response:
    return await _respond(ctx, body, client_request_id(x_request_id), http, listed=False)


@router.post(
    "/generate_stream",
    response_class=EventSourceResponse,
    responses={**ERROR_RESPONSES, 200: {**SSE_CONTENT, "description": "TGIStreamResponse events"}},
)
async def generate_stream_route(body: TGIRequest, ctx: Ctx, x_request_id: RequestIdHeader = None) -> Response:
    return await _stream(ctx, body, client_request_id(x_request_id), "int")


def _info_model(ctx: ServerContext) -> InfoModel:
    return InfoModel(
        model_id=ctx.model.model_id,
        model_sha=None,
        model_dtype=ctx.model.dtype,
        model_device_type=ctx.settings.device.split(":", 1)[0],
        model_pipeline_tag="text-generation",
        max_total_tokens=ctx.max_total_tokens,
    )


@router.get("/info", response_model=TGIInfo)
async def info(ctx: Ctx) -> TGIInfo:
    """TGI's fields for the default model, and MindIE's ``models``: every served model, the default first."""
    settings = ctx.settings
    default = _info_model(ctx)
    others = [_info_model(served) for name in ctx.models if name != ctx.model.model_id
              if (served := ctx.for_model(name)) is not None]
    return TGIInfo(
        **default.model_dump(exclude={"max_total_tokens"}),
        max_concurrent_requests=settings.max_link_num,
        max_best_of=1,
        max_stop_sequences=MAX_STOP_ITEMS,
        max_input_length=ctx.max_input_tokens,
        max_total_tokens=ctx.max_total_tokens,
        waiting_served_ratio=1.2,
        max_batch_total_tokens=settings.max_batch_total_tokens,
        max_waiting_tokens=20,
        validation_workers=1,
        version=__version__,
        sha=None,
        docker_label=None,
        models=[default, *others],
    )


@router.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse}})
async def health(ctx: Ctx) -> Response:
    """200 when Redis answers and at least one worker of the default model is alive, else 503 with TGI's
    error fields; both list the live workers (per pool) and queue depth of every served model."""
    reason = await unready_reason(ctx)
    body = health_response(reason, await model_states(ctx))
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if reason is None else 503)
