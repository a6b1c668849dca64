"""The wire protocol between API pods and workers.

An API pod validates a request, resolves it into the one :class:`GenerationRequest` type (already tokenized,
every sampling parameter resolved, a seed always set) and XADDs it, as a :class:`Job`, to the model's job
stream. A worker publishes one
:class:`TokenEvent` per generated token to the job's ``reply_channel``; the last one carries
:class:`Finish`. A failure is one :class:`ErrorEvent`. Protocol adapters (TGI, KServe v2, ...) translate
their own request/response shapes onto these models and nothing else.
"""

from __future__ import annotations

import math
import struct
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

FinishReason = Literal["length", "eos_token", "stop_sequence"]

# Request priorities (MindIE's ``priority``): workers take a queued job of a lower number first, first come first
# served within one; a running request is never preempted.
PRIORITIES = range(1, 6)
DEFAULT_PRIORITY = PRIORITIES[-1]
Priority = Annotated[int, Field(ge=PRIORITIES[0], le=PRIORITIES[-1])]


FLOAT32_TINY = 2.0**-126  # float32's smallest normal number, 1.1754944e-38
FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127  # float32's largest finite number, 3.4028235e+38
# The smallest repetition_penalty, and temperature when sampling: the sampler divides logits by both, so a logit
# grows at most 1e32-fold and any below 3.4e6 stays finite in float32 (a float16 model's are at most 65504, real
# models' in the tens; one beyond fails its request alone, worker.sampling). Every protocol's documented range
# above it stays accepted (TGI's temperature starts at 1e-6, the OpenAI routes sample at 1e-5 or above).
MIN_DIVISOR = 1e-16


def as_float32(value: float) -> float:
    """``value`` as the engines' samplers hold it: rounded to float32, infinite past float32's range."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


class ParameterError(ValueError):
    """A sampling parameter the engines cannot compute with; ``field`` names it, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingParams(BaseModel):
    """Per-request generation controls, fully resolved by the API (no "unset" left for the worker).

    Each one is what the engines can compute with (:meth:`_computable`): a value that would turn into NaN or
    inf in a sampler is refused here, where every protocol's request passes, and not in a worker's batch."""

    model_config = ConfigDict(allow_inf_nan=False)

    do_sample: bool = False
    temperature: float = Field(1.0, gt=0.0, description=f"at least {MIN_DIVISOR:g} when sampling")
    top_k: int = Field(0, ge=0, lt=2**63, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1.0 = off")
    typical_p: float = Field(1.0, gt=0.0, le=1.0, description="1.0 = off")
    repetition_penalty: float = Field(1.0, gt=0.0, description="1.0 = off")
    seed: int = Field(..., ge=0, lt=2**64)
    max_new_tokens: int = Field(..., gt=0)
    stop: list[str] = Field(default_factory=list, description="stop strings, excluded from the output")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="token ids that end the request as a stop string does; the token is kept"
    )
    ignore_eos: bool = Field(False, description="go on past the model's EOS tokens (to max_new_tokens)")

    @model_validator(mode="after")
    def _computable(self) -> SamplingParams:
        """Refuse what a sampler cannot compute with. Both engines' samplers hold these parameters as float32
        tensors (:class:`worker.sampling.BatchSampler`'s; vLLM's ``InputBatch``), where a value in range as a
        Python float can round to 0 or overflow to inf: a repetition_penalty of 5e-324 became 0, ``logits / 0``
        made NaN and the whole batch failed. Rounding to float32 is monotonic, so a value keeps its closed bounds;
        it can only lose an open bound at 0 or overflow, hence every float parameter (all are positive) must be a
        normal float32 (an accelerator may flush a subnormal one to zero). The two divisors of the logits are
        bounded by :data:`MIN_DIVISOR` besides, so that dividing a logit by them stays finite too."""
        if self.repetition_penalty < MIN_DIVISOR:
            raise ParameterError("repetition_penalty", f"`repetition_penalty` must be >= {MIN_DIVISOR:g}: the engines "
                                 "divide logits by it, and a smaller one overflows them. "
                                 f"Given: {self.repetition_penalty}")
        if self.do_sample and self.temperature < MIN_DIVISOR:
            raise ParameterError("temperature", f"`temperature` must be >= {MIN_DIVISOR:g} when sampling: the engines "
                                 "divide logits by it, and a smaller one overflows them (with do_sample false the "
                                 f"request decodes greedily). Given: {self.temperature}")
        for name, field in type(self).model_fields.items():
            if field.annotation is float:
                value = getattr(self, name)
                single = as_float32(value)
                if not FLOAT32_TINY <= single <= FLOAT32_MAX:
                    rule = f"at least {FLOAT32_TINY:.8g}" if single < FLOAT32_TINY else f"at most {FLOAT32_MAX:.8g}"
                    raise ParameterError(name, f"`{name}` must be {rule}: the engines compute in float32, where it "
                                               f"would be {single:g}. Given: {value}")
        return self


