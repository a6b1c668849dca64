"""OpenAI-compatible routes under ``/v1``: completions, chat completions (both also as SSE streams) and models.

A thin translation onto :mod:`api.resolve` and :mod:`api.pipeline`, like :mod:`api.tgi.routes`. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}``: 400 ``invalid_request_error`` for a bad request
(OpenAI answers validation errors with 400, not 422), 404 ``model_not_found`` for a ``model`` the pod does
not serve, 5xx ``server_error`` when generation fails. A failure after a stream started is a last
``data: {"error": {...}}`` event; a stream that ends normally ends with ``data: [DONE]``.

Models: a request is for the model its ``model`` names. When the pod serves one model, any name is that
model, as TGI does (``huggingface_hub`` sends ``"dummy"``, TGI's documents ``"tgi"``); with several, a name
it does not serve is 404. The chat template is the model's own, or ``--chat-template`` for the default model
(applied to its tokenizer at start-up, :mod:`api.app`).

Sampling: ``temperature`` 0 (below 1e-5, as vLLM) is greedy, anything else samples (OpenAI's default is 1);
``top_k`` (vLLM's extra; -1 and 0 are off) defaults to the model's default, as on the TGI routes.
``max_tokens`` is capped at maxIterTimes (SPEC.md), defaults to 16 on completions (OpenAI's default) and to
maxIterTimes on chat. A negative ``seed`` is used modulo 2^64.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from api import adapters
from api.context import ModelInfo, ServerContext, get_ctx
from api.errors import REST_STATUSES, OpenApiResponses, PipelineError, Protocol, ProtocolError, error_route_class
from api.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorResponse,
    OpenAIFinishReason,
    SamplingRequest,
    UnloadLoraAdapterRequest,
    Usage,
)
from api.pipeline import generate_for, submit_for
from api.request import InferenceRequest, QueuedRequest, new_request_id
from api.resolve import resolve
from api.rules import GREEDY_TEMPERATURE
from api.sse import event_stream
from common.protocol import Finish, TokenEvent

OWNED_BY = "ferry"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "[DONE]"
FINISH_REASONS: dict[str, OpenAIFinishReason] = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
# OpenAI's statuses for each pipeline failure (503 is OpenAI's "overloaded, retry later").
OPENAI = Protocol(statuses=REST_STATUSES, too_long_code="context_length_exceeded")


def openai_error(exc: ProtocolError) -> OpenAIErrorResponse:
    """OpenAI's error body; ``code`` is null for plain validation errors, else the machine-readable type."""
    return OpenAIErrorResponse(error=OpenAIError(
        message=exc.message,
        type="invalid_request_error" if exc.status < 500 else "server_error",
        param=exc.param,
        code=None if exc.error_type == "validation" else exc.error_type,
    ))


def render_openai_error(exc: ProtocolError) -> Response:
    return JSONResponse(openai_error(exc).model_dump(), status_code=exc.status)


router = APIRouter(prefix="/v1", route_class=error_route_class(render_openai_error, 400), tags=["OpenAI"])

ERROR_RESPONSES: OpenApiResponses = {
    400: {"model": OpenAIErrorResponse, "description": "Invalid request"},
    404: {"model": OpenAIErrorResponse, "description": "Unknown model"},
    500: {"model": OpenAIErrorResponse, "description": "Generation failed or timed out"},
    503: {"model": OpenAIErrorResponse, "description": "Overloaded (queue full) or Redis unreachable"},
}
STREAM_RESPONSE: dict[str, Any] = {"content": {"text/event-stream": {}},
                                   "description": "when stream is true: chunks, then `data: [DONE]`"}

Ctx = Annotated[ServerContext, Depends(get_ctx)]


def _unknown_model(ctx: ServerContext, model: str, param: str = "model") -> ProtocolError:
    served = ", ".join(f"`{name}`" for name in ctx.models)
    return ProtocolError(404, f"The model `{model}` does not exist: this server serves {served}.", "model_not_found",
                         param)


