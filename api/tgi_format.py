"""TGI 0.9.4's text-generation format, which the TGI routes (:mod:`api.tgi.routes`) and MindIE's
(:mod:`api.mindie.routes`, whose ``/generate`` and ``/infer`` take TGI's body and parameters) both speak: the
request and answer shapes with SPEC.md section 1's rules, the status of each failure, the error body, and the
``x-request-id`` header. One module beside both protocols, so that neither imports the other.

Field rules live on the models (one rule per field, messages worded like TGI's ``validation.rs``);
rules that need the tokenizer or server limits live in :mod:`api.resolve`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Header
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.errors import OpenApiResponses, Protocol, ProtocolError
from api.media import MediaSource
from api.ranges import Integer, in_range, stop_schema, text_schema
from api.rules import (
    MAX_INPUT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_ITEMS,
    REQUEST_ID_PATTERN,
    REQUEST_ID_REGEX,
    check_text,
    checked_constraint,
    constraint_of,
    validate_adapter_id,
    validate_stop,
)
from common.protocol import ADAPTER_NAME_PATTERN, Constraint, FinishReason, MediaKind

UINT32_MAX_PARAM = 2147483647
UINT64_MAX = 2**64 - 1
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens


def _null_allowed(schema: dict[str, Any]) -> None:
    """A field's JSON schema hook: null is accepted too (its before-validator reads it as the default)."""
    kept = {key: schema.pop(key) for key in ("title", "default", "description") if key in schema}
    branch = dict(schema)
    schema.clear()
    schema.update(anyOf=[branch, {"type": "null"}], **kept)