MediaKind = Literal["image", "video", "audio"]


class MediaRef(BaseModel):
    """One media item of a multimodal job: its bytes wait in Redis under ``key`` (see
    :func:`common.keys.media_key`), and the job's ``input_ids`` hold one placeholder token for it, in order."""

    kind: MediaKind
    key: str
    size: int = Field(ge=0, description="bytes")


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9._/-]{1,256}$"  # SPEC.md adapter_id: letters, digits, . - _ /, <= 256
ADAPTER_NAME_RULE = "1 to 256 characters of letters, digits, '.', '-', '_' or '/'"


class AdapterRef(BaseModel):
    """The LoRA adapter a job runs with: the name clients select it by, and the folder (peft's
    ``save_pretrained`` layout) a worker loads it from the first time a job names it."""

    name: str = Field(pattern=ADAPTER_NAME_PATTERN)
    path: str = Field(min_length=1)


ConstraintFormat = Literal["json_schema", "regex", "choice", "grammar"]


class Constraint(BaseModel):
    """What a request's output must match (structured outputs): the engines mask, at every step, each token
    that would leave it, so the output always fits (or is cut short by max_new_tokens). The formats are
    llguidance's (:mod:`common.constraints`), which vLLM's structured outputs take too. Frozen: hashable, so an
    engine can keep each one's compiled grammar."""

    model_config = ConfigDict(frozen=True)

    format: ConstraintFormat
    value: str = Field(description="json_schema: the schema as JSON text; regex: the pattern (Rust regex syntax); "
                                   "choice: the strings as a JSON list; grammar: a Lark or GBNF grammar")


class RequestOptions(BaseModel):
    """The request's fields that go from the client to the engines as sent: adapters map their wire fields onto
    these, and :class:`GenerationRequest` carries them to the worker with no code between."""

    decoder_input_details: bool = Field(False, description="return log-probs of the prompt tokens")
    adapter: str | None = Field(None, description="the LoRA adapter's name; None: the base model")
    priority: Priority = Field(DEFAULT_PRIORITY, description="1 (taken first) to 5 (the default); its job stream's")
    user: str | None = Field(None, description="the end user the client names (OpenAI's `user`), logged with the "
                                               "request so that an operator can follow one user's traffic")
    constraint: Constraint | None = Field(None, description="what the output must match; None: free text")

    def options(self) -> dict[str, Any]:
        """These fields as keyword arguments, for the next stage's type."""
        return {name: getattr(self, name) for name in RequestOptions.model_fields}


class GenerationRequest(RequestOptions):
    """The request, resolved: what every protocol's body becomes in the API (the prompt tokenized, every
    sampling parameter set, a seed always chosen) and, as a :class:`Job`, what a worker runs."""

    request_id: str = Field(description="the client's id, or a new one; a job's adds a nonce (see Job)")
    input_ids: list[int] = Field(min_length=1)
    params: SamplingParams

    def resolved(self) -> dict[str, Any]:
        """The resolved request's fields as keyword arguments, for the job that queues it."""
        return {name: getattr(self, name) for name in GenerationRequest.model_fields}


