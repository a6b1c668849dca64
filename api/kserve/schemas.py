"""Request and response shapes of the KServe v2 / Triton routes, with SPEC.md section 2's rules.

Field rules live on the models (one validator per rule, each message naming its field); rules that need
the model (vocabulary size) or the server limits live in :mod:`api.resolve`; the request's binary
tensor data is read in :mod:`api.kserve.routes`.

Sampling parameters are accepted in three places, all optional: ``inputs[0].parameters`` (where the seed
puts them), the request's ``parameters`` object (KServe's place for request parameters, where
``tritonclient``'s ``infer(parameters=...)`` puts them) and the top level of the body (where the original
server's documents put them). A parameter set in more than one place must have the same value there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from api.ranges import Integer, in_range, stop_schema, text_schema
from api.rules import (
    MAX_INPUT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_ITEMS,
    REQUEST_ID_PATTERN,
    REQUEST_ID_REGEX,
    check_text,
    validate_adapter_id,
    validate_stop,
)
from common.protocol import ADAPTER_NAME_PATTERN

INPUT_NAME = "input0"
OUTPUT_NAME = "output0"
DATATYPE = "UINT32"
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def _null_is_empty(value: Any) -> Any:
    """Null means unset: an explicit ``"parameters": null`` is an empty object."""
    return {} if value is None else value


NullIsEmpty = BeforeValidator(_null_is_empty)


class SamplingParameters(BaseModel):
    """The sampling parameters of SPEC.md section 2. ``null`` means unset; unknown keys are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    temperature: Annotated[
        float | None, in_range("`temperature` must be strictly positive. Given: {v}", gt=0.0)
    ] = None
    top_k: Annotated[
        Integer | None, in_range(f"`top_k` must be >= 0 and <= {INT32_MAX} (0 = off). Given: {{v}}", ge=0, le=INT32_MAX)
    ] = None
    top_p: Annotated[
        float | None, in_range("`top_p` must be > 0.0 and <= 1.0 (1.0 = off). Given: {v}", gt=0.0, le=1.0)
    ] = None
    do_sample: bool | None = None
    seed: Annotated[
        Integer | None, in_range(f"`seed` must be > 0 and <= {UINT64_MAX}. Given: {{v}}", gt=0, le=UINT64_MAX)
    ] = None
    repetition_penalty: Annotated[
        float | None, in_range("`repetition_penalty` must be strictly positive. Given: {v}", gt=0.0)
    ] = None
    max_new_tokens: Annotated[
        Integer | None, in_range("`max_new_tokens` must be strictly positive. Given: {v}", gt=0)
    ] = None
    adapter_id: str | None = Field(None, json_schema_extra={"pattern": ADAPTER_NAME_PATTERN},
                                   description="the LoRA adapter to run with; \"None\": the base model")

    _adapter_id = field_validator("adapter_id")(staticmethod(validate_adapter_id))

    def request_fields(self) -> dict[str, Any]:
        """These parameters under the names of the protocol-neutral request (:class:`api.request.InferenceRequest`),
        each mapped explicitly."""
        return {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed,
            "repetition_penalty": self.repetition_penalty, "max_new_tokens": self.max_new_tokens,
            "do_sample": bool(self.do_sample), "adapter": self.adapter_id,
        }


P = TypeVar("P", bound=SamplingParameters)


def merge_parameters(result: type[P], sources: Sequence[BaseModel], names: Mapping[str, str]) -> P:
    """One set of parameters out of the places a request may set them; ``names`` maps a source field to
    the parameter it sets (aliases such as ``max_tokens`` set ``max_new_tokens``). Disagreement is an error."""
    merged: dict[str, Any] = {}
    for source in sources:
        for field, name in names.items():
            value = getattr(source, field)
            if value is None:
                continue
            if name in merged and merged[name] != value:
                raise ValueError(f"`{name}` is given twice with different values: {merged[name]!r} and {value!r}")
            merged[name] = value
    # every value was validated in its source. The pydantic mypy plugin types model_construct as returning the
    # class that declares it (SamplingParameters), not type[P]'s P
    return result.model_construct(**merged)  # type: ignore[return-value]


class InputParameters(SamplingParameters):
    """``inputs[0].parameters``: sampling parameters, and the binary tensor extension's byte count."""

    binary_data_size: Integer | None = None

    @field_validator("binary_data_size")
    @classmethod
    def _binary_data_size(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"`inputs[0].parameters.binary_data_size` must be >= 0. Given: {v}")
        return v


class RequestParameters(SamplingParameters):
    """The request's ``parameters``: sampling parameters and Triton's ``binary_data_output`` default."""

    binary_data_output: bool | None = None


