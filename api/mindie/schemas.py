"""Request and response shapes of MindIE's native routes (:mod:`api.mindie.routes`): ``POST /generate`` in vLLM
0.2.6's dialect, ``POST /infer`` and ``/infer_token``, ``POST /v1/tokenizer``.

Field rules live on the models, each message naming its field; rules that need the tokenizer or the server
limits live in :mod:`api.resolve`. ``null`` means unset for every optional field. The ``/infer`` parameters
are TGI's (:class:`api.tgi_format.TGIParameters`, same ranges and wording) plus MindIE's ``priority`` and
``timeout``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from api.ranges import Integer, WholeNumbers, in_range, stop_schema, text_schema
from api.rules import MAX_INPUT_CHARS, MAX_STOP_CHARS, MAX_STOP_ITEMS, check_text, check_token_ids, validate_stop
from api.tgi_format import (
    UINT32_MAX_PARAM,
    UINT64_MAX,
    TGIParameters,
    TGIRequest,
    _null_allowed,
    null_is_empty,
    null_is_false,
)
from api.vllm_fields import FrequencyPenalty, PresencePenalty, StopTokenIds, VllmRepetitionPenalty, VllmTopP
from common.protocol import FinishReason

MAX_TIMEOUT_SECONDS = 65535  # MindIE's `timeout` parameter: 1 to 65535 s
NUL = b"\0"  # vLLM 0.2.6's stream delimiter
TOP_K_RULE = f"`top_k` must be -1 (off) or in [1, {UINT32_MAX_PARAM}]. Given: {{v}}"


def check_prompt_text(field: str, value: str) -> str:
    """A text prompt under TGI's ``inputs`` rules: not empty, at most 4 MiB of characters, valid Unicode."""
    if not value:
        raise ValueError(f"`{field}` cannot be empty")
    if len(value) > MAX_INPUT_CHARS:
        raise ValueError(f"`{field}` must have at most {MAX_INPUT_CHARS} characters. Given: {len(value)}")
    return check_text(field, value)


# ------------------------------------------------------------------------------- POST /generate (vLLM 0.2.6)


def _only(field: str, allowed: Any) -> Any:
    """A field accepted only at one value (or null), refused otherwise with a message naming it."""

    def check(value: Any) -> Any:
        if value is not None and value != allowed:
            raise ValueError(f"`{field}` is only supported as {str(allowed).lower()}. Given: {value!r}")
        return value

    return check


