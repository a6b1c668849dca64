"""KServe v2 / Triton routes under ``/v2``: token inference (SPEC.md section 2), health, metadata, and
Triton's generate extension (``/generate``, ``/generate_stream``), model configuration (with MindIE's fields),
repository index and statistics extensions (``/config``, ``/v2/repository/index``, ``/stats``).

A thin translation onto :mod:`api.resolve` and :mod:`api.pipeline`, like :mod:`api.tgi.routes`. Every error is KServe's
``{"error": "..."}``: 400 for a bad request, 404 for an unknown model, 503 when not ready, 500 when
generation fails. The infer route reads its body itself because Triton clients send tensors with the
binary tensor data extension by default: a JSON header of ``Inference-Header-Content-Length`` bytes,
then the raw little-endian tensor bytes. Responses use it when the request asks (Triton's rule).

Output ``data`` holds the prompt ids followed by the generated ids (the seed's example), or only the
generated ids with ``KSERVE_OUTPUT_INCLUDES_PROMPT=false``; a request without ``outputs`` gets it too (KServe
v2: all the model's outputs). The prompt is echoed exactly as sent: the server adds no BOS the client did not
send. Statistics are this API pod's, counted where every request ends (:meth:`api.pipeline.Submission.close`
records them in the pod's metrics, which ``/stats`` reads). The model has no versions: ``versions`` is empty,
``model_version`` is ``""`` and ``/v2/models/{model}/versions/{v}/...`` answers 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.metrics import MetricWrapperBase
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from api import __version__
from api.context import ServerContext, get_ctx
from api.errors import REST_STATUSES, OpenApiResponses, Protocol, ProtocolError, error_route_class, validation_error
from api.kserve.schemas import (
    DATATYPE,
    INPUT_NAME,
    OUTPUT_NAME,
    InferenceStatistics,
    KServeErrorResponse,
    KServeGenerateRequest,
    KServeGenerateResponse,
    KServeInferRequest,
    KServeInferResponse,
    KServeInput,
    KServeModelConfig,
    KServeModelConfigTensor,
    KServeModelMetadata,
    KServeOutput,
    KServeServerMetadata,
    KServeStatisticsResponse,
    KServeTensorMetadata,
    ModelStatistics,
    RepositoryIndexRequest,
    RepositoryModel,
    SamplingParameters,
    StatisticDuration,
    StopInferRequest,
)
from api.metrics import series
from api.pipeline import GenerationResult, generate_for, send_control, submit_for, unready_reason
from api.request import InferenceRequest, QueuedRequest
from api.resolve import resolve, resolve_ids
from api.sse import event_stream
from common import keys
from common.connection import REDIS_ERRORS, as_text
from common.protocol import Control, TokenEvent

HEADER_LENGTH = "Inference-Header-Content-Length"
UINT32_LE = np.dtype("<u4")
SERVER_NAME = "ferry"
# Triton's extensions built in full (of model_repository, only the index: no load or unload)
EXTENSIONS = ("binary_tensor_data", "parameters", "generate", "model_configuration", "statistics")
PLATFORM = "pytorch_transformers"
MODEL_VERSION = ""  # the model has no versions
TENSOR_SHAPE = (1, -1)  # input0 and output0: one sequence of any length
CONFIG_DATATYPE = f"TYPE_{DATATYPE}"  # Triton's model configuration names datatypes so
# KServe's statuses for each pipeline failure; SPEC.md section 2's limits are errors, not clamps.
KSERVE = Protocol(statuses=REST_STATUSES, strict_limits=True, model_default_top_k=False)


def render_kserve_error(exc: ProtocolError) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status)


router = APIRouter(
    prefix="/v2", route_class=error_route_class(render_kserve_error, 400, require_json=False), tags=["KServe v2"]
)

ERROR_RESPONSES: OpenApiResponses = {
    400: {"model": KServeErrorResponse, "description": "Bad request"},
    404: {"model": KServeErrorResponse, "description": "Unknown model"},
    500: {"model": KServeErrorResponse, "description": "Generation failed or timed out"},
    503: {"model": KServeErrorResponse, "description": "Overloaded (queue full) or Redis unreachable"},
}
READY: OpenApiResponses = {200: {"description": "Ready (empty body)"}}
NOT_READY: OpenApiResponses = {503: {"model": KServeErrorResponse, "description": "No live worker serves the model"}}


def _invalid(message: str) -> ProtocolError:
    return KSERVE.invalid(message)


Ctx = Annotated[ServerContext, Depends(get_ctx)]


async def known_model(model: str, ctx: Ctx) -> str:
    """Route dependency: 404 for any model but the served one (checked before the body is validated)."""
    if model != ctx.model.model_id:
        raise ProtocolError(404, f"Model {model} not found.", "NotFoundError")
    return model


KnownModel = (Depends(known_model),)


def parse_infer_body(raw: bytes, header_length: str | None) -> tuple[KServeInferRequest, bytes]:
    """Split the body into its JSON header and binary tensor data, and validate the JSON."""
    binary = b""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise _invalid(f"the `{HEADER_LENGTH}` header must be an integer. Given: '{header_length}'") from None
        if not 0 < length <= len(raw):
            raise _invalid(f"the `{HEADER_LENGTH}` header must be > 0 and <= the body size {len(raw)}. Given: {length}")
        raw, binary = raw[:length], raw[length:]
    try:
        return KServeInferRequest.model_validate_json(raw), binary
    except ValidationError as exc:
        raise validation_error(exc, 400) from None


def _token_ids(tensor: KServeInput, binary: bytes) -> list[int]:
    """``input0``'s ids, from ``data`` or from the binary data after the JSON header."""
    size = tensor.parameters.binary_data_size
    if size is None:
        if binary:
            raise _invalid(f"the body has {len(binary)} bytes after the JSON header but no input declares "
                           "`parameters.binary_data_size`")
        assert tensor.data is not None  # the schema requires data or binary_data_size
        return tensor.data
    if size != len(binary):
        raise _invalid(
            f"`inputs[0].parameters.binary_data_size` is {size} but {len(binary)} bytes follow the JSON header"
        )
    if size != tensor.n * UINT32_LE.itemsize:
        raise _invalid(f"`inputs[0]` of shape {tensor.shape} and datatype {DATATYPE} takes "
                       f"{tensor.n * UINT32_LE.itemsize} bytes of binary data. Given: {size}")
    return np.frombuffer(binary, dtype=UINT32_LE).tolist()


