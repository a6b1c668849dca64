"""The one protocol-neutral request every adapter builds, and its resolution into a job.

Adapters (:mod:`api.tgi`, :mod:`api.kserve`, :mod:`api.openai`) only translate: their body becomes an
:class:`InferenceRequest` (the prompt as text, token ids or chat messages; each sampling field as the client
sent it, None where unset; protocol flags), and the pipeline's results become their responses. Everything
between lives here, once: tokenising, chat templates, truncation, the length and vocabulary limits, defaults,
seeds, request ids, the maxIterTimes cap, and turning a pipeline failure into the protocol's status through
its :class:`Protocol` (the table each adapter declares beside its error format).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

import anyio
from jinja2 import TemplateError
from pydantic import ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from api import pipeline
from api.context import ServerContext
from api.errors import VALIDATION_PREFIX, ProtocolError
from api.media import MediaData, MediaRefused, MediaSource
from api.pipeline import GenerationResult, PipelineError, QueuedRequest, Submission
from common.protocol import ParameterError, RequestOptions, SamplingParams

INLINE_TOKENIZE_CHARS = 256  # shorter prompts cost less on the event loop than a thread hop (bench/RESULTS.md)
DEFAULT_MAX_NEW_TOKENS = 20  # SPEC.md, TGI and KServe routes


# The statuses KServe v2 and OpenAI both give each pipeline failure: 400 a bad request, 500 a failed generation,
# 503 retry later, 499 (nginx's) a client that left. TGI's differ (api/tgi.py).
REST_STATUSES: Mapping[str, int] = MappingProxyType({
    "validation": 400,
    "generation": 500,
    "incomplete_generation": 500,
    "overloaded": 503,
    "unavailable": 503,
    "stopping": 503,
    "client_disconnected": 499,
})


@dataclass(frozen=True)
class Protocol:
    """What differs between protocols once a body is translated: the status of each pipeline failure
    (``validation`` included) and the few rules their specs set differently."""

    statuses: Mapping[str, int]
    # A prompt over the token limit: the message ({field}, {limit}, {count}) and its machine-readable code.
    too_long: str = "`{field}` must have at most {limit} tokens. Given: {count}"
    too_long_code: str = "validation"
    # KServe (SPEC.md section 2): top_k >= the vocabulary and max_new_tokens > maxIterTimes are errors;
    # elsewhere top_k is clamped to the vocabulary and max_new_tokens capped at maxIterTimes.
    strict_limits: bool = False
    # An unset top_k: the model's default (generation_config.json, then config.json), or off.
    model_default_top_k: bool = True

    def invalid(self, message: str, field: str | None = None, code: str = "validation") -> ProtocolError:
        """A request this protocol refuses, with its validation status and the field at fault."""
        return ProtocolError(self.statuses["validation"], VALIDATION_PREFIX + message, code, field)

    def failure(self, exc: PipelineError) -> ProtocolError:
        """A pipeline failure with this protocol's status for its type (500 when it has none), and the
        validation prefix on a validation failure (a request id already in flight)."""
        message = VALIDATION_PREFIX + exc.message if exc.error_type == "validation" else exc.message
        return ProtocolError(self.statuses.get(exc.error_type, 500), message, exc.error_type)


class InferenceRequest(RequestOptions):
    """One request as every adapter translates it, before :func:`resolve`. Exactly one of ``text``,
    ``token_ids``, ``messages`` and ``parts`` is the prompt; ``prompt_field`` names it in errors. Sampling fields
    are as sent (None: unset), already in the pipeline's meaning (e.g. top_k 0 is off); the
    :class:`~common.protocol.RequestOptions` go to the engines as they are."""

    model_config = ConfigDict(frozen=True)

    request_id: str | None = Field(None, description="the client's id; None: a new one")
    prompt_field: str
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = Field(
        None, description="chat messages, rendered with the chat template; a content is a text, or (media) parts"
    )
    parts: list[str | MediaSource] | None = Field(
        None, description="a multimodal prompt: texts and media items, in the order the model sees them"
    )
    truncate: int | None = Field(None, description="keep only the prompt's last tokens")
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    default_max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, description="when unset; None: maxIterTimes")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @property
    def media_sources(self) -> list[MediaSource]:
        """The prompt's media items, in the order the model sees them."""
        parts = self.parts or [part for message in self.messages or () if isinstance(message["content"], list)
                               for part in message["content"]]
        return [part for part in parts if isinstance(part, MediaSource)]

    @model_validator(mode="after")
    def _one_prompt(self) -> InferenceRequest:
        if sum(p is not None for p in (self.text, self.token_ids, self.messages, self.parts)) != 1:
            raise ValueError("a request has exactly one prompt: text, token ids, messages or parts")
        return self