class TGIGrammar(BaseModel):
    """``parameters.grammar`` (TGI >= 1.4.3, huggingface_hub's ``grammar=``): the output matches a JSON schema
    (``json``: the schema, or its JSON text; ``json_schema``: ``{"name", "schema"}``) or a regex."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"oneOf": [
        {"properties": {"type": {"const": "json"}, "value": {"type": ["object", "string"]}}},
        {"properties": {"type": {"const": "regex"}, "value": {"type": "string"}}},
        {"properties": {"type": {"const": "json_schema"}, "value": {
            "type": "object", "properties": {"schema": {"type": "object"}}, "required": ["schema"]}}},
    ]})

    type: Literal["json", "regex", "json_schema"]
    value: Any

    def constraint(self) -> Constraint:
        """The constraint, its shape checked (:func:`api.rules.checked_constraint` compiles it)."""
        value = self.value
        if self.type == "json_schema":
            if not isinstance(value, dict) or not isinstance(value.get("schema"), dict):
                raise ValueError("`grammar` of type 'json_schema' takes a value with a `schema` object")
            value = value["schema"]
        if self.type == "regex" and not isinstance(value, str):
            raise ValueError(f"`grammar` of type 'regex' takes a string value. Given: {value!r}")
        return constraint_of("grammar", "regex" if self.type == "regex" else "json", value)


class TGIParameters(BaseModel):
    """``parameters`` of a TGI request. ``null`` means unset for every field; unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    best_of: Annotated[
        Integer | None, in_range("`best_of` != 1 is not supported by this server. Given: {v}", ge=1, le=1)
    ] = None
    decoder_input_details: bool | None = None
    details: bool | None = None
    do_sample: bool | None = None
    max_new_tokens: Annotated[
        Integer | None,
        in_range(f"`max_new_tokens` must be strictly positive and <= {UINT32_MAX_PARAM}. Given: {{v}}",
                 gt=0, le=UINT32_MAX_PARAM),
    ] = None
    repetition_penalty: Annotated[
        float | None, in_range("`repetition_penalty` must be strictly positive", gt=0.0)
    ] = None
    return_full_text: bool | None = None
    seed: Annotated[
        Integer | None, in_range(f"`seed` must be > 0 and <= {UINT64_MAX}. Given: {{v}}", gt=0, le=UINT64_MAX)
    ] = None
    temperature: Annotated[
        float | None, in_range("`temperature` must be strictly positive (> 1e-06). Given: {v}", gt=1e-6)
    ] = None
    top_k: Annotated[
        Integer | None,
        in_range(f"`top_k` must be strictly positive and <= {UINT32_MAX_PARAM}. Given: {{v}}",
                 gt=0, le=UINT32_MAX_PARAM),
    ] = None
    top_n_tokens: Annotated[
        Integer | None,
        in_range(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {{v}}", ge=0, le=MAX_TOP_N_TOKENS),
    ] = Field(None, description="TGI 1.x's alternatives of each token: validated as TGI does, not returned")
    top_p: Annotated[float | None, in_range("`top_p` must be > 1e-06 and < 1.0. Given: {v}", gt=1e-6, lt=1.0)] = None
    truncate: Annotated[
        Integer | None,
        in_range(f"`truncate` must be strictly positive and <= {UINT32_MAX_PARAM}. Given: {{v}}",
                 gt=0, le=UINT32_MAX_PARAM),
    ] = None
    typical_p: Annotated[
        float | None, in_range("`typical_p` must be > 0.0 and <= 1.0. Given: {v}", gt=0.0, le=1.0)
    ] = None
    watermark: bool | None = None
    stop: Annotated[list[str] | str | None, stop_schema(MAX_STOP_ITEMS, MAX_STOP_CHARS)] = None
    adapter_id: str | None = Field(None, json_schema_extra={"pattern": ADAPTER_NAME_PATTERN},
                                   description="the LoRA adapter to run with; \"None\" (the default): the base model")
    grammar: TGIGrammar | None = Field(None, description="what the output must match (structured outputs)")

    @field_validator("grammar")
    @classmethod
    def _grammar_compiles(cls, v: TGIGrammar | None) -> TGIGrammar | None:
        if v is not None:
            checked_constraint("grammar", v.constraint())
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | str | None) -> list[str]:
        return validate_stop(v)

    _adapter_id = field_validator("adapter_id")(staticmethod(validate_adapter_id))

    def request_fields(self) -> dict[str, Any]:
        """These parameters under the names of the protocol-neutral request (:class:`api.request.InferenceRequest`),
        each mapped explicitly; ``details``, ``return_full_text`` and the validated-only fields shape the answer."""
        return {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "typical_p": self.typical_p,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed, "max_new_tokens": self.max_new_tokens,
            "do_sample": self.sampling, "truncate": self.truncate, "stop": self.stop or [],
            "decoder_input_details": bool(self.decoder_input_details), "adapter": self.adapter_id,
            "constraint": None if self.grammar is None else self.grammar.constraint(),
        }

    @property
    def wants_details(self) -> bool:
        return bool(self.details or self.decoder_input_details)

    @property
    def sampling(self) -> bool:
        """SPEC.md: explicit do_sample wins; unset, any active warper turns sampling on."""
        if self.do_sample is not None:
            return self.do_sample
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or self.top_k is not None
            or self.top_p is not None
            or (self.typical_p is not None and self.typical_p < 1.0)
        )


class _InputItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextItem(_InputItem):
    type: Literal["text"]
    text: str = Field(max_length=MAX_INPUT_CHARS)


MediaPath = Annotated[str, Field(min_length=1)]


class MediaUrl(_InputItem):
    """OpenAI's form of a media item's source, ``{"url": ...}``, taken beside the seed's plain string."""

    url: MediaPath


class ImageItem(_InputItem):
    type: Literal["image_url"]
    image_url: MediaPath | MediaUrl = Field(description="a path under multimodalInputDir, a file://, "
                                      "http(s):// or base64 JPEG data: URI")


class VideoItem(_InputItem):
    type: Literal["video_url"]
    video_url: MediaPath | MediaUrl = Field(description="a path under multimodalInputDir, a file:// or "
                                      "http(s):// URI")


class AudioItem(_InputItem):
    type: Literal["audio_url"]
    audio_url: MediaPath | MediaUrl = Field(description="a path under multimodalInputDir, a file:// or "
                                      "http(s):// URI")


InputItem = Annotated[TextItem | ImageItem | VideoItem | AudioItem, Field(discriminator="type")]
MEDIA_ITEM_KINDS: dict[type[_InputItem], MediaKind] = {ImageItem: "image", VideoItem: "video", AudioItem: "audio"}


