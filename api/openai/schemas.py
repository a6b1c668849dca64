"""Request and response shapes of the OpenAI-compatible routes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``).

Field rules live on the models, one validator per rule, each message naming its field; rules that need the
tokenizer, the model or the server limits live in :mod:`api.openai.routes`. ``null`` means unset everywhere. Nothing
is silently dropped: a body field is honoured (OpenAI's, and vLLM's sampling extras ``top_k``,
``repetition_penalty``, ``ignore_eos`` and ``stop_token_ids``), rejected with a message naming it (OpenAI
parameters asking for what is not built, and any field not declared here, such as vLLM's ``min_p``), or
accepted and ignored because it cannot change the output (``metadata``, ``parallel_tool_calls``; README lists
them). ``user`` names the request's end user in the pod's log line for the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict

from api.media import MediaSource
from api.ranges import Integer, WholeNumbers, in_range, stop_schema, text_json_schema
from api.rules import (
    ANY_JSON_OBJECT,
    MAX_INPUT_CHARS,
    MAX_STOP_CHARS,
    check_text,
    checked_constraint,
    constraint_of,
    validate_stop,
)
from api.vllm_fields import FrequencyPenalty, PresencePenalty, StopTokenIds, VllmRepetitionPenalty, VllmTopP
from common.protocol import ADAPTER_NAME_PATTERN, Constraint, MediaKind

OPENAI_MAX_STOP = 4  # OpenAI's cap on stop sequences, stricter than the pipeline's
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# The prompt's two forms as /v1/completions takes them (CompletionRequest._prompt enforces both).
PROMPT_TEXT = text_json_schema(MAX_INPUT_CHARS)
PROMPT_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
CHAT_ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLES = ("tool", "function")

OpenAIFinishReason = Literal["stop", "length"]
NO_TOOLS: JsonDict = {"maxItems": 0}  # tools and functions: none or []
NO_TOOL_CHOICE = WithJsonSchema({"enum": ["none", None], "description": "no tool calling: only 'none'"})


def _unicode_name(value: str, info: ValidationInfo) -> str:
    """A model's name is looked up in Redis and repeated in errors, neither of which can carry text that is not
    valid Unicode (a lone surrogate, "\\ud800" in JSON)."""
    return check_text(info.field_name or "model", value)


ModelName = Annotated[str, AfterValidator(_unicode_name)]


def _unsupported(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"`{field}` {why}. Given: {value!r}")


def _required(*fields: str) -> Callable[[dict[str, Any]], None]:
    """A model's JSON schema hook: ``fields`` are required and not null there, as the request validators
    enforce (the models keep them optional so that a missing one gets the validator's clear message)."""

    def declare(schema: dict[str, Any]) -> None:
        schema["required"] = sorted({*schema.get("required", []), *fields})
        for name in fields:
            field = schema["properties"][name]
            if "anyOf" in field:
                field["anyOf"] = [branch for branch in field["anyOf"] if branch.get("type") != "null"]
            field.pop("default", None)

    return declare


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, every chunk also carries the usage so far (else ignored)")


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must match (always enforced, ``strict`` or not)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="the JSON schema; empty or absent: any JSON value")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
    })

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`response_format.json_schema` is required with type 'json_schema'")
        return self

    def constraint(self) -> Constraint | None:
        """The constraint it asks for; None for text."""
        if self.json_schema is not None and self.type == "json_schema":
            return constraint_of("response_format.json_schema.schema", "json", self.json_schema.schema_ or {})
        return constraint_of("response_format", "json", ANY_JSON_OBJECT) if self.type == "json_object" else None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON schema, any JSON object, a regex, a choice list or a grammar
    (Lark or GBNF)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema, or its JSON text")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, json_schema_extra={"minItems": 1})
    grammar: str | None = None

    @property
    def _given(self) -> dict[str, tuple[str, Any]]:
        """The constraints given: each field's name, with its kind and value."""
        any_object = ANY_JSON_OBJECT if self.json_object else None
        return {name: (kind, value) for name, kind, value in (
            ("json", "json", self.json_), ("regex", "regex", self.regex), ("choice", "choice", self.choice),
            ("grammar", "grammar", self.grammar), ("json_object", "json", any_object),
        ) if value is not None}

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if len(self._given) > 1:
            raise ValueError(f"`structured_outputs` takes one constraint. Given: {', '.join(self._given)}")
        return self

    def constraint(self) -> Constraint | None:
        """The constraint it asks for; None when it asks for none."""
        return next((constraint_of(f"structured_outputs.{name}", kind, value)
                     for name, (kind, value) in self._given.items()), None)