def new_request_id() -> str:
    return uuid.uuid4().hex


def random_seed() -> int:
    """A server-chosen seed in the spec's range (0, 2^64-1], sent with the job so a retry reproduces it."""
    return secrets.randbelow(2**64 - 1) + 1


async def tokenize(ctx: ServerContext, text: str, add_special_tokens: bool = True) -> list[int]:
    """The text's token ids. A long text is tokenized off the event loop (it takes a while); a short one on
    it, since handing it to a thread costs more than the tokenizing. Text rendered by a chat template already
    holds the special tokens it needs (BOS too): it takes ``add_special_tokens=False``."""
    encode = partial(ctx.model.tokenizer.encode, text, add_special_tokens=add_special_tokens)
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return encode()
    return await anyio.to_thread.run_sync(encode)


async def _render_chat(ctx: ServerContext, protocol: Protocol, request: InferenceRequest) -> str:
    """The messages rendered with the model's chat template, ending with the assistant's turn; a message whose
    content holds media has them as the model's placeholders, its parts joined with newlines as its texts are."""
    tokenizer, field = ctx.model.tokenizer, request.prompt_field
    if tokenizer.chat_template is None:
        raise protocol.invalid(f"the model `{ctx.model.model_id}` has no chat template, so it cannot take "
                               f"`{field}`: use /v1/completions with a `prompt`", field)
    assert request.messages is not None
    messages = [message if isinstance(message["content"], str) else
                {**message, "content": _placeholder_text(ctx, protocol, message["content"], field, "\n")}
                for message in request.messages]
    render = partial(tokenizer.render_chat, messages)
    try:
        return await anyio.to_thread.run_sync(render)
    except TemplateError as exc:
        raise protocol.invalid(f"the model's chat template rejected the `{field}`: {exc}", field) from None


async def resolve(ctx: ServerContext, protocol: Protocol, request: InferenceRequest) -> QueuedRequest:
    """The request as the pipeline takes it: the prompt tokenized (text) or rendered and tokenized without
    adding special tokens (messages: the template placed BOS if the model wants one, as transformers and vLLM
    do), then :func:`resolve_ids`; a multimodal prompt's media are read last (:func:`_media`)."""
    if request.token_ids is not None:
        return resolve_ids(ctx, protocol, request)
    if request.messages is not None:
        ids = await tokenize(ctx, await _render_chat(ctx, protocol, request), add_special_tokens=False)
    elif request.parts is not None:
        ids = await tokenize(ctx, _placeholder_text(ctx, protocol, request.parts, request.prompt_field))
    else:
        assert request.text is not None  # the model validator: exactly one prompt
        ids = await tokenize(ctx, request.text)
    resolved = resolve_ids(ctx, protocol, request, ids)
    if sources := request.media_sources:
        resolved.media = await _media(ctx, protocol, request, sources, resolved.input_ids)
    return resolved


def _placeholder_text(ctx: ServerContext, protocol: Protocol, parts: list[str | MediaSource], field: str,
                      separator: str = "") -> str:
    """A multimodal prompt as one text, each media item as the model's placeholder token for its kind (the
    worker's processor expands it into the item's features). A kind the model does not take is refused here,
    before anything is read."""
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        token = ctx.model.media_tokens.get(part.kind)
        if token is None:
            reason = (f"Ferry serves no {part.kind} input yet (images only)" if part.kind in ctx.model.declared_media
                      else f"the model `{ctx.model.model_id}` takes no {part.kind} input")
            raise protocol.invalid(f"{part.label}: {reason}", field)
        texts.append(token.text)
    return separator.join(texts)


