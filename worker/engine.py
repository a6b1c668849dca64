"""The engine contract: what the queue loop (:mod:`worker.main`) asks of whichever engine runs the model.

The loop only admits jobs (a multimodal job's media prepared beside its steps), steps, cancels, stops and
reads capacity and state; it never knows which engine it drives. Two engines implement :class:`Engine`, each
in its own module, chosen by ``Settings.engine`` (``--engine``, env ``ENGINE``, config ``BackendConfig.engine``):

- ``transformers`` (:mod:`worker.transformers_engine`): continuous batching written here over any Hugging
  Face causal LM, on CPU, CUDA or NPU;
- ``vllm`` (:mod:`worker.vllm_engine`): vLLM's engine (paged KV, prefix cache, CUDA graphs), for accelerator
  throughput.

What both share lives here too, so the two produce the same events for the same tokens: the per-request
record (:class:`RequestState`), the text side (UTF-8-safe deltas, stop strings held back and excluded) and
the rule that decides when a request ends and why (:meth:`RequestState.token_event`, which applies the
request's ``stop_token_ids`` and ``ignore_eos`` too). A request's constraint (structured outputs) each engine
enforces its own way: the built-in engine with llguidance's matchers (:mod:`worker.sampling`), the vLLM engine
with vLLM's structured outputs.
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from common.protocol import AdapterRef, ErrorEvent, Finish, FinishReason, Job, TokenEvent, TokenInfo
from common.settings import EngineName, Settings
from worker.detokenizer import Decode, TextStream

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase

ENGINE_MODULES: dict[EngineName, str] = {
    "transformers": "worker.transformers_engine",
    "vllm": "worker.vllm_engine",
}


class EngineLoadError(RuntimeError):
    """The engine cannot serve this model here (a missing package, an unsupported model or device); the
    message says which, in one line, so the worker can exit with it."""

    @classmethod
    def for_model(cls, path: object, exc: BaseException, what: str = "cannot load the model") -> EngineLoadError:
        return cls(f"{what} at {path}: {' '.join(str(exc).split())}")


class RequestRefused(ValueError):
    """A job an engine refuses only when it is added: its media cannot be read, the prompt they expand to
    leaves the limits, or its LoRA adapter cannot be loaded. The message says why; the client gets it as a
    validation error."""


class AdapterSet:
    """The LoRA adapters one engine holds and how many added requests use each, the bookkeeping both engines
    share: an adapter is loaded the first time a job names it, loaded anew when its name comes back with
    another folder and no request uses the old weights, and freed after an unload once its last request has
    ended. ``load`` loads one into the engine (raising :class:`RequestRefused`, with nothing loaded, when it
    cannot); ``free`` frees one by name."""

    def __init__(self, load: Callable[[AdapterRef], None], free: Callable[[str], None]) -> None:
        self._load = load
        self._free = free
        self.loaded: dict[str, AdapterRef] = {}
        self._users: Counter[str] = Counter()
        self._unloading: set[str] = set()

    def acquire(self, ref: AdapterRef) -> None:
        """Make ``ref`` usable by one more request, loading it if need be; raises :class:`RequestRefused`."""
        current = self.loaded.get(ref.name)
        if current is not None and current.path != ref.path:
            if self._users[ref.name]:
                raise RequestRefused(f"the LoRA adapter `{ref.name}` now names the folder {ref.path}, but running "
                                     f"requests still use its weights from {current.path}; retry when they end")
            self._drop(ref.name)
            current = None
        if current is None:
            self._load(ref)
            self.loaded[ref.name] = ref
        self._unloading.discard(ref.name)
        self._users[ref.name] += 1

    def release(self, name: str) -> None:
        """One request that used the adapter ``name`` ended (finished, stopped, cancelled or failed)."""
        self._users[name] -= 1
        if self._users[name] <= 0:
            del self._users[name]
            if name in self._unloading:
                self._drop(name)

    def unload(self, name: str) -> None:
        """Free the adapter now if no request uses it, else once its last one ends."""
        if name in self.loaded:
            if self._users[name]:
                self._unloading.add(name)
            else:
                self._drop(name)

    def _drop(self, name: str) -> None:
        self._unloading.discard(name)
        del self.loaded[name]
        self._free(name)


@dataclass(frozen=True)
class PreparedJob:
    """A job with media as :meth:`Engine.prepare` made it: its prompt with every placeholder expanded into the
    item's feature tokens, and what its prefill passes to the model beside the ids (e.g. ``pixel_values``)."""

    job: Job
    inputs: Mapping[str, Any]


