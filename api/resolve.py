"""The resolution of the protocol-neutral request (:class:`api.request.InferenceRequest`) into a job.

Adapters only translate: their body becomes an :class:`~api.request.InferenceRequest`, and the pipeline's
results become their responses. Everything between lives here, once: tokenising, chat templates, truncation,
the length and vocabulary limits, defaults, seeds, request ids and the maxIterTimes cap, each refusal in the
protocol's terms through its :class:`api.errors.Protocol` (the table each adapter declares beside its error
format). :mod:`api.pipeline` then queues the job and maps its failures through the same table.
"""

from __future__ import annotations

import secrets
from functools import partial

import anyio
from jinja2 import TemplateError
from pydantic import ValidationError

from api.context import ServerContext
from api.errors import Protocol
from api.media import MediaData, MediaRefused, MediaSource
from api.request import InferenceRequest, QueuedRequest, new_request_id
from common.protocol import ParameterError, SamplingParams

INLINE_TOKENIZE_CHARS = 256  # shorter prompts cost less on the event loop than a thread hop (bench/RESULTS.md)


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