class VLLMGenerateRequest(BaseModel):
    """``POST /generate`` with a ``prompt``: vLLM 0.2.6's api_server body (its ``SamplingParams`` fields).
    Unknown fields are refused (vLLM passes every field to ``SamplingParams``, which refuses them too)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    prompt: Annotated[str, text_schema(MAX_INPUT_CHARS, "the prompt text")]
    stream: bool | None = None
    max_tokens: Annotated[
        Integer | None,
        in_range(f"`max_tokens` must be strictly positive and <= {UINT32_MAX_PARAM}. Given: {{v}}",
                 gt=0, le=UINT32_MAX_PARAM),
    ] = Field(None, description="unset: the server's maxIterTimes; capped at maxIterTimes")
    temperature: Annotated[
        float | None, in_range("`temperature` must be >= 0 (0 = greedy). Given: {v}", ge=0.0)
    ] = Field(None, description="1.0 when unset (vLLM samples by default); below 1e-5: greedy")
    top_k: Annotated[
        Integer | None,
        in_range(TOP_K_RULE, ge=-1, le=UINT32_MAX_PARAM),
    ] = Field(None, json_schema_extra={"not": {"const": 0}}, description="-1 or unset: off")
    top_p: VllmTopP = None
    seed: Annotated[
        Integer | None, in_range(f"`seed` must be >= 0 and <= {UINT64_MAX}. Given: {{v}}", ge=0, le=UINT64_MAX)
    ] = None
    repetition_penalty: VllmRepetitionPenalty = None
    presence_penalty: PresencePenalty = None
    frequency_penalty: FrequencyPenalty = None
    stop: Annotated[list[str] | str | None, stop_schema(MAX_STOP_ITEMS, MAX_STOP_CHARS)] = None
    stop_token_ids: StopTokenIds = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = Field(
        None, json_schema_extra={"enum": [False, None]},
        description="only false: the output never holds the stop string (SPEC.md)",
    )
    skip_special_tokens: bool | None = Field(
        None, json_schema_extra={"enum": [True, None]}, description="only true: special tokens are never decoded"
    )
    n: Integer | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1}, description="only 1")
    best_of: Integer | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1}, description="only 1")
    use_beam_search: bool | None = Field(None, json_schema_extra={"enum": [False, None]}, description="only false")

    _prompt = field_validator("prompt")(staticmethod(lambda v: check_prompt_text("prompt", v)))
    _include_stop = field_validator("include_stop_str_in_output")(
        staticmethod(_only("include_stop_str_in_output", False)))
    _skip_special = field_validator("skip_special_tokens")(staticmethod(_only("skip_special_tokens", True)))
    _n = field_validator("n")(staticmethod(_only("n", 1)))
    _best_of = field_validator("best_of")(staticmethod(_only("best_of", 1)))
    _beam = field_validator("use_beam_search")(staticmethod(_only("use_beam_search", False)))

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | str | None) -> list[str]:
        return validate_stop(v)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError(TOP_K_RULE.format(v=v))
        return v



class TGIGenerateBody(TGIRequest):
    """TGI's ``/generate`` body as the shared route documents it: it holds no ``prompt`` (that is vLLM's)."""

    model_config = ConfigDict(json_schema_extra={"not": {"required": ["prompt"]}})


def _dialect(body: Any) -> str | None:
    """Which body ``POST /generate`` got: vLLM's with a ``prompt``, None (a conflict) with ``prompt`` and
    ``inputs``, else TGI's, whose validation names what is wrong (a missing ``inputs``, a body not an object)."""
    if isinstance(body, dict) and "prompt" in body:
        return None if "inputs" in body else VLLM_TAG
    return TGI_TAG


# The union's tags show in an error's location; bracketed, they are not taken for a field (api.errors._field),
# as pydantic's own union-member locations ("function-after[...]") are not.
TGI_TAG, VLLM_TAG = "dialect[tgi]", "dialect[vllm]"
GENERATE_DIALECTS = "`inputs` (TGI) and `prompt` (vLLM) cannot both be given: send exactly one"
GenerateBody = Annotated[
    Annotated[TGIGenerateBody, Tag(TGI_TAG)] | Annotated[VLLMGenerateRequest, Tag(VLLM_TAG)],
    Discriminator(_dialect, custom_error_type="generate_dialect", custom_error_message=GENERATE_DIALECTS),
]


class VLLMGenerateResponse(BaseModel):
    text: list[str] = Field(description="one item: the prompt followed by the completion")


# ------------------------------------------------------------------------------- POST /infer, /infer_token


class MindIEParameters(TGIParameters):
    """``parameters`` of ``/infer``: TGI's, plus MindIE's ``priority`` and ``timeout``."""

    priority: Annotated[Integer | None, in_range("`priority` must be in [1, 5]. Given: {v}", ge=1, le=5)] = Field(
        None, description="1 (served first) to 5; default 5. Queued requests of a lower number start first"
    )
    timeout: Annotated[
        Integer | None,
        in_range(f"`timeout` must be in [1, {MAX_TIMEOUT_SECONDS}] seconds. Given: {{v}}",
                 ge=1, le=MAX_TIMEOUT_SECONDS),
    ] = Field(None, description="seconds: the request's deadline (e2eTimeout and tokenTimeout still apply)")