@dataclass(frozen=True)
class StepOutput:
    """One event for one request. ``event`` is an :class:`ErrorEvent` when this request alone failed."""

    job: Job
    event: TokenEvent | ErrorEvent

    @property
    def finished(self) -> bool:
        """True on the request's last event (it has left the engine)."""
        return isinstance(self.event, ErrorEvent) or self.event.finish is not None


@dataclass
class RequestState:
    """Engine-side state of one request, the same in every engine."""

    job: Job
    stream: TextStream
    max_new_tokens: int  # the request's own limit, lowered to fit the total length cap
    stop_ids: frozenset[int] = frozenset()  # the request's stop_token_ids

    prefill: list[TokenInfo] = field(default_factory=list)
    # What the prefill passes to the model beside the ids: a multimodal job's tensors (e.g. pixel_values).
    extra_inputs: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0  # unix time of admission (the prefill), for the request's queue and inference times
    # The built-in engine's state of a constrained request's grammar (worker/sampling.py); None: free text.
    matcher: LLMatcher | None = None

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.job.input_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache tokens this request may grow to."""
        return self.prompt_len + self.max_new_tokens

    def token_event(self, token: int, logprob: float, *, stopping: bool, eos: bool, special: bool) -> TokenEvent:
        """Record one generated token and decide whether the request ends with it: a stop string it
        completes, one of its stop token ids or a stop order (``stopping``) end it as ``stop_sequence``, then
        EOS (unless the request ignores it and has no constraint: a grammar allows EOS only once the output is
        complete, and nothing but EOS after it), then its length. A non-finite ``logprob`` means the request's
        numbers went bad (NaN or infinite logits, no token left to choose): that raises, so the engine fails
        this request alone while the rest of its batch goes on."""
        if not math.isfinite(logprob):
            raise ArithmeticError(f"the request's logits or probabilities became NaN or infinite at output token "
                                  f"{len(self.stream.ids)} (logprob {logprob})")
        text, stopped = self.stream.push(token)
        generated = len(self.stream.ids)
        reason: FinishReason | None = None
        if stopped or stopping or token in self.stop_ids:
            reason = "stop_sequence"
        elif eos and (not self.job.params.ignore_eos or self.job.constraint is not None):
            reason = "eos_token"
        elif generated >= self.max_new_tokens:
            reason = "length"
        finish = None
        if reason is not None:
            if not stopped:
                rest, stopped = self.stream.finish()
                text += rest
                reason = "stop_sequence" if stopped else reason
            finish = Finish(
                finish_reason=reason,
                generated_tokens=generated,
                prompt_tokens=self.prompt_len,
                seed=self.job.params.seed,
                generated_text=self.stream.text,
                prefill=self.prefill,
                queue_time=max(0.0, self.started_at - self.job.enqueued_at),
                inference_time=time.time() - self.started_at,
            )
        info = TokenInfo(id=token, text=text, logprob=logprob, special=special)
        return TokenEvent(index=generated - 1, token=info, finish=finish)


def new_request_state(job: Job, decode: Decode, max_total_tokens: int) -> RequestState:
    """The state of a newly added job, its output limit lowered so prompt + output fit ``max_total_tokens``."""
    max_new = min(job.params.max_new_tokens, max_total_tokens - len(job.input_ids))
    return RequestState(job, TextStream(decode, job.params.stop), max_new, frozenset(job.params.stop_token_ids))


T = TypeVar("T")


def enqueue(waiting: deque[T], item: T, priority: Callable[[T], int]) -> None:
    """Queue ``item`` behind every waiting item as urgent as it or more: the jobs an engine holds before they run
    start in the order workers take them from the job streams (a lower priority first, then first come)."""
    index = len(waiting)
    while index and priority(waiting[index - 1]) > priority(item):
        index -= 1
    waiting.insert(index, item)


def limits_refusal(job: Job, max_total_tokens: int, vocab_size: int) -> str | None:
    """What every engine checks: room for the prompt plus one token, and token ids inside the vocabulary."""
    prompt_len = len(job.input_ids)
    if prompt_len + 1 > max_total_tokens:
        return f"{prompt_len} prompt tokens leave no room to generate within this worker's {max_total_tokens} tokens"
    unknown = next((token for token in job.input_ids if not 0 <= token < vocab_size), None)
    if unknown is not None:
        return f"token id {unknown} is not in the model's vocabulary of {vocab_size}"
    return None


def eos_token_ids(*sources: object) -> frozenset[int]:
    """Every EOS id declared by the given configs (a model's generation config and config; each an int, a
    list or unset)."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