def _inference_request(
    params: SamplingParameters, prompt_field: str, request_id: str | None = None, stop: list[str] | None = None,
    **prompt: Any,
) -> InferenceRequest:
    """The KServe parameters as the protocol-neutral request (``prompt``: its ``token_ids`` or ``text``)."""
    return InferenceRequest(request_id=request_id, prompt_field=prompt_field, stop=stop or [], **prompt,
                            **params.request_fields())


def to_generation_request(ctx: ServerContext, body: KServeInferRequest, binary: bytes = b"") -> QueuedRequest:
    """The infer request as a pipeline request (:func:`api.resolve.resolve_ids`)."""
    request = _inference_request(body.sampling, "inputs[0].data", body.id, token_ids=_token_ids(body.input, binary))
    return resolve_ids(ctx, KSERVE, request)


async def text_to_generation_request(ctx: ServerContext, body: KServeGenerateRequest) -> QueuedRequest:
    """The generate extension's request as a pipeline request (:func:`api.resolve.resolve`)."""
    params = body.sampling
    assert not isinstance(params.stop, str)  # its validator made it a list
    request = _inference_request(params, "text_input", stop=params.stop, text=body.text_input)
    return await resolve(ctx, KSERVE, request)


def infer_response(
    ctx: ServerContext, body: KServeInferRequest, request: QueuedRequest, result: GenerationResult
) -> Response:
    """``output0`` as JSON ``data``, or as binary data after the JSON when the request asked for it."""
    ids = [token.id for token in result.tokens]
    if ctx.settings.kserve_output_includes_prompt:
        ids = request.input_ids + ids
    output = KServeOutput(shape=[1, len(ids)])
    if body.binary_output:
        output.parameters = {"binary_data_size": len(ids) * UINT32_LE.itemsize}
    else:
        output.data = ids
    response = KServeInferResponse(id=request.request_id, model_name=ctx.model.model_id, outputs=[output])
    header = response.model_dump_json(exclude_none=True).encode()
    if not body.binary_output:
        return Response(header, media_type="application/json")
    return Response(
        header + np.asarray(ids, dtype=UINT32_LE).tobytes(),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


@router.post(
    "/models/{model}/infer",
    dependencies=KnownModel,
    responses={**ERROR_RESPONSES, 200: {"model": KServeInferResponse}},
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"description": "KServeInferRequest (see SPEC.md section 2)"}},
        "application/octet-stream": {"schema": {"description": f"JSON header of {HEADER_LENGTH} bytes, "
                                                               "then the binary tensor data"}},
    }}},
)
async def infer(request: Request, ctx: Ctx) -> Response:
    """Token ids in, token ids out (SPEC.md section 2)."""
    body, binary = parse_infer_body(await request.body(), request.headers.get(HEADER_LENGTH))
    generation = to_generation_request(ctx, body, binary)
    return infer_response(ctx, body, generation, await generate_for(ctx, KSERVE, generation, request))