class MindIEInferRequest(BaseModel):
    """Body of ``POST /infer`` and ``/infer_token``: a text ``inputs`` or token ids ``input_id`` (not both)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["inputs"]}, {"required": ["input_id"]}],
        # `return_full_text` needs a text prompt (a rule of api.mindie.routes)
        "if": {"required": ["input_id"]},
        "then": {"properties": {"parameters": {"properties": {"return_full_text": {"enum": [False, None]}}}}},
    })

    # Typed without None so that an explicit null is refused (strict): None is only the default of an absent one
    inputs: Annotated[str, text_schema(MAX_INPUT_CHARS, "a text prompt (or give `input_id`)")] = None  # type: ignore[assignment]
    input_id: Annotated[list[int], WholeNumbers] = Field(
        None,  # type: ignore[arg-type]
        json_schema_extra={"items": {"type": "integer", "minimum": 0}, "minItems": 1},
        description="the prompt's token ids (or give `inputs`)",
    )
    stream: bool = Field(False, json_schema_extra=_null_allowed)
    parameters: MindIEParameters = Field(default_factory=MindIEParameters, json_schema_extra=_null_allowed)

    _null_parameters = field_validator("parameters", mode="before")(staticmethod(null_is_empty))
    _null_stream = field_validator("stream", mode="before")(staticmethod(null_is_false))

    _inputs = field_validator("inputs")(staticmethod(lambda v: check_prompt_text("inputs", v)))

    @field_validator("input_id")
    @classmethod
    def _input_id(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("`input_id` cannot be empty")
        return check_token_ids("input_id", v)

    @model_validator(mode="after")
    def _one_prompt(self) -> MindIEInferRequest:
        if self.inputs is not None and self.input_id is not None:
            raise ValueError("Input conflict.")
        if self.inputs is None and self.input_id is None:
            raise ValueError("either `inputs` (text) or `input_id` (token ids) is required")
        return self


class MindIEPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class MindIEDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    generated_token_ids: list[int]
    seed: int
    prefill: list[MindIEPrefillToken] | None = Field(None, description="only with decoder_input_details")


class MindIEInferResponse(BaseModel):
    generated_text: str
    details: MindIEDetails


class MindIEStreamToken(BaseModel):
    id: int
    text: str


class MindIEStreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int


class MindIEStreamResponse(BaseModel):
    prefill_time: float | None = Field(description="ms from queueing to the first token (first event only)")
    decode_time: float | None = Field(description="ms since the previous token (null on the first event)")
    token: MindIEStreamToken
    generated_text: str | None = None
    details: MindIEStreamDetails | None = None


# ------------------------------------------------------------------------------- POST /v1/tokenizer


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: Annotated[str, text_schema(MAX_INPUT_CHARS, "the text to tokenize")]

    _inputs = field_validator("inputs")(staticmethod(lambda v: check_prompt_text("inputs", v)))


class TokenizeResponse(BaseModel):
    token_number: int
    tokens: list[int]



# ------------------------------------------------------------------------------- status, health and metrics


class SlotCountResponse(BaseModel):
    """``GET /v2/models/{m}/getSlotCount``: summed over the model's live workers' last reports."""

    total_slots: int = Field(ge=0, description="maxBatchSize of each live worker, summed")
    free_slots: int = Field(ge=0, description="slots not running a request")
    available_tokens_length: int = Field(ge=0, description="KV tokens not held by running requests")


class ModelLoad(BaseModel):
    """One model's load, from its live workers' last reports and its job stream."""

    live_workers: int = Field(ge=0)
    waiting_requests: int = Field(ge=0, description="queued, not running yet")
    running_requests: int = Field(ge=0)
    free_kv_tokens: int = Field(ge=0)
    total_kv_tokens: int = Field(ge=0, description="maxBatchTotalTokens of each live worker, summed")


class StatusResponse(ModelLoad):
    """``GET /v1/status`` and ``/v2/status``: the default model's load at the top level, every served model's
    (the default included) under ``models``."""

    model: str = Field(description="the default model")
    models: dict[str, ModelLoad]


class TimedHealthResponse(BaseModel):
    """``GET /health/timed``: 200 ``healthy``, or 500 ``unhealthy`` with the ``error``."""

    status: str = Field(description="healthy or unhealthy")
    error: str | None = None


class ModelMetrics(BaseModel):
    """One model's latencies as this pod measured them since it started, and its load from Redis."""

    avg_ttft_ms: float | None = Field(description="mean time to first token, from queueing; null before one")
    avg_tbt_ms: float | None = Field(description="mean time between two tokens of a request; null before one")
    waiting_requests: int = Field(ge=0, description="queued, not running yet")
    processing_requests: int = Field(ge=0, description="running on the live workers")


class MetricsJsonResponse(ModelMetrics):
    """``GET /metrics-json``: the default model's numbers at the top level, every served model's under
    ``models``."""

    model: str = Field(description="the default model")
    models: dict[str, ModelMetrics]