# vLLM's older names of its structured outputs, which existing clients still send, with their kinds
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class SamplingRequest(BaseModel):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share; any other field is rejected."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra={
        # `stream_options` (an object) only with `stream: true` (the _stream_options validator)
        "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
        "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    })

    model: ModelName = Field(description="with one model served, any name (TGI's rule); with several, one of them")
    max_tokens: Annotated[Integer | None, in_range("`max_tokens` must be strictly positive. Given: {v}", gt=0)] = None
    temperature: Annotated[
        float | None, in_range("`temperature` must be >= 0 and <= 2 (0 = greedy). Given: {v}", ge=0.0, le=2.0)
    ] = None
    top_p: VllmTopP = None
    n: Annotated[
        Integer | None, in_range("`n` must be 1: this server returns one choice per request. Given: {v}", ge=1, le=1)
    ] = None
    stop: Annotated[list[str] | str | None, stop_schema(OPENAI_MAX_STOP, MAX_STOP_CHARS)] = None
    seed: Annotated[
        Integer | None,
        in_range(f"`seed` must be a 64-bit signed integer, >= {INT64_MIN} and <= {INT64_MAX}. Given: {{v}}",
                 ge=INT64_MIN, le=INT64_MAX),
    ] = None
    presence_penalty: PresencePenalty = None
    frequency_penalty: FrequencyPenalty = None
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0}, description="only {}")
    user: str | None = Field(None, max_length=256, description="the end user, named in the request's log line")
    metadata: dict[str, str] | None = None  # accepted and ignored: tags for OpenAI's dashboards
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's sampling extras
    top_k: Annotated[
        Integer | None, in_range(f"`top_k` must be -1 or 0 (off) or a positive integer <= {INT32_MAX}. Given: {{v}}",
                             ge=-1, le=INT32_MAX)
    ] = None
    repetition_penalty: VllmRepetitionPenalty = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds = None
    min_tokens: Annotated[
        Integer | None,
        in_range("`min_tokens` is not supported yet, only 0 (EOS may end the output at any length). Given: {v}",
                 ge=0, le=0),
    ] = None
    # structured outputs: OpenAI's, vLLM's, and vLLM's older fields (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, json_schema_extra={"minItems": 1})
    guided_grammar: str | None = None
    _constraint: Constraint | None = PrivateAttr(None)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | str | None) -> list[str]:
        stops = validate_stop(v)
        if len(stops) > OPENAI_MAX_STOP:
            raise ValueError(f"`stop` supports up to {OPENAI_MAX_STOP} stop sequences. Given: {len(stops)}")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise _unsupported("logit_bias", v, "is not supported yet, only an empty object")
        return v


    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        return v

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _compiles(cls, v: ResponseFormat | StructuredOutputs | None, info: ValidationInfo) -> Any:
        """The constraint asked for compiles (a 400 naming the field, nothing queued)."""
        if v is not None and (constraint := v.constraint()) is not None:
            assert info.field_name is not None  # a field validator's
            checked_constraint(info.field_name, constraint)
        return v

    @field_validator(*GUIDED_FIELDS)
    @classmethod
    def _guided_compiles(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            assert info.field_name is not None  # a field validator's
            checked_constraint(info.field_name, constraint_of(info.field_name, GUIDED_FIELDS[info.field_name], v))
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingRequest:
        """At most one way of constraining the output."""
        given = {name: constraint for name, constraint in (
            ("response_format", None if self.response_format is None else self.response_format.constraint()),
            ("structured_outputs", None if self.structured_outputs is None else self.structured_outputs.constraint()),
            *((name, None if value is None else constraint_of(name, kind, value))
              for name, kind in GUIDED_FIELDS.items() for value in (getattr(self, name),)),
        ) if constraint is not None}
        if len(given) > 1:
            raise ValueError(f"the output takes one constraint. Given: {', '.join(given)}")
        self._constraint = next(iter(given.values()), None)
        return self

    @property
    def constraint(self) -> Constraint | None:
        """What the output must match (structured outputs), checked; None: free text."""
        return self._constraint

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions``. ``prompt`` is one text, or one list of token ids (a list holding
    one of either is the same prompt); several prompts in one request are not supported."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WholeNumbers, WithJsonSchema({"anyOf": [
        PROMPT_TEXT,
        PROMPT_IDS,
        {"type": "array", "items": {"anyOf": [PROMPT_TEXT, PROMPT_IDS]}, "minItems": 1, "maxItems": 1},
    ], "description": "one prompt: a text or token ids, or a list holding one of either"})]
    echo: bool | None = Field(None, json_schema_extra={"enum": [False, None]}, description="only false")
    best_of: Integer | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1}, description="only 1")
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0}, description="no insertion mode")
    logprobs: Annotated[int | None, WithJsonSchema({"type": "null", "description": "not supported yet"})] = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[int]:
        """One prompt, as text or as token ids; the union's own type errors are replaced by one clear message."""
        try:
            v = handler(value)
        except ValidationError:
            raise ValueError("`prompt` must be a string, a list of integer token ids, or a list holding one of "
                             "either") from None
        if isinstance(v, list) and (not v or not isinstance(v[0], int)):
            if len(v) != 1:
                raise ValueError("`prompt` must be one prompt: send one request per prompt (batches are not "
                                 f"supported). Given: a list of {len(v)} prompts")
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("`prompt` cannot be empty")
            if len(v) > MAX_INPUT_CHARS:
                raise ValueError(f"`prompt` must have at most {MAX_INPUT_CHARS} characters. Given: {len(v)}")
            return check_text("prompt", v)
        if not v:
            raise ValueError("`prompt` cannot be an empty list of token ids")
        bad = next((i for i in v if i < 0), None)
        if bad is not None:
            raise ValueError(f"`prompt` token ids must be >= 0. Given: {bad}")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("echo", v, "is not supported, only false")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported("best_of", v, "must be 1: best-of sampling is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("suffix", v, "is not supported (no insertion mode)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise _unsupported("logprobs", v, "is not supported yet")
        return v


class MediaUrl(BaseModel):
    """A content part's media source, ``{"url": ...}``: a path under multimodalInputDir, a file://, http(s):// or
    (images) base64 JPEG data: URI. ``detail`` is accepted and ignored, as vLLM does: the model's processor sets
    the resolution."""

    model_config = ConfigDict(strict=True, extra="ignore")

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


MEDIA_PART_KINDS: dict[str, MediaKind] = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


def _one_kind_of_part(schema: dict[str, Any]) -> None:
    """A content part's JSON schema: its ``type``, and the field that type names, not null (as
    ``ChatCompletionRequest._messages`` enforces)."""
    schema["required"] = ["type"]
    schema["oneOf"] = [
        {"properties": {"type": {"const": kind}, kind: {"type": "string" if kind == "text" else "object"}},
         "required": [kind]}
        for kind in ("text", *MEDIA_PART_KINDS)
    ]


class ContentPart(BaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or a media item
    ``{"type": "image_url", "image_url": {"url": ...}}`` (``video_url``, ``audio_url`` likewise; vLLM's names)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_one_kind_of_part)

    type: str = Field(json_schema_extra={"enum": ["text", *MEDIA_PART_KINDS]})
    text: str | None = None
    image_url: MediaUrl | None = None
    video_url: MediaUrl | None = None
    audio_url: MediaUrl | None = None

    def media(self, label: str) -> MediaSource | None:
        """The part as a media item named ``label`` in errors; None for a text part."""
        source = getattr(self, self.type, None) if self.type in MEDIA_PART_KINDS else None
        return None if source is None else MediaSource(kind=MEDIA_PART_KINDS[self.type], source=source.url,
                                                       label=f"`{label}` ({self.type})")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_required("content"))

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = Field(None, json_schema_extra={"maxItems": 0}, description="no tool calling")

    @property
    def text(self) -> str:
        """The content's text: text parts are joined with newlines (as vLLM does); media parts hold none."""
        assert self.content is not None  # the request validator requires content
        return self.content if isinstance(self.content, str) else "\n".join(
            p.text or "" for p in self.content if p.type == "text")

    def for_template(self, where: str) -> dict[str, Any]:
        """The message as the pipeline takes it (``developer``, OpenAI's newer name, is ``system``): its content a
        string, or with media the parts in order (texts, and media items named after ``where``)."""
        content: str | list[str | MediaSource] = self.text
        if isinstance(self.content, list) and any(part.type != "text" for part in self.content):
            content = [part.media(f"{where}.content[{j}]") or part.text or "" for j, part in enumerate(self.content)]
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Annotated[
        Integer | None, in_range("`max_completion_tokens` must be strictly positive. Given: {v}", gt=0)
    ] = None
    logprobs: bool | None = Field(None, json_schema_extra={"enum": [False, None]}, description="only false")
    top_logprobs: Integer | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 0}, description="only 0")
    tools: list[Any] | None = Field(None, json_schema_extra=NO_TOOLS, description="no tool calling")
    tool_choice: Annotated[str | dict[str, Any] | None, NO_TOOL_CHOICE] = None
    functions: list[Any] | None = Field(None, json_schema_extra=NO_TOOLS, description="no tool calling")
    function_call: Annotated[str | dict[str, Any] | None, NO_TOOL_CHOICE] = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: there are no tools to call

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("`messages` must hold at least one message")
        for i, message in enumerate(v):
            where = f"messages[{i}]"
            if message.role in TOOL_ROLES:
                raise ValueError(f"`{where}.role` '{message.role}' is not supported: this server has no tool calling")
            if message.role not in CHAT_ROLES:
                raise ValueError(f"`{where}.role` must be one of {', '.join(map(repr, CHAT_ROLES))}. "
                                 f"Given: {message.role!r}")
            if message.tool_calls:
                raise ValueError(f"`{where}.tool_calls` is not supported: this server has no tool calling")
            if message.content is None:
                raise ValueError(f"`{where}.content` is required")
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type not in ("text", *MEDIA_PART_KINDS):
                    raise ValueError(f"`{where}.content[{j}]` of type {part.type!r} is not supported: content "
                                     f"parts are text, {', '.join(MEDIA_PART_KINDS)}")
                if getattr(part, part.type) is None:
                    raise ValueError(f"`{where}.content[{j}].{part.type}` is required")
            check_text(f"{where}.content", message.text)
            if message.name is not None:  # the chat template may render it
                check_text(f"{where}.name", message.name)
        total = sum(len(message.text) for message in v)
        if total > MAX_INPUT_CHARS:
            raise ValueError(f"`messages` must have at most {MAX_INPUT_CHARS} characters of content. Given: {total}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("logprobs", v, "is not supported yet, only false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _unsupported("top_logprobs", v, "is not supported yet")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if v:
            raise ValueError(f"`{info.field_name}` is not supported: this server has no tool calling")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None, info: ValidationInfo) -> str | dict[str, Any] | None:
        if v is not None and v != "none":
            assert info.field_name is not None  # a field validator's
            raise _unsupported(info.field_name, v, "is not supported, only 'none': this server has no tool calling")
        return v

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("`max_tokens` and `max_completion_tokens` disagree: give one of them. "
                             f"Given: {self.max_tokens} and {self.max_completion_tokens}")
        return self

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: OpenAIFinishReason | None = None


class Completion(BaseModel):
    """The completion, and each chunk of its stream (``text`` is then the delta)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: OpenAIFinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: OpenAIFinishReason | None = None

    @field_serializer("delta")
    def _delta(self, delta: ChatDelta) -> dict[str, str]:
        """Only the fields the delta sets, as OpenAI sends them (the last chunk's delta is ``{}``)."""
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = Field(None, description="the weights' folder (an adapter's: its peft folder)")
    parent: str | None = Field(None, description="a LoRA adapter's base model; null for a model")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError


class LoadLoraAdapterRequest(BaseModel):
    """Body of ``POST /v1/load_lora_adapter``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(pattern=ADAPTER_NAME_PATTERN, description="the name requests select it by")
    lora_path: str = Field(min_length=1, description="the peft adapter folder, at the same path on every worker")
    master_model: ModelName | None = Field(None, description="the served model it adapts; default: the default model")


class UnloadLoraAdapterRequest(BaseModel):
    """Body of ``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    master_model: ModelName | None = None