def prompt_parts(items: list[InputItem]) -> list[str | MediaSource]:
    """The list form as the pipeline's prompt parts: texts, and each media item with its source and name."""
    parts: list[str | MediaSource] = []
    for index, item in enumerate(items):
        if isinstance(item, TextItem):
            parts.append(item.text)
        else:
            source = getattr(item, item.type)
            parts.append(MediaSource(kind=MEDIA_ITEM_KINDS[type(item)], label=f"`inputs[{index}]` ({item.type})",
                                     source=source if isinstance(source, str) else source.url))
    return parts


def null_is_empty(value: Any) -> Any:
    """``null`` for an object means unset: an empty one."""
    return {} if value is None else value


def null_is_false(value: Any) -> Any:
    return False if value is None else value


class TGIRequest(BaseModel):
    """Body of ``POST /``, ``/generate`` and ``/generate_stream``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: Annotated[str, text_schema(MAX_INPUT_CHARS, "a text prompt")] | Annotated[
        list[InputItem], Field(min_length=1)
    ] = Field(
        description="the prompt: a text, or (a multimodal model) a list of text, image_url, video_url and audio_url "
        "items, media in the order the model sees them"
    )
    parameters: TGIParameters = Field(default_factory=TGIParameters, json_schema_extra=_null_allowed)
    stream: bool = Field(False, json_schema_extra=_null_allowed)

    _null_parameters = field_validator("parameters", mode="before")(staticmethod(null_is_empty))
    _null_stream = field_validator("stream", mode="before")(staticmethod(null_is_false))

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if not v:
            raise ValueError("`inputs` cannot be empty")
        texts = [v] if isinstance(v, str) else [item.text for item in v if isinstance(item, TextItem)]
        for text in texts:
            check_text("inputs", text)
        if (chars := sum(map(len, texts))) > MAX_INPUT_CHARS:
            raise ValueError(f"`inputs` must have at most {MAX_INPUT_CHARS} characters. Given: {chars}")
        return v


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class TGIPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class TGIDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    prefill: list[TGIPrefillToken]
    tokens: list[TGIToken]


class TGIGenerateResponse(BaseModel):
    """One generation; ``details`` is left out of the JSON unless requested."""

    generated_text: str
    details: TGIDetails | None = None


class TGIErrorResponse(BaseModel):
    error: str
    error_type: Literal["validation", "generation", "overloaded", "incomplete_generation", "unhealthy"] | str


def render_tgi_error(exc: ProtocolError) -> Response:
    return JSONResponse({"error": exc.message, "error_type": exc.error_type}, status_code=exc.status)


ERROR_RESPONSES: OpenApiResponses = {
    422: {"model": TGIErrorResponse, "description": "Input validation error"},
    424: {"model": TGIErrorResponse, "description": "Generation error"},
    429: {"model": TGIErrorResponse, "description": "Overloaded: queue or connection limit reached"},
    500: {"model": TGIErrorResponse, "description": "Incomplete generation (timed out)"},
    503: {"model": TGIErrorResponse, "description": "The server is stopping (stopService)"},
}


# TGI's statuses for each pipeline failure (429, never 503: huggingface_hub retries a 503 forever).
TGI = Protocol(
    statuses={
        "validation": 422,
        "generation": 424,
        "unavailable": 424,
        "overloaded": 429,
        "stopping": 503,  # stopService: this pod is going away; a retry belongs on another pod
        "incomplete_generation": 500,
        "client_disconnected": 499,
    },
    too_long="`{field}` must have less than {limit} tokens. Given: {count}",  # TGI's wording
)


def client_request_id(header: str | None) -> str | None:
    """The client's ``x-request-id`` when well formed (it names the request for cancel/logs); None: a new one."""
    if header is not None and not REQUEST_ID_PATTERN.match(header):
        raise TGI.invalid("`x-request-id` must be 1 to 256 characters of letters, digits, '_' or '-'")
    return header


SSE_CONTENT: dict[str, Any] = {"content": {"text/event-stream": {}}}  # a stream's 200, beside or instead of JSON
RequestIdHeader = Annotated[str | None, Header(alias="x-request-id", json_schema_extra={"pattern": REQUEST_ID_REGEX})]