@router.post(
    "/models/{model}/generate",
    dependencies=KnownModel,
    responses={**ERROR_RESPONSES, 200: {"model": KServeGenerateResponse}},
)
async def generate_route(body: KServeGenerateRequest, ctx: Ctx, http: Request) -> KServeGenerateResponse:
    """Triton's generate extension: text in, generated text out."""
    result = await generate_for(ctx, KSERVE, await text_to_generation_request(ctx, body), http)
    return KServeGenerateResponse(
        model_name=ctx.model.model_id, model_version=MODEL_VERSION, text_output=result.finish.generated_text
    )


@router.post(
    "/models/{model}/generate_stream",
    dependencies=KnownModel,
    response_class=EventSourceResponse,
    responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}},
                                        "description": "KServeGenerateResponse events, text_output the delta"}},
)
async def generate_stream_route(body: KServeGenerateRequest, ctx: Ctx) -> Response:
    """The generate extension as SSE; the body is validated before the stream starts (400 otherwise)."""
    submission = await submit_for(ctx, KSERVE, await text_to_generation_request(ctx, body))

    async def render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
        """One event per token with its text delta."""
        async for event in events:
            yield KServeGenerateResponse(
                model_name=ctx.model.model_id, model_version=MODEL_VERSION, text_output=event.token.text
            ).model_dump_json()

    return event_stream(submission, render, lambda exc: orjson.dumps({"error": exc.message}).decode())


@router.api_route(
    "/models/{model}/versions/{version}",
    methods=["GET", "POST"],
    responses={400: {"model": KServeErrorResponse}},
    include_in_schema=False,
)
@router.api_route(
    "/models/{model}/versions/{version}/{rest:path}",
    methods=["GET", "POST"],
    responses={400: {"model": KServeErrorResponse}},
    include_in_schema=False,
)
async def versioned(model: str, version: str) -> Response:
    """SPEC.md: model versions are not supported; say so instead of a bare 404."""
    raise ProtocolError(
        400, f"model versions are not supported: use /v2/models/{model}/... without /versions/{version}", "validation"
    )


@router.get("/health/live", response_class=Response, responses={200: {"description": "Live (empty body)"}})
async def live() -> Response:
    """200 while the process serves HTTP."""
    return Response(status_code=200)


async def _require_ready(ctx: ServerContext) -> Response:
    reason = await unready_reason(ctx)
    if reason is not None:
        raise ProtocolError(503, reason, "unhealthy")
    return Response(status_code=200)


@router.get("/health/ready", response_class=Response, responses={**READY, **NOT_READY})
async def ready(ctx: Ctx) -> Response:
    """200 only while a worker of the model is alive (heartbeats in Redis), else 503."""
    return await _require_ready(ctx)


@router.get(
    "/models/{model}/ready",
    dependencies=KnownModel,
    response_class=Response,
    responses={**READY, **NOT_READY, 404: ERROR_RESPONSES[404]},
)
async def model_ready(ctx: Ctx) -> Response:
    """The served model is ready exactly when the server is: it is the only one."""
    return await _require_ready(ctx)


def _duration(metric: MetricWrapperBase, model: str) -> StatisticDuration:
    samples = series(metric, model)
    return StatisticDuration(count=int(samples.get("_count", 0)), ns=round(samples.get("_sum", 0.0) * 1e9))


def _statistics(ctx: ServerContext, model: str) -> ModelStatistics:
    """Triton's statistics of one model, from the pod's request metrics (see :class:`InferenceStatistics`)."""
    metrics = ctx.metrics
    success = _duration(metrics.duration, model)
    return ModelStatistics(
        name=model,
        version=MODEL_VERSION,
        last_inference=round(series(metrics.last_request_end, model).get("", 0.0) * 1000),
        inference_count=success.count,
        execution_count=success.count,
        inference_stats=InferenceStatistics(
            success=success,
            fail=_duration(metrics.failure_duration, model),
            queue=_duration(metrics.queue_duration, model),
            compute_infer=_duration(metrics.inference_duration, model),
        ),
    )


@router.get("/models/stats", response_model=KServeStatisticsResponse)
async def all_statistics(ctx: Ctx) -> KServeStatisticsResponse:
    """Triton's statistics extension for every served model: this pod's counts and times since it started."""
    return KServeStatisticsResponse(model_stats=[_statistics(ctx, model) for model in ctx.models])