async def model_context(ctx: ServerContext, model: str) -> tuple[ServerContext, str | None]:
    """The context of the model a request names, and the LoRA adapter when the name is one (vLLM selects
    adapters by ``model``). With one model served, any other name is that model (TGI ignores the name:
    ``huggingface_hub`` sends ``"dummy"``), except an adapter's that was unloaded: the client asked for the
    adapter, not the model without it; with several, a name that is neither is 404."""
    named = ctx.for_model(model)
    if named is not None:
        return named, None
    adapted = await adapters.model_of(ctx, model)
    if adapted is not None:
        return adapted, model
    if len(ctx.models) == 1 and not await adapters.was_unloaded(ctx, model):
        return ctx, None
    raise _unknown_model(ctx, model)


def _inference_request(body: SamplingRequest, request_id: str, max_tokens: int | None, default_max_tokens: int | None,
                       **prompt: Any) -> InferenceRequest:
    """The OpenAI sampling fields in the pipeline's meaning: ``temperature`` below 1e-5 is greedy (vLLM's
    rule), ``top_k`` -1 and 0 are off, a negative ``seed`` wraps to uint64. ``prompt``: the request's
    ``text``, ``token_ids`` or ``messages``."""
    temperature = 1.0 if body.temperature is None else body.temperature
    greedy = temperature < GREEDY_TEMPERATURE
    return InferenceRequest(
        request_id=request_id,
        **prompt,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_k=None if body.top_k is None else max(body.top_k, 0),
        top_p=body.top_p,
        repetition_penalty=body.repetition_penalty,
        seed=None if body.seed is None else body.seed % 2**64,
        max_new_tokens=max_tokens,
        default_max_new_tokens=default_max_tokens,
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=bool(body.ignore_eos),
        user=body.user,
        constraint=body.constraint,
    )


async def to_completion_request(ctx: ServerContext, body: CompletionRequest, request_id: str,
                                adapter: str | None = None) -> QueuedRequest:
    """``/v1/completions`` as a pipeline request for the model of ``ctx`` and its ``adapter``
    (:func:`model_context`)."""
    prompt = {"text": body.prompt} if isinstance(body.prompt, str) else {"token_ids": body.prompt}
    request = _inference_request(body, request_id, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                 prompt_field="prompt", adapter=adapter, **prompt)
    return await resolve(ctx, OPENAI, request)


async def to_chat_request(ctx: ServerContext, body: ChatCompletionRequest, request_id: str,
                          adapter: str | None = None) -> QueuedRequest:
    """``/v1/chat/completions`` as a pipeline request for the model of ``ctx`` and its ``adapter``
    (:func:`model_context`): the messages go through the model's chat template; ``max_tokens`` defaults to
    maxIterTimes."""
    request = _inference_request(body, request_id, body.token_limit, None, prompt_field="messages", adapter=adapter,
                                 messages=[m.for_template(f"messages[{i}]") for i, m in enumerate(body.messages)])
    return await resolve(ctx, OPENAI, request)


def _tally(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _usage(finish: Finish) -> Usage:
    return _tally(finish.prompt_tokens, finish.generated_tokens)


@dataclass(frozen=True)
class CompletionShape:
    """How one ``/v1/completions`` request's answer looks: the whole response, or its stream's chunks."""

    id: str
    created: int
    model: str

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def response(self, finish: Finish) -> Completion:
        choice = CompletionChoice(text=finish.generated_text, finish_reason=FINISH_REASONS[finish.finish_reason])
        return self._completion([choice], _usage(finish))

    def opening(self) -> list[Completion]:
        return []

    def delta(self, text: str) -> Completion:
        return self._completion([CompletionChoice(text=text)])

    def closing(self, reason: OpenAIFinishReason) -> Completion:
        return self._completion([CompletionChoice(text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> Completion:
        return self._completion([], usage)


@dataclass(frozen=True)
class ChatShape:
    """How one ``/v1/chat/completions`` request's answer looks: the whole response, or its stream's chunks."""

    id: str
    created: int
    model: str

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def response(self, finish: Finish) -> ChatCompletion:
        choice = ChatChoice(message=ChatMessageOut(content=finish.generated_text),
                            finish_reason=FINISH_REASONS[finish.finish_reason])
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=_usage(finish))

    def opening(self) -> list[ChatCompletionChunk]:
        """The role first, with empty content, as OpenAI and vLLM stream it."""
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def delta(self, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text))])

    def closing(self, reason: OpenAIFinishReason) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)])

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)