class KServeInput(BaseModel):
    """The one input tensor: the prompt's token ids, in ``data`` or as binary data after the JSON."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    shape: list[int]
    datatype: str
    data: list[int] | None = None
    parameters: Annotated[InputParameters, NullIsEmpty] = Field(default_factory=InputParameters)


    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v != INPUT_NAME:
            raise ValueError(f"`inputs[0].name` must be '{INPUT_NAME}'. Given: '{v}'")
        return v

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, v: str) -> str:
        if v != DATATYPE:
            raise ValueError(f"`inputs[0].datatype` must be '{DATATYPE}', the only datatype supported. Given: '{v}'")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or v[0] != 1 or v[1] <= 0:
            raise ValueError(f"`inputs[0].shape` must be [1, n] with n > 0 the number of token ids. Given: {v}")
        return v

    @field_validator("data")
    @classmethod
    def _data(cls, v: list[int] | None) -> list[int] | None:
        bad = next((i for i in v or () if not 0 <= i <= UINT32_MAX), None)
        if bad is not None:
            raise ValueError(f"`inputs[0].data` holds UINT32 token ids, >= 0 and <= {UINT32_MAX}. Given: {bad}")
        return v

    @model_validator(mode="after")
    def _data_matches_shape(self) -> KServeInput:
        binary = self.parameters.binary_data_size is not None
        if (self.data is None) == (not binary):
            raise ValueError(
                "`inputs[0]` must carry its token ids either in `data` or, with the binary tensor extension, "
                "as `parameters.binary_data_size` bytes after the JSON header (exactly one of the two)"
            )
        if self.data is not None and len(self.data) != self.n:
            raise ValueError(
                f"`inputs[0].shape` {self.shape} does not match `inputs[0].data`, which holds {len(self.data)} ids"
            )
        return self

    @property
    def n(self) -> int:
        return self.shape[1]


class OutputParameters(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    binary_data: bool | None = None


class KServeRequestedOutput(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    parameters: Annotated[OutputParameters, NullIsEmpty] = Field(default_factory=OutputParameters)


    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v != OUTPUT_NAME:
            raise ValueError(f"`outputs[0].name` must be '{OUTPUT_NAME}'. Given: '{v}'")
        return v


class KServeInferRequest(SamplingParameters):
    """Body of ``POST /v2/models/{model}/infer`` (its JSON part, with the binary tensor extension)."""

    id: str | None = Field(None, json_schema_extra={"pattern": REQUEST_ID_REGEX})
    inputs: list[KServeInput]
    outputs: list[KServeRequestedOutput] | None = None  # absent, null or []: output0 (KServe v2)
    parameters: Annotated[RequestParameters, NullIsEmpty] = Field(default_factory=RequestParameters)

    _sampling: SamplingParameters = PrivateAttr()

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        if v is not None and not REQUEST_ID_PATTERN.match(v):
            raise ValueError("`id` must be 1 to 256 characters of letters, digits, '_' or '-'")
        return v

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, v: list[KServeInput]) -> list[KServeInput]:
        if len(v) != 1:
            raise ValueError(f"`inputs` must hold exactly one tensor, '{INPUT_NAME}'. Given: {len(v)}")
        return v

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, v: list[KServeRequestedOutput] | None) -> list[KServeRequestedOutput] | None:
        if v and len(v) != 1:
            raise ValueError(f"`outputs` must name at most one output, '{OUTPUT_NAME}'. Given: {len(v)}")
        return v

    @model_validator(mode="after")
    def _merge(self) -> KServeInferRequest:
        names = {name: name for name in SamplingParameters.model_fields}
        self._sampling = merge_parameters(
            SamplingParameters, [self.inputs[0].parameters, self.parameters, self], names
        )
        return self

    @property
    def input(self) -> KServeInput:
        return self.inputs[0]

    @property
    def sampling(self) -> SamplingParameters:
        """The sampling parameters from all three places."""
        return self._sampling

    @property
    def binary_output(self) -> bool:
        """Triton's rule: the output's ``binary_data``, else the request's ``binary_data_output``, else JSON."""
        own = self.outputs[0].parameters.binary_data if self.outputs else None
        return own if own is not None else bool(self.parameters.binary_data_output)


class GenerateParameters(SamplingParameters):
    """Parameters of Triton's generate extension: infer's, plus ``stop`` and ``max_tokens``
    (TensorRT-LLM's name for ``max_new_tokens``)."""

    stop: Annotated[list[str] | str | None, stop_schema(MAX_STOP_ITEMS, MAX_STOP_CHARS)] = None
    max_tokens: Annotated[Integer | None, in_range("`max_tokens` must be strictly positive. Given: {v}", gt=0)] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | str | None) -> list[str] | None:
        return validate_stop(v) or None


class KServeGenerateRequest(GenerateParameters):
    """Body of ``POST /v2/models/{model}/generate`` and ``/generate_stream``: ``text_input`` and
    parameters, at the top level or in ``parameters`` (Triton puts them there)."""

    text_input: Annotated[str, text_schema(MAX_INPUT_CHARS, "the prompt")]
    parameters: Annotated[GenerateParameters, NullIsEmpty] = Field(default_factory=GenerateParameters)

    _sampling: GenerateParameters = PrivateAttr()

    @field_validator("text_input")
    @classmethod
    def _text_input(cls, v: str) -> str:
        if not v:
            raise ValueError("`text_input` cannot be empty")
        if len(v) > MAX_INPUT_CHARS:
            raise ValueError(f"`text_input` must have at most {MAX_INPUT_CHARS} characters. Given: {len(v)}")
        return check_text("text_input", v)

    @model_validator(mode="after")
    def _merge(self) -> KServeGenerateRequest:
        names = {name: name for name in GenerateParameters.model_fields} | {"max_tokens": "max_new_tokens"}
        self._sampling = merge_parameters(GenerateParameters, [self.parameters, self], names)
        return self

    @property
    def sampling(self) -> GenerateParameters:
        """The parameters from both places, ``max_tokens`` folded into ``max_new_tokens``."""
        return self._sampling