@router.get(
    "/models/{model}/stats",
    dependencies=KnownModel,
    response_model=KServeStatisticsResponse,
    responses={404: ERROR_RESPONSES[404]},
)
async def model_statistics(ctx: Ctx) -> KServeStatisticsResponse:
    """Triton's statistics extension for one model: this pod's counts and times since it started."""
    return KServeStatisticsResponse(model_stats=[_statistics(ctx, ctx.model.model_id)])


@router.get(
    "/models/{model}/config",
    dependencies=KnownModel,
    response_model=KServeModelConfig,
    responses={404: ERROR_RESPONSES[404]},
)
async def model_config(ctx: Ctx) -> KServeModelConfig:
    """Triton's model configuration extension (the tensors as the metadata gives them, no Triton batching) and
    MindIE's model configuration, in one object."""
    return KServeModelConfig(
        name=ctx.model.model_id,
        platform=PLATFORM,
        max_batch_size=0,
        input=[KServeModelConfigTensor(name=INPUT_NAME, data_type=CONFIG_DATATYPE, dims=list(TENSOR_SHAPE))],
        output=[KServeModelConfigTensor(name=OUTPUT_NAME, data_type=CONFIG_DATATYPE, dims=list(TENSOR_SHAPE))],
        model_name=ctx.model.model_id,
        input_datatype=DATATYPE,
        output_datatype=DATATYPE,
        max_seq_len=ctx.settings.max_seq_len,
        npu_mem_size=-1,
        cpu_mem_size=0,
        world_size=ctx.settings.devices_per_worker,
        model_weight_path=str(ctx.model.path),
        model_instance_type="Standard",
    )


@router.post("/repository/index", response_model=list[RepositoryModel], responses={400: ERROR_RESPONSES[400]})
async def repository_index(ctx: Ctx, body: RepositoryIndexRequest | None = None) -> list[RepositoryModel]:
    """Triton's model repository extension: every served model, READY while a worker of it is alive, else
    UNAVAILABLE with the reason; ``{"ready": true}`` lists the ready ones only."""
    index = []
    for name in ctx.models:
        served = ctx.for_model(name)
        assert served is not None  # a name of ctx.models
        reason = await unready_reason(served)
        index.append(RepositoryModel(name=name, version=MODEL_VERSION, state="UNAVAILABLE" if reason else "READY",
                                     reason=reason or ""))
    return [entry for entry in index if entry.state == "READY"] if body and body.ready else index


@router.get("", response_model=KServeServerMetadata)
async def server_metadata() -> KServeServerMetadata:
    return KServeServerMetadata(name=SERVER_NAME, version=__version__, extensions=list(EXTENSIONS))


@router.get(
    "/models/{model}",
    dependencies=KnownModel,
    response_model=KServeModelMetadata,
    responses={404: ERROR_RESPONSES[404]},
)
async def model_metadata(ctx: Ctx) -> KServeModelMetadata:
    return KServeModelMetadata(
        name=ctx.model.model_id,
        versions=[],
        platform=PLATFORM,
        inputs=[KServeTensorMetadata(name=INPUT_NAME, datatype=DATATYPE, shape=list(TENSOR_SHAPE))],
        outputs=[KServeTensorMetadata(name=OUTPUT_NAME, datatype=DATATYPE, shape=list(TENSOR_SHAPE))],
    )


# stopInfer answers a malformed id with 422 (SPEC.md), unlike the 400 of the KServe routes above.
control_router = APIRouter(prefix="/v2", route_class=error_route_class(render_kserve_error, 422), tags=["KServe v2"])


@control_router.post(
    "/models/{model}/stopInfer",
    dependencies=KnownModel,
    responses={404: {"model": KServeErrorResponse, "description": "Unknown model or request id"},
               422: {"model": KServeErrorResponse, "description": "Malformed request id"}},
)
async def stop_infer(body: StopInferRequest, ctx: Ctx) -> StopInferRequest:
    """Stop a request in flight: it ends at its next token with finish_reason ``stop_sequence``, and its
    client gets the text so far. Any request id works, whichever route and API pod took the request."""
    try:
        job_id = await ctx.redis.get(keys.inflight_key(ctx.model.model_id, body.id))  # see api.pipeline.submit
        if job_id is None:
            raise ProtocolError(404, f"request {body.id} is not in flight", "NotFoundError")
        await send_control(ctx, Control(request_id=as_text(job_id), action="stop"))
    except REDIS_ERRORS as exc:
        raise ProtocolError(503, f"the job queue is unreachable: {exc}", "unavailable") from None
    return body