Shape = CompletionShape | ChatShape


def _chunk_json(chunk: BaseModel, include_usage: bool) -> str:
    """Compact JSON; with include_usage every chunk carries ``usage`` (null but on the last), as OpenAI's."""
    return chunk.model_dump_json(exclude=None if include_usage else {"usage"})


async def _stream(ctx: ServerContext, request: QueuedRequest, shape: Shape, include_usage: bool,
                  continuous_usage: bool) -> Response:
    """Queue the request (failures answer with a status), then stream: the opening chunks, one chunk per
    non-empty text delta, the closing chunk with the finish reason, the usage chunk when asked for, ``[DONE]``.
    The opening goes out with the first token, as vLLM sends it: benchmarks (vLLM's ``bench serve``) time the
    first token by the first chunk with choices, so a role chunk sent on queueing would report no prefill time.
    With ``continuous_usage`` (vLLM's ``continuous_usage_stats``) every chunk carries the usage so far, which
    benchmarks read per token: the prompt as queued (a multimodal prompt's media expand in the worker, so its
    count is exact from the last token's chunk on) and the tokens generated up to the chunk."""
    submission = await submit_for(ctx, OPENAI, request)

    async def render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
        so_far = _tally(len(request.input_ids), 0)

        def chunk_json(chunk: Completion | ChatCompletionChunk) -> str:
            if continuous_usage:
                chunk.usage = so_far
            return _chunk_json(chunk, include_usage)

        opening = shape.opening()
        async for event in events:
            for chunk in opening:
                yield chunk_json(chunk)
            opening = []
            so_far = _usage(event.finish) if event.finish else _tally(so_far.prompt_tokens, event.index + 1)
            if event.token.text:
                yield chunk_json(shape.delta(event.token.text))
            if event.finish is not None:
                yield chunk_json(shape.closing(FINISH_REASONS[event.finish.finish_reason]))
                if include_usage:
                    yield _chunk_json(shape.usage(so_far), include_usage)
        yield DONE

    def render_error(exc: PipelineError) -> str:
        return openai_error(OPENAI.failure(exc)).model_dump_json()

    return event_stream(submission, render, render_error)


async def _respond(
    ctx: ServerContext, body: SamplingRequest, request: QueuedRequest, shape: Shape, http: Request
) -> Response:
    """The stream when asked for, else the whole response once generation finishes."""
    if body.stream:
        return await _stream(ctx, request, shape, body.include_usage, body.continuous_usage)
    result = await generate_for(ctx, OPENAI, request, http)
    return JSONResponse(shape.response(result.finish).model_dump())


@router.post("/completions", responses={**ERROR_RESPONSES, 200: {"model": Completion, **STREAM_RESPONSE}})
async def completions(body: CompletionRequest, ctx: Ctx, http: Request) -> Response:
    """Text completion of one prompt (a string or token ids)."""
    ctx, adapter = await model_context(ctx, body.model)
    shape = CompletionShape(id=f"cmpl-{new_request_id()}", created=int(time.time()),
                            model=adapter or ctx.model.model_id)
    return await _respond(ctx, body, await to_completion_request(ctx, body, shape.id, adapter), shape, http)