class KServeOutput(BaseModel):
    """``output0``: the result's token ids in ``data``, or ``binary_data_size`` bytes after the JSON."""

    name: str = OUTPUT_NAME
    datatype: str = DATATYPE
    shape: list[int]
    data: list[int] | None = None
    parameters: dict[str, int] | None = None


class KServeInferResponse(BaseModel):
    id: str
    model_name: str
    outputs: list[KServeOutput]


class KServeGenerateResponse(BaseModel):
    """The generate response, and each event of the generate stream (``text_output`` is then the delta)."""

    model_name: str
    model_version: str
    text_output: str


class KServeErrorResponse(BaseModel):
    error: str


class KServeServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class KServeTensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 is a dimension of any size")


class KServeModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[KServeTensorMetadata]
    outputs: list[KServeTensorMetadata]


class KServeModelConfigTensor(BaseModel):
    """A tensor of Triton's model configuration (``data_type`` in Triton's ``TYPE_`` form)."""

    name: str
    data_type: str
    dims: list[int] = Field(description="-1 is a dimension of any size")


class KServeModelConfig(BaseModel):
    """``GET /v2/models/{model}/config``: Triton's model configuration and MindIE's in one object, so that both
    kinds of client read it (docs/SPEC.md). Triton's fields describe the tensors: ``max_batch_size`` 0 means the
    batch dimension is part of ``dims`` (the explicit ``[1, n]``). MindIE's describe the deployment, with
    MindIE's meanings; the memory sizes are its GB of KV cache."""

    name: str
    platform: str
    max_batch_size: int
    input: list[KServeModelConfigTensor]
    output: list[KServeModelConfigTensor]
    model_name: str
    input_datatype: str = Field(description="input0's datatype")
    output_datatype: str = Field(description="output0's datatype")
    max_seq_len: int = Field(description="maxSeqLen: a request's prompt and generated tokens together")
    npu_mem_size: Literal[-1] = Field(
        description="GB of KV cache per device; -1, MindIE's value for a size the engine works out itself: "
        "maxBatchTotalTokens tokens (the built-in engine) or vLLM's own sizing"
    )
    cpu_mem_size: Literal[0] = Field(description="GB of host memory KV cache is swapped out to: none")
    world_size: int = Field(description="devices one worker runs the model on")
    model_weight_path: str = Field(description="the model's folder")
    model_instance_type: Literal["Standard"] = Field(description="MindIE's plain inference instance")


class RepositoryIndexRequest(BaseModel):
    """Body of ``POST /v2/repository/index`` (optional): ``ready`` true lists only the models ready now."""

    model_config = ConfigDict(strict=True, extra="forbid")

    ready: bool | None = None


class RepositoryModel(BaseModel):
    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE"] = Field(description="UNAVAILABLE comes with the reason")
    reason: str


class StatisticDuration(BaseModel):
    count: int = 0
    ns: int = Field(0, description="nanoseconds, summed over the counted requests")


class InferenceStatistics(BaseModel):
    """Triton's per-model durations: ``success`` and ``fail`` from queueing to the end, ``queue`` waiting for
    a worker, ``compute_infer`` the worker's generation; input and output handling are part of ``success``
    (not timed apart: zero), and there is no response cache (zero)."""

    success: StatisticDuration
    fail: StatisticDuration
    queue: StatisticDuration
    compute_input: StatisticDuration = Field(default_factory=StatisticDuration)
    compute_infer: StatisticDuration
    compute_output: StatisticDuration = Field(default_factory=StatisticDuration)
    cache_hit: StatisticDuration = Field(default_factory=StatisticDuration)
    cache_miss: StatisticDuration = Field(default_factory=StatisticDuration)


class ModelStatistics(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="milliseconds since the epoch when the last request ended, 0: none yet")
    inference_count: int = Field(description="requests that finished")
    execution_count: int = Field(description="generations run: one per finished request")
    inference_stats: InferenceStatistics
    batch_stats: list[Any] = Field(default_factory=list, description="none: workers batch across requests")


class KServeStatisticsResponse(BaseModel):
    """``GET /v2/models/stats`` and ``/v2/models/{model}/stats``: this API pod's counts since it started."""

    model_stats: list[ModelStatistics]


class StopInferRequest(BaseModel):
    """Body of ``POST /v2/models/{model}/stopInfer``: the id of the request to stop."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str = Field(pattern=REQUEST_ID_REGEX, description="the request id (KServe `id`, TGI `x-request-id`)")