def prompt_details(
    tokenizer: PreTrainedTokenizerBase,
    input_ids: list[int],
    logprobs: Sequence[float | None],
    special_ids: frozenset[int],
) -> list[TokenInfo]:
    """``decoder_input_details``: each prompt token with its text and the logprob the model gave it (the
    first token has none, so ``logprobs`` holds one fewer)."""
    texts = tokenizer.batch_decode([[token] for token in input_ids], skip_special_tokens=False)
    return [
        TokenInfo(id=token, text=text, logprob=logprob, special=token in special_ids)
        for token, text, logprob in zip(input_ids, texts, [None, *logprobs], strict=True)
    ]


class Engine(ABC):
    """One model on one device, running many requests at once. Not thread-safe: the queue loop calls every
    method from one thread, but for :meth:`prepare`. A request gets one :class:`StepOutput` per generated token
    from :meth:`step`, the last one finished; a cancelled request gets nothing more."""

    #: prompt + generated tokens of one request, at most
    max_total_tokens: int

    @classmethod
    @abstractmethod
    def load(cls, settings: Settings) -> Engine:
        """Load the model of ``settings``; raises :class:`EngineLoadError` when it cannot serve it here."""

    @abstractmethod
    def refusal(self, job: Job) -> str | None:
        """Why the job can never run here (a prompt past the limits, a token id the model lacks, a parameter
        this engine cannot apply), or None when it can."""

    @abstractmethod
    def room(self) -> int:
        """How many more jobs to hand over now: those that could start at the next steps without waiting
        behind the ones already added (0: none). The worker reads up to that many from a job stream at once, so
        jobs that came together start together, and leaves the rest in the streams for any worker of the pool."""

    def prepare(self, job: Job, media: Sequence[bytes]) -> PreparedJob:
        """Make a job's media into the model's inputs (``media[i]`` holds the bytes of ``job.media[i]``): the
        slow part of admitting a multimodal job (decoding, the model's processor). Unlike the other methods it
        is thread-safe and changes no engine state: the queue loop runs it on its media threads while it steps,
        so an image being decoded never stalls the running requests. Raises :class:`RequestRefused` for media
        the engine cannot take, or a prompt they expand past the limits (the :meth:`refusal` of the
        placeholder prompt is only a lower bound). This default takes no media."""
        raise RequestRefused("the served model takes no media input")

    @abstractmethod
    def add(self, job: Job | PreparedJob) -> None:
        """Queue a job (one without a :meth:`refusal`, and not known already) for the following steps: one
        with media as :meth:`prepare` made it. A job with an :attr:`~common.protocol.Job.adapter` runs with
        that LoRA adapter, loaded from its folder the first time its name is seen (again when the name comes
        back with another folder and no running request uses the old one). Raises :class:`RequestRefused` for
        an adapter that cannot be loaded or used here."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Free the LoRA adapter ``name`` once no added request uses it (at once when none does); nothing if
        it is not loaded. A later job naming it loads it again."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Drop a queued or running request (it gets no further event); False if it is unknown."""

    @abstractmethod
    def stop(self, request_id: str) -> bool:
        """End a queued or running request at its next token with finish_reason ``stop_sequence`` (its
        client still gets a complete answer); False if it is unknown."""

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """Run one iteration; return an output per request that got a token. If the model itself fails, the
        requests in the failed pass are dropped and the exception propagates."""

    @property
    @abstractmethod
    def idle(self) -> bool:
        """No request is queued or running."""

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """Requests running (prefilled)."""

    @property
    @abstractmethod
    def waiting(self) -> int:
        """Requests added and not yet running."""

    @property
    @abstractmethod
    def reserved_tokens(self) -> int:
        """KV-cache tokens the running requests hold or have reserved."""

    @property
    @abstractmethod
    def kv_budget_tokens(self) -> int:
        """KV-cache tokens this engine has for all requests together."""

    @property
    def compiled(self) -> bool:
        """Whether the model's passes run compiled now (an engine may serve eagerly while it compiles)."""
        return False

    def close(self) -> None:  # noqa: B027 - a hook: an engine holding nothing outside this process keeps it
        """Release what the engine holds outside this process (engine processes, devices)."""


def load_engine(settings: Settings) -> Engine:
    """The engine ``settings.engine`` names, loaded with the model of ``settings``. Each engine's module is
    imported here, on demand: a worker of one engine never needs the other's packages."""
    try:
        module = importlib.import_module(ENGINE_MODULES[settings.engine])
    except ImportError as exc:
        raise EngineLoadError(
            f"the {settings.engine} engine cannot be imported ({exc}); README \"Engines\" says how to install it"
        ) from None
    engine_class: type[Engine] = module.ENGINE
    return engine_class.load(settings)
