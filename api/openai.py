"""OpenAI-compatible routes under ``/v1``: completions, chat completions (both also as SSE streams) and models.

A thin translation over :mod:`api.pipeline`, like :mod:`api.tgi`. Every error is OpenAI's
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
from functools import partial
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from pydantic import BaseModel

from api.context import ModelInfo, ServerContext, get_ctx
from api.errors import VALIDATION_PREFIX, ProtocolError, error_route_class, pipeline_error
from api.openai_schemas import (
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
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorResponse,
    OpenAIFinishReason,
    SamplingRequest,
    Usage,
)
from api.pipeline import (
    GenerationRequest,
    PipelineError,
    effective_max_new_tokens,
    generate,
    new_request_id,
    random_seed,
    submit,
    tokenize,
)
from api.sse import event_stream
from common.protocol import Finish, SamplingParams, TokenEvent

OWNED_BY = "ferry"
GREEDY_TEMPERATURE = 1e-5  # vLLM's threshold: a lower temperature is greedy decoding
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "[DONE]"
FINISH_REASONS: dict[str, OpenAIFinishReason] = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
# OpenAI statuses for each pipeline failure (503 is OpenAI's "overloaded, retry later").
PIPELINE_STATUS = {
    "validation": 400,
    "generation": 500,
    "incomplete_generation": 500,
    "overloaded": 503,
    "unavailable": 503,
    "client_disconnected": 499,
}


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

ERROR_RESPONSES = {
    400: {"model": OpenAIErrorResponse, "description": "Invalid request"},
    404: {"model": OpenAIErrorResponse, "description": "Unknown model"},
    500: {"model": OpenAIErrorResponse, "description": "Generation failed or timed out"},
    503: {"model": OpenAIErrorResponse, "description": "Overloaded (queue full) or Redis unreachable"},
}
STREAM_RESPONSE = {"content": {"text/event-stream": {}},
                   "description": "when stream is true: chunks, then `data: [DONE]`"}

Ctx = Annotated[ServerContext, Depends(get_ctx)]


def _invalid(message: str, param: str | None, code: str = "validation") -> ProtocolError:
    return ProtocolError(400, VALIDATION_PREFIX + message, code, param)


def _unknown_model(ctx: ServerContext, model: str) -> ProtocolError:
    served = ", ".join(f"`{name}`" for name in ctx.models)
    return ProtocolError(404, f"The model `{model}` does not exist: this server serves {served}.", "model_not_found",
                         "model")


def model_context(ctx: ServerContext, model: str) -> ServerContext:
    """The context of the model a request names: with one model served, any name is that model (TGI ignores
    the name: ``huggingface_hub`` sends ``"dummy"``); with several, a name the pod does not serve is 404."""
    if len(ctx.models) == 1:
        return ctx
    named = ctx.for_model(model)
    if named is None:
        raise _unknown_model(ctx, model)
    return named


def _check_prompt_length(ctx: ServerContext, field: str, ids: list[int]) -> None:
    if len(ids) > ctx.max_input_tokens:
        raise _invalid(f"`{field}` must have at most {ctx.max_input_tokens} tokens. Given: {len(ids)}", field,
                       "context_length_exceeded")


def _sampling(
    ctx: ServerContext, body: SamplingRequest, max_tokens: int | None, default_max_tokens: int
) -> SamplingParams:
    """The OpenAI sampling fields as the pipeline's, every default resolved."""
    temperature = 1.0 if body.temperature is None else body.temperature
    greedy = temperature < GREEDY_TEMPERATURE
    vocab_size = ctx.model.vocab_size
    bad = next((i for i in body.stop_token_ids or () if i >= vocab_size), None)
    if bad is not None:
        raise _invalid(f"`stop_token_ids` must be < the vocabulary size {vocab_size}. Given: {bad}", "stop_token_ids")
    top_k = ctx.model.default_top_k if body.top_k is None else max(body.top_k, 0)  # vLLM: -1 and 0 are off
    return SamplingParams(
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_k=min(top_k, vocab_size),
        top_p=1.0 if body.top_p is None else body.top_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=random_seed() if body.seed is None else body.seed % 2**64,
        max_new_tokens=effective_max_new_tokens(ctx, max_tokens, default_max_tokens),
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=bool(body.ignore_eos),
    )