class Job(GenerationRequest):
    """One generation request as queued in the model's job stream: the resolved request, with where its events
    go and what the API looked up for it. Its ``request_id`` is unique to the submission (the client's id with
    a nonce), so a late event or control message of an earlier request with the same client id never applies."""

    model: str
    reply_channel: str = Field(description="pub/sub channel the worker publishes this job's events to")
    media: list[MediaRef] = Field(default_factory=list, description="the media items, in placeholder order")
    adapter_path: str | None = Field(None, min_length=1, description="the folder of the LoRA ``adapter``")
    enqueued_at: float = Field(description="unix time the API queued the job")
    deadline: float | None = Field(None, description="unix time after which nobody waits for the result")

    @model_validator(mode="after")
    def _adapter_has_a_path(self) -> Job:
        if (self.adapter is None) != (self.adapter_path is None):
            raise ValueError("a job names a LoRA adapter and its folder, or neither")
        return self

    @property
    def adapter_ref(self) -> AdapterRef | None:
        """The LoRA adapter to run with, None for the base model (a copy without its folder fails validation)."""
        return None if self.adapter is None else AdapterRef(name=self.adapter, path=self.adapter_path or "")

    def local_deadline(self) -> float:
        """The deadline on this process's monotonic clock (``math.inf`` when none).

        The wall clock is read once, where the job crosses into a process; timing against the monotonic
        clock after that keeps a wall-clock step (NTP, a VM resumed) from expiring a request early or late.
        """
        return math.inf if self.deadline is None else time.monotonic() + (self.deadline - time.time())


class TokenInfo(BaseModel):
    """One token with its decoded piece and log-probability (null only for the first prompt token)."""

    id: int
    text: str
    logprob: float | None
    special: bool


class Finish(BaseModel):
    """Sent with the last token of a request."""

    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    seed: int
    generated_text: str = Field(description="decoded output, stop sequence excluded")
    prefill: list[TokenInfo] = Field(default_factory=list)
    queue_time: float = Field(0.0, ge=0, description="seconds from queueing to the worker's prefill (two clocks)")
    inference_time: float = Field(0.0, ge=0, description="seconds from the prefill to this last token (worker clock)")


class TokenEvent(BaseModel):
    """One generated token. ``text`` is the delta to append: the deltas of a request concatenate to its
    ``generated_text`` (text that may still turn into a stop sequence is held back until it cannot)."""

    type: Literal["token"] = "token"
    index: int = Field(ge=0, description="0-based position of the token in the output")
    token: TokenInfo
    finish: Finish | None = None


class ErrorEvent(BaseModel):
    """Generation failed; no further events follow for the request."""

    type: Literal["error"] = "error"
    message: str
    error_type: str = "generation"


class WorkerStatus(BaseModel):
    """What a worker reports with each heartbeat (see :func:`common.keys.worker_status`)."""

    device: str
    batch_size: int = Field(ge=0, description="requests running")
    waiting: int = Field(ge=0, description="requests taken from the stream, not yet admitted")
    kv_reserved_tokens: int = Field(ge=0, description="KV budget held by the running requests")
    kv_budget_tokens: int = Field(gt=0, description="maxBatchTotalTokens")
    max_batch_size: int = Field(
        0, ge=0, description="maxBatchSize, the requests it may run at once; 0: not reported (an older worker)"
    )


class Control(BaseModel):
    """Sent by an API pod to the model's workers. ``cancel``: the client left, drop the request silently;
    ``stop``: end it at its next token with finish_reason ``stop_sequence`` (Triton/MindIE stopInfer);
    ``unload_adapter``: free the LoRA adapter named ``request_id`` once no running request uses it;
    ``queued``: a job was just queued (a worker with room looks for it now instead of every step)."""

    request_id: str = Field(description="the request; for unload_adapter, the adapter's name")
    action: Literal["cancel", "stop", "unload_adapter", "queued"]


Event = Annotated[TokenEvent | ErrorEvent, Field(discriminator="type")]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def decode_event(raw: bytes | str) -> TokenEvent | ErrorEvent:
    """Parse one pub/sub payload."""
    return EVENT_ADAPTER.validate_json(raw)