@router.post("/chat/completions", responses={**ERROR_RESPONSES, 200: {"model": ChatCompletion, **STREAM_RESPONSE}})
async def chat_completions(body: ChatCompletionRequest, ctx: Ctx, http: Request) -> Response:
    """The assistant's reply to the messages, rendered with the model's chat template."""
    ctx, adapter = await model_context(ctx, body.model)
    shape = ChatShape(id=f"chatcmpl-{new_request_id()}", created=int(time.time()), model=adapter or ctx.model.model_id)
    return await _respond(ctx, body, await to_chat_request(ctx, body, shape.id, adapter), shape, http)


def _model_card(model: ModelInfo) -> ModelCard:
    """A served model; ``created`` is when its weights' config was written."""
    created = int((model.path / "config.json").stat().st_mtime)
    return ModelCard(id=model.model_id, created=created, owned_by=OWNED_BY, root=str(model.path))


async def _cards(ctx: ServerContext) -> list[ModelCard]:
    """Every served model, each followed by its LoRA adapters (``parent``: the model, ``root``: the adapter's
    folder, as vLLM lists them)."""
    cards = []
    for name, model in ctx.models.items():
        base = _model_card(model)
        adapted = await adapters.registered(ctx.for_model(name) or ctx)
        cards += [base, *(ModelCard(id=adapter, created=base.created, owned_by=OWNED_BY, root=path, parent=name)
                          for adapter, path in sorted(adapted.items()))]
    return cards


@router.get("/models", response_model=ModelList)
async def list_models(ctx: Ctx) -> ModelList:
    """Every model the pod serves, the default one first, each followed by its LoRA adapters."""
    return ModelList(data=await _cards(ctx))


@router.get("/models/{model:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[404]})
async def retrieve_model(model: str, ctx: Ctx) -> ModelCard:
    """A served model or adapter by its exact name (a lookup, unlike inference, takes no stand-in name)."""
    card = next((card for card in await _cards(ctx) if card.id == model), None)
    if card is None:
        raise _unknown_model(ctx, model)
    return card


# -- LoRA adapters at run time (vLLM's routes; MindIE serves the same) ---------------------------------------


ADAPTER_RESPONSES: OpenApiResponses = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "done"},
    400: ERROR_RESPONSES[400], 404: ERROR_RESPONSES[404],
}


def _master(ctx: ServerContext, model: str | None) -> ServerContext:
    named = ctx if model is None else ctx.for_model(model)
    if named is None:
        raise _unknown_model(ctx, model or "", "master_model")
    return named


@router.post("/load_lora_adapter", response_model=None, responses=ADAPTER_RESPONSES)
async def load_lora_adapter(body: LoadLoraAdapterRequest, ctx: Ctx) -> PlainTextResponse:
    """Serve one more LoRA adapter for a model, from now on, on every worker of that model (a worker loads it
    from its folder at the first request for it)."""
    model = _master(ctx, body.master_model)
    name = body.lora_name
    if not adapters.allowed_folder(ctx.settings, body.lora_path):
        raise ProtocolError(400, f"The lora adapter `{name}` cannot be loaded: `lora_path` is not in a folder "
                            "adapters may be loaded from (loraAdapterRoots)", "validation", "lora_path")
    if (why := adapters.folder_refusal(body.lora_path)) is not None:
        raise ProtocolError(400, f"The lora adapter `{name}` cannot be loaded: {why}", "validation", "lora_path")
    if name in ctx.models:
        raise ProtocolError(400, f"The lora adapter name `{name}` is a served model's name.", "validation",
                            "lora_name")
    if not await adapters.add(model, name, body.lora_path):
        raise ProtocolError(400, f"The lora adapter `{name}` has already been loaded.", "validation", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter", response_model=None, responses=ADAPTER_RESPONSES)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, ctx: Ctx) -> PlainTextResponse:
    """Stop serving a LoRA adapter: new requests for it are refused at once; the workers free it when the
    requests running with it have finished."""
    if not await adapters.remove(_master(ctx, body.master_model), body.lora_name):
        raise ProtocolError(404, f"The lora adapter `{body.lora_name}` cannot be found.", "not_found", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