async def to_completion_request(ctx: ServerContext, body: CompletionRequest, request_id: str) -> GenerationRequest:
    """``/v1/completions`` as a pipeline request for the model of ``ctx`` (:func:`model_context`): the prompt
    tokenized (or its ids checked), defaults resolved."""
    if isinstance(body.prompt, str):
        ids = await tokenize(ctx, body.prompt)
    else:
        ids = body.prompt  # the schema made a list prompt one list of ids
        bad = next((i for i in ids if i >= ctx.model.vocab_size), None)
        if bad is not None:
            raise _invalid(f"`prompt` token ids must be < the vocabulary size {ctx.model.vocab_size}. Given: {bad}",
                           "prompt")
    _check_prompt_length(ctx, "prompt", ids)
    params = _sampling(ctx, body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    return GenerationRequest(request_id=request_id, input_ids=ids, params=params)


async def to_chat_request(ctx: ServerContext, body: ChatCompletionRequest, request_id: str) -> GenerationRequest:
    """``/v1/chat/completions`` as a pipeline request for the model of ``ctx`` (:func:`model_context`): the
    messages rendered with the model's chat template (ending with the assistant's turn), then tokenized without
    adding special tokens, as ``transformers`` and vLLM do (a template that starts with BOS would otherwise get
    two)."""
    tokenizer = ctx.model.tokenizer
    if tokenizer.chat_template is None:
        raise _invalid(f"the model `{ctx.model.model_id}` has no chat template, so it cannot take `messages`: "
                       "use /v1/completions with a `prompt`", "messages")
    render = partial(tokenizer.apply_chat_template, [m.for_template() for m in body.messages],
                     add_generation_prompt=True, tokenize=False)
    try:
        prompt = await anyio.to_thread.run_sync(render)
    except TemplateError as exc:
        raise _invalid(f"the model's chat template rejected the `messages`: {exc}", "messages") from None
    ids = await tokenize(ctx, prompt, add_special_tokens=False)  # the template placed BOS if the model wants it
    _check_prompt_length(ctx, "messages", ids)
    params = _sampling(ctx, body, body.token_limit, ctx.settings.max_iter_times)
    return GenerationRequest(request_id=request_id, input_ids=ids, params=params)


def _usage(finish: Finish) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.generated_tokens,
                 total_tokens=finish.prompt_tokens + finish.generated_tokens)


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


async def _stream(ctx: ServerContext, request: GenerationRequest, shape: Shape, include_usage: bool) -> Response:
    """Queue the request (failures answer with a status), then stream: the opening chunks, one chunk per
    non-empty text delta, the closing chunk with the finish reason, the usage chunk when asked for, ``[DONE]``."""
    try:
        submission = await submit(ctx, request)
    except PipelineError as exc:
        raise pipeline_error(exc, PIPELINE_STATUS) from None

    async def render(events: AsyncIterator[TokenEvent]) -> AsyncIterator[str]:
        for chunk in shape.opening():
            yield _chunk_json(chunk, include_usage)
        async for event in events:
            if event.token.text:
                yield _chunk_json(shape.delta(event.token.text), include_usage)
            if event.finish is not None:
                yield _chunk_json(shape.closing(FINISH_REASONS[event.finish.finish_reason]), include_usage)
                if include_usage:
                    yield _chunk_json(shape.usage(_usage(event.finish)), include_usage)
        yield DONE

    def render_error(exc: PipelineError) -> str:
        return openai_error(pipeline_error(exc, PIPELINE_STATUS)).model_dump_json()

    return event_stream(submission, render, render_error)


async def _respond(
    ctx: ServerContext, body: SamplingRequest, request: GenerationRequest, shape: Shape, http: Request
) -> Response:
    """The stream when asked for, else the whole response once generation finishes."""
    if body.stream:
        return await _stream(ctx, request, shape, body.include_usage)
    try:
        result = await generate(ctx, request, http)
    except PipelineError as exc:
        raise pipeline_error(exc, PIPELINE_STATUS) from None
    return JSONResponse(shape.response(result.finish).model_dump())


@router.post("/completions", responses={**ERROR_RESPONSES, 200: {"model": Completion, **STREAM_RESPONSE}})
async def completions(body: CompletionRequest, ctx: Ctx, http: Request) -> Response:
    """Text completion of one prompt (a string or token ids)."""
    ctx = model_context(ctx, body.model)
    shape = CompletionShape(id=f"cmpl-{new_request_id()}", created=int(time.time()), model=ctx.model.model_id)
    return await _respond(ctx, body, await to_completion_request(ctx, body, shape.id), shape, http)


@router.post("/chat/completions", responses={**ERROR_RESPONSES, 200: {"model": ChatCompletion, **STREAM_RESPONSE}})
async def chat_completions(body: ChatCompletionRequest, ctx: Ctx, http: Request) -> Response:
    """The assistant's reply to the messages, rendered with the model's chat template."""
    ctx = model_context(ctx, body.model)
    shape = ChatShape(id=f"chatcmpl-{new_request_id()}", created=int(time.time()), model=ctx.model.model_id)
    return await _respond(ctx, body, await to_chat_request(ctx, body, shape.id), shape, http)


def _model_card(model: ModelInfo) -> ModelCard:
    """A served model; ``created`` is when its weights' config was written."""
    created = int((model.path / "config.json").stat().st_mtime)
    return ModelCard(id=model.model_id, created=created, owned_by=OWNED_BY)


@router.get("/models", response_model=ModelList)
async def list_models(ctx: Ctx) -> ModelList:
    """Every model the pod serves, the default one first."""
    return ModelList(data=[_model_card(model) for model in ctx.models.values()])


@router.get("/models/{model:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[404]})
async def retrieve_model(model: str, ctx: Ctx) -> ModelCard:
    """A served model by its exact name (a lookup, unlike inference, takes no stand-in name)."""
    if model not in ctx.models:
        raise _unknown_model(ctx, model)
    return _model_card(ctx.models[model])