async def _media(ctx: ServerContext, protocol: Protocol, request: InferenceRequest, sources: list[MediaSource],
                 ids: list[int]) -> list[MediaData]:
    """The media items read (:class:`api.media.MediaLoader`), once the prompt holds exactly one placeholder
    per item: a text that spells a placeholder itself, or a truncation that cut one, is refused."""
    for kind, token in ctx.model.media_tokens.items():
        wanted, found = sum(source.kind == kind for source in sources), ids.count(token.id)
        if wanted != found:
            raise protocol.invalid(
                f"`{request.prompt_field}` holds {found} {kind} placeholder tokens ({token.text}) for {wanted} "
                f"{kind} items: the text may not spell the placeholder, nor `truncate` cut an item",
                request.prompt_field,
            )
    assert ctx.media is not None  # ServerContext.__post_init__ makes one
    try:
        return await ctx.media.load_all(sources)
    except MediaRefused as exc:
        raise protocol.invalid(str(exc), request.prompt_field) from None


def resolve_ids(
    ctx: ServerContext, protocol: Protocol, request: InferenceRequest, ids: list[int] | None = None
) -> QueuedRequest:
    """Check the prompt's ids (``ids``, else the request's own) against the model and the server limits,
    and resolve every default."""
    ids = request.token_ids if ids is None else ids
    assert ids is not None  # a text or chat prompt comes here through resolve, tokenized
    field, vocab_size = request.prompt_field, ctx.model.vocab_size
    if request.truncate is not None:
        ids = ids[-request.truncate:]
    limit = ctx.max_input_tokens
    if len(ids) > limit:
        message = protocol.too_long.format(field=field, limit=limit, count=len(ids))
        raise protocol.invalid(message, field, protocol.too_long_code)
    if request.token_ids is not None:
        _check_vocabulary(protocol, f"`{field}` token ids", field, ids, vocab_size)
    _check_vocabulary(protocol, "`stop_token_ids`", "stop_token_ids", request.stop_token_ids, vocab_size)
    return QueuedRequest(
        **request.options(),
        request_id=request.request_id or new_request_id(),
        input_ids=ids,
        params=_sampling(ctx, protocol, request),
    )


def _check_vocabulary(protocol: Protocol, what: str, field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise protocol.invalid(f"{what} must be < the vocabulary size {vocab_size}. Given: {bad}", field)


def _sampling(ctx: ServerContext, protocol: Protocol, request: InferenceRequest) -> SamplingParams:
    """The sampling fields with every default resolved and the model's and server's limits applied; a value
    the engines cannot compute with (:class:`common.protocol.SamplingParams` says which) is the protocol's
    validation error, for the field it names."""
    vocab_size, limit = ctx.model.vocab_size, ctx.settings.max_iter_times
    top_k, max_new_tokens = request.top_k, request.max_new_tokens
    if protocol.strict_limits:
        if top_k is not None and top_k >= vocab_size:
            raise protocol.invalid(f"`top_k` must be < the vocabulary size {vocab_size}. Given: {top_k}", "top_k")
        if max_new_tokens is not None and max_new_tokens > limit:
            raise protocol.invalid(
                f"`max_new_tokens` must be <= {limit} (maxIterTimes). Given: {max_new_tokens}", "max_new_tokens"
            )
    if top_k is None:
        top_k = ctx.model.default_top_k if protocol.model_default_top_k else 0
    if max_new_tokens is None:
        max_new_tokens = request.default_max_new_tokens or limit
    try:
        return SamplingParams(
            do_sample=request.do_sample,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=min(top_k, vocab_size),
            top_p=1.0 if request.top_p is None else request.top_p,
            typical_p=1.0 if request.typical_p is None else request.typical_p,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            seed=random_seed() if request.seed is None else request.seed,
            max_new_tokens=min(limit, max_new_tokens),  # SPEC.md: min(maxIterTimes, max_new_tokens)
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, ParameterError):
            raise protocol.invalid(str(cause), cause.field) from None
        field = ".".join(map(str, error["loc"]))
        raise protocol.invalid(f"`{field}`: {error['msg']}. Given: {error['input']}", field) from None


async def generate(
    ctx: ServerContext, protocol: Protocol, request: QueuedRequest, client: Request
) -> GenerationResult:
    """Run the request to completion (:func:`api.pipeline.generate`); a failure as the protocol's error."""
    try:
        return await pipeline.generate(ctx, request, client)
    except PipelineError as exc:
        raise protocol.failure(exc) from None


async def submit(ctx: ServerContext, protocol: Protocol, request: QueuedRequest) -> Submission:
    """Queue the request for a stream (:func:`api.pipeline.submit`); a refusal as the protocol's error, so it
    answers with a status before the stream starts."""
    try:
        return await pipeline.submit(ctx, request)
    except PipelineError as exc:
        raise protocol.failure(exc) from None
