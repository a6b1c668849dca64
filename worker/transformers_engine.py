"""The built-in engine: continuous batching written here over any Hugging Face causal LM (transformers 5).

Each :meth:`Engine.step` admits queued jobs (one left-padded prefill pass, bounded by the prefill limits),
runs one decode pass over the requests already running, merges the newcomers into the running batch and
drops the requests that finished, so requests join and leave between any two tokens. Memory is bounded by
reservation: a request holds ``prompt + max_new_tokens`` cache tokens for its lifetime and is only admitted
while the sum over running requests stays within ``max_batch_total_tokens``.

LoRA adapters (peft) join the same batch: the first job that names one wraps the model in a ``PeftModel``,
later ones load more adapters into it, and every pass names each row's adapter (:mod:`worker.batch`), so
requests of several adapters and of the base model decode together. An adapter is freed when it is unloaded
and no added request uses it any more; with the last one the model is unwrapped again, so requests without
adapter run exactly as they do on a model that never had one.

The engine is not thread-safe: the queue loop calls every method from one thread, but
:meth:`~TransformersEngine.prepare` (a multimodal job's media made into model inputs), which it runs on its
media threads beside the steps.

A request with a constraint (structured outputs) gets an llguidance matcher of its grammar when it is added:
its row's tokens are masked and consumed by it in the sampler (:mod:`worker.sampling`), from the first token
the prefill chooses on; once its output is complete the grammar allows nothing but EOS, which ends it. The
grammar's text is compiled once per distinct constraint (the engine keeps the last ones: clients send the same
few schemas again and again), and a matcher from it is cheap.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer
from peft import PeftModel
from peft.functional import delete_adapter
from peft.tuners.tuners_utils import BaseTuner
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TokenizersBackend,
)

from common.constraints import grammar
from common.model_files import ModelUnavailable, model_file
from common.protocol import AdapterRef, Constraint, ErrorEvent, Job, TokenEvent
from common.settings import Settings
from worker import lora
from worker.attention import use_padded_attention
from worker.batch import BASE_ADAPTER, DecodeBatch, ForwardArgs
from worker.cpu_linear import use_packed_linear
from worker.detokenizer import make_decoder
from worker.engine import (
    AdapterSet,
    Engine,
    EngineLoadError,
    PreparedJob,
    RequestRefused,
    RequestState,
    StepOutput,
    enqueue,
    eos_token_ids,
    limits_refusal,
    new_request_state,
    prompt_details,
)
from worker.media import MediaProcessor, concatenate

log = logging.getLogger("ferry.engine")
GRAMMARS_KEPT = 64  # distinct constraints whose compiled grammars an engine keeps


class TransformersEngine(Engine):
    """Runs many generation requests as one batch; see the module docstring."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings,
                 media: MediaProcessor | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.media = media  # a multimodal model's processor; None: the model takes text only
        self._decode = make_decoder(tokenizer)
        self._eos_ids = eos_token_ids(getattr(model, "generation_config", None), model.config)
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        text_config = model.config.get_text_config(decoder=True)
        self._vocab_size = text_config.vocab_size
        self._forward = ForwardArgs.of(model)
        self._grammars = lru_cache(maxsize=GRAMMARS_KEPT)(grammar)  # each constraint's llguidance grammar text
        if settings.compile_model and self._forward.step is not None:
            self._forward.step.compile_behind()
        limits = [settings.max_seq_len, settings.max_batch_total_tokens]
        if getattr(text_config, "max_position_embeddings", None):
            limits.append(text_config.max_position_embeddings)
        self.max_total_tokens = min(limits)  # prompt + generated of one request
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []  # row order of self._batch
        self._batch: DecodeBatch | None = None
        self._cancelled: set[str] = set()
        self._stopping: set[str] = set()
        # LoRA adapters: the wrapped model (None until the first adapter and after the last one is freed),
        # and which adapters are loaded and used by added (queued or running) requests.
        self._peft: PeftModel | None = None
        self.adapters = AdapterSet(self._load_adapter, self._free_adapter)

    @property
    def compiled(self) -> bool:
        """Once the compile behind the served passes is done (:meth:`worker.llama_step.LlamaStep.compile_behind`)."""
        return self._forward.step is not None and self._forward.step.compiled is not None

    @classmethod
    def load(cls, settings: Settings) -> TransformersEngine:
        """Load the model and tokenizer of ``settings.resolved_model_path`` (a folder or a Hugging Face id) onto
        ``settings.device``. The device and the model's config are checked first, so that a wrong setting
        costs a second and one line, not a model load and a traceback."""
        path, remote, device = settings.resolved_model_path, settings.trust_remote_code, settings.device
        kind = device.split(":", 1)[0]
        if kind == "npu":
            try:
                import torch_npu  # noqa: F401  (registers the npu device with torch)
            except ImportError:
                raise EngineLoadError(f"device {device} is not available: torch_npu is not installed") from None
        if kind != "cpu":
            backend = getattr(torch, kind)
            try:
                index = torch.device(device).index or 0
            except RuntimeError as exc:
                raise EngineLoadError(f"device {device} is not valid: {exc}") from None
            if not backend.is_available():
                built = kind != "cuda" or torch.version.cuda is not None
                raise EngineLoadError(f"device {device} is not available: "
                                      + (f"no {kind} device is visible" if built else "torch was built without CUDA"))
            if index >= backend.device_count():
                raise EngineLoadError(f"device {device} is not available: {backend.device_count()} {kind} devices "
                                      "are visible")
        try:
            model_file(path, "config.json")
        except ModelUnavailable as exc:
            raise EngineLoadError(str(exc)) from None
        log.info("loading the model at %s (dtype %s, device %s)", path, settings.dtype, device)
        started = time.monotonic()
        dtype = settings.dtype if settings.dtype == "auto" else getattr(torch, settings.dtype)
        try:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=remote)
            media = MediaProcessor.load(path, config, remote, settings.max_image_pixels)
            # A vision-language model (its config declares an image token) loads as image-text-to-text.
            auto_class = AutoModelForCausalLM if media is None else AutoModelForImageTextToText
            model = auto_class.from_pretrained(str(path), config=config, dtype=dtype, trust_remote_code=remote)
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=remote)
        except (OSError, ValueError, ImportError) as exc:
            raise EngineLoadError.for_model(path, exc) from None
        try:
            # transformers declares PreTrainedModel.to as functools.wraps(torch.nn.Module.to), whose stub (_Wrapped)
            # mypy does not bind to the instance: it takes the device for `self`
            model.to(torch.device(device)).eval()  # type: ignore[arg-type]
        except RuntimeError as exc:  # out of device memory, most likely
            raise EngineLoadError.for_model(path, exc, f"cannot move the model to {device}") from None
        use_padded_attention(model)
        use_packed_linear(model)
        log.info("loaded the model at %s in %.1f s (dtype %s, device %s)", path, time.monotonic() - started,
                 str(model.dtype).removeprefix("torch."), device)
        return cls(model, tokenizer, settings, media)

    def close(self) -> None:
        """End a compile still running behind the served passes (:meth:`worker.llama_step.LlamaStep.cancel_compile`)."""
        if self._forward.step is not None:
            self._forward.step.cancel_compile()

    # -- admission ---------------------------------------------------------------------------------

    def refusal(self, job: Job) -> str | None:
        """The shared limits (the length cap includes the KV budget here), and a prompt one prefill pass
        can take."""
        if len(job.input_ids) > self.settings.max_prefill_tokens:
            return f"{len(job.input_ids)} prompt tokens exceed maxPrefillTokens ({self.settings.max_prefill_tokens})"
        return limits_refusal(job, self.max_total_tokens, self._vocab_size)

    def room(self) -> int:
        """The batch slots running plus queued requests leave, no more than the next prefill pass takes, and
        none once they hold the whole KV budget (a queued job that does not fit yet exhausts it by itself, so
        nothing is taken past it)."""
        settings = self.settings
        sequences = [*self._running, *self._waiting]
        if sum(seq.reserved_tokens for seq in sequences) >= settings.max_batch_total_tokens:
            return 0
        room = settings.max_batch_size - len(sequences)
        return max(0, min(room, settings.max_prefill_batch_size - len(self._waiting)))

    def prepare(self, job: Job, media: Sequence[bytes]) -> PreparedJob:
        """The prompt expanded by the model's processor (:mod:`worker.media`), which is what the job's limits then
        apply to, and its tensors on the model's device. Reads only the processor, the settings and the model's
        device and dtype, so it runs beside :meth:`step`."""
        if self.media is None:
            return super().prepare(job, media)
        inputs = self.media.expand(job, media)
        job = job.model_copy(update={"input_ids": inputs.input_ids})
        if (reason := self.refusal(job)) is not None:
            raise RequestRefused(f"with its media expanded, {reason}")
        model = self.model
        return PreparedJob(job, {name: value.to(model.device, model.dtype if value.is_floating_point() else None)
                                 for name, value in inputs.tensors.items()})

    def add(self, job: Job | PreparedJob) -> None:
        """Queue a job for admission at a following step; one with an adapter after loading it if need be
        (:class:`worker.engine.AdapterSet`)."""
        inputs: dict[str, torch.Tensor] = {}
        if isinstance(job, PreparedJob):
            inputs = dict(job.inputs)
            job = job.job
        elif job.media:
            raise ValueError(f"request {job.request_id} holds media: prepare it first")
        elif (reason := self.refusal(job)) is not None:
            raise ValueError(f"request {job.request_id}: {reason}")
        if self._knows(job.request_id):
            raise ValueError(f"request {job.request_id} is already queued or running")
        state = new_request_state(job, self._decode, self.max_total_tokens)
        state.extra_inputs = inputs
        if job.constraint is not None:
            state.matcher = self._matcher(job.constraint)
        if (adapter := job.adapter_ref) is not None:
            self.adapters.acquire(adapter)
        enqueue(self._waiting, state, lambda seq: seq.job.priority)

    def _matcher(self, constraint: Constraint) -> LLMatcher:
        """A new matcher of the constraint's grammar; raises :class:`RequestRefused` when it does not compile or
        llguidance cannot read the model's tokenizer."""
        try:
            matcher = LLMatcher(self._grammar_tokenizer, self._grammars(constraint))
        except ValueError as exc:  # ConstraintError, or a tokenizer llguidance cannot read
            raise RequestRefused(f"the {constraint.format} constraint cannot be enforced: {exc}") from None
        if matcher.is_error():
            raise RequestRefused(f"the {constraint.format} constraint cannot be enforced: {matcher.get_error()}")
        return matcher

    @cached_property
    def _grammar_tokenizer(self) -> LLTokenizer:
        """The model's tokenizer as llguidance reads it, made once, by the first constrained request (about a
        second for a large vocabulary). Its vocabulary is the logits' width, so its masks cover the padding
        rows too; its EOS ids are the engine's, so a grammar allows them where the output may end."""
        if not isinstance(self.tokenizer, TokenizersBackend):  # llguidance reads a fast tokenizer's Rust one
            raise ValueError(f"llguidance reads fast tokenizers only, not {type(self.tokenizer).__name__}")
        return from_tokenizer(self.tokenizer, n_vocab=self._vocab_size, eos_token=sorted(self._eos_ids) or None)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued or running request at the next step (it gets no further event)."""
        known = self._knows(request_id)
        if known:
            self._cancelled.add(request_id)
        return known

    def stop(self, request_id: str) -> bool:
        """End a queued or running request at its next token, with finish_reason ``stop_sequence`` (TGI's
        reason for a stopped request); unlike :meth:`cancel` its client still gets a complete answer."""
        known = self._knows(request_id)
        if known:
            self._stopping.add(request_id)
        return known

    # -- adapters ----------------------------------------------------------------------------------

    @property
    def _runner(self) -> PreTrainedModel | PeftModel:
        """The model every pass calls: the wrapped one while adapters are loaded."""
        return self.model if self._peft is None else self._peft

    def _load_adapter(self, adapter: AdapterRef) -> None:
        """Load the adapter onto the model's device, wrapping the model for the first one. Raises
        :class:`RequestRefused` for a folder that holds no LoRA adapter for a causal LM, or one peft cannot load
        into this model (weights shaped for another model, most often); the model is then left as it was."""
        name, path = adapter.name, adapter.path
        modules = dict(self.model.named_modules())
        try:
            if name == BASE_ADAPTER:  # peft's name for rows without adapter: it would silently run the base model
                raise ValueError("the name is reserved")
            config = lora.read_config(path)
            if config.use_dora:  # peft's mixed-batch forward refuses DoRA
                raise ValueError("DoRA adapters cannot share a batch with other requests here")
            device = str(self.model.device)
            if self._peft is None:
                if self._forward.step is not None:  # peft replaces the layers a running compile traces
                    self._forward.step.wait_compiled()
                self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, config=config,
                                                       torch_device=device)
            else:
                self._peft.load_adapter(path, adapter_name=name, torch_device=device)
        except Exception as exc:  # peft and torch raise many kinds: each means this adapter cannot be used here
            self._undo_load(name, modules)
            refused = lora.refusal(adapter, exc)
            log.warning("%s", refused)
            raise refused from None
        log.info("loaded adapter %s from %s", name, path)

    def _undo_load(self, name: str, modules: dict[str, torch.nn.Module]) -> None:
        """Take back whatever a failed load of ``name`` did: peft can fail half-way, after it replaced some of
        the layers in ``modules`` (the model's modules before the load) with adapter layers, or added the
        adapter's weights to layers that loaded adapters share."""
        for key, module in modules.items():
            if key and self.model.get_submodule(key) is not module:
                self.model.set_submodule(key, module)
        if self._peft is None:
            vars(self.model).pop("peft_config", None)  # what PeftModel sets on the model it wraps
        else:
            self._peft.peft_config.pop(name, None)
            tuner = self._peft.base_model
            assert isinstance(tuner, BaseTuner)  # a LoRA model (peft's declared type is any torch Module)
            delete_adapter(self.model, name, prefix=tuner.prefix)

    def _free_adapter(self, name: str) -> None:
        """Delete an adapter no added request uses; unwrap the model when it was the last one."""
        assert self._peft is not None  # an adapter is loaded
        if self.adapters.loaded:  # others remain
            self._peft.delete_adapter(name)
        else:
            self._peft.unload()  # every adapter layer gives back the model's own layer
            self._peft = None
        log.info("freed adapter %s", name)

    def _release(self, sequences: Iterable[RequestState]) -> None:
        """The requests left the engine (finished, cancelled or dropped): an adapter waiting to be unloaded
        goes with its last one."""
        for seq in sequences:
            if seq.job.adapter is not None:
                self.adapters.release(seq.job.adapter)

    def _knows(self, request_id: str) -> bool:
        return any(seq.job.request_id == request_id for seq in (*self._running, *self._waiting))

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def reserved_tokens(self) -> int:
        """KV budget held by the running requests (what ``max_batch_total_tokens`` bounds)."""
        return sum(seq.reserved_tokens for seq in self._running)

    @property
    def kv_budget_tokens(self) -> int:
        return self.settings.max_batch_total_tokens

    # -- stepping ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit, prefill and merge queued jobs, run one decode step for the requests already running and
        return one output per request that got a token. If a forward pass raises, the requests that were
        in it are dropped and the exception propagates."""
        self._drop_cancelled()
        outputs: list[StepOutput] = []
        joining = self._prefill(self._admit(), outputs)
        if self._batch is not None:
            try:
                ids, logprobs = self._batch.decode(self._runner, self._forward)
            except Exception:
                self._release(self._running)
                self._running, self._batch = [], None
                raise
            self._running, self._batch = self._advance(self._running, self._batch, ids, logprobs, outputs)
        if joining is not None:
            sequences, batch = joining
            if self._batch is None:
                self._running, self._batch = sequences, batch
            else:
                self._batch.merge(batch)
                self._running.extend(sequences)
        return outputs

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, set()
        self._stopping -= cancelled
        self._release(seq for seq in (*self._waiting, *self._running) if seq.job.request_id in cancelled)
        self._waiting = deque(seq for seq in self._waiting if seq.job.request_id not in cancelled)
        keep = [row for row, seq in enumerate(self._running) if seq.job.request_id not in cancelled]
        self._running, self._batch = self._select(self._running, self._batch, keep)

    def _admit(self) -> list[RequestState]:
        """Pop queued jobs, the most urgent first (first come first served within a priority), while the batch,
        KV budget and prefill limits allow."""
        settings = self.settings
        admitted: list[RequestState] = []
        reserved = self.reserved_tokens
        width = 0
        while self._waiting:
            seq = self._waiting[0]
            new_width = max(width, seq.prompt_len)
            if (
                len(self._running) + len(admitted) >= settings.max_batch_size
                or reserved + seq.reserved_tokens > settings.max_batch_total_tokens
                or len(admitted) >= settings.max_prefill_batch_size
                or (len(admitted) + 1) * new_width > settings.max_prefill_tokens
            ):
                break
            admitted.append(self._waiting.popleft())
            seq.started_at = time.time()
            reserved += seq.reserved_tokens
            width = new_width
        return admitted

    def _prefill(
        self, sequences: list[RequestState], outputs: list[StepOutput]
    ) -> tuple[list[RequestState], DecodeBatch] | None:
        """Prefill the admitted sequences, emit their first tokens; return those still running."""
        if not sequences:
            return None
        jobs = [seq.job for seq in sequences]
        try:
            batch, ids, logprobs, prompt_logprobs = DecodeBatch.prefill(
                self._runner,
                [job.input_ids for job in jobs],
                [job.params for job in jobs],
                self._pad_id,
                [job.decoder_input_details for job in jobs],
                self._forward,
                [job.adapter for job in jobs],
                concatenate([seq.extra_inputs for seq in sequences]),
                [seq.matcher for seq in sequences],
            )
        except Exception:
            self._release(sequences)
            raise
        for seq in sequences:
            seq.extra_inputs = {}  # the features are in the cache now
        for seq, scores in zip(sequences, prompt_logprobs, strict=True):
            if scores is not None:
                seq.prefill = prompt_details(self.tokenizer, seq.job.input_ids, scores, self._special_ids)
        sequences, running = self._advance(sequences, batch, ids, logprobs, outputs)
        return None if running is None else (sequences, running)

    def _advance(
        self,
        sequences: list[RequestState],
        batch: DecodeBatch,
        ids: torch.Tensor,
        logprobs: torch.Tensor,
        outputs: list[StepOutput],
    ) -> tuple[list[RequestState], DecodeBatch | None]:
        """Turn each row's new token into an event; return the rows that keep running."""
        keep: list[int] = []
        for row, (seq, token, logprob) in enumerate(zip(sequences, ids.tolist(), logprobs.tolist(), strict=True)):
            try:
                event: TokenEvent | ErrorEvent = self._token_event(seq, token, logprob)
            except Exception as exc:  # this request's text handling failed; the others go on
                log.exception("request failed", extra={"request_id": seq.job.request_id})
                event = ErrorEvent(message=f"generation failed: {exc}")
            output = StepOutput(seq.job, event)
            outputs.append(output)
            if output.finished:
                self._stopping.discard(seq.job.request_id)
                self._release([seq])
            else:
                keep.append(row)
        return self._select(sequences, batch, keep)

    @staticmethod
    def _select(
        sequences: list[RequestState], batch: DecodeBatch | None, keep: list[int]
    ) -> tuple[list[RequestState], DecodeBatch | None]:
        """Keep the rows ``keep`` of a batch (None once no row is left)."""
        if batch is None or len(keep) == len(sequences):
            return sequences, batch
        if not keep:
            return [], None
        batch.filter(keep)
        return [sequences[row] for row in keep], batch

    def _token_event(self, seq: RequestState, token: int, logprob: float) -> TokenEvent:
        """The token's event; raises when the request's grammar failed (a resource limit, a token it refused)."""
        event = seq.token_event(
            token, logprob, stopping=seq.request_id in self._stopping, eos=token in self._eos_ids,
            special=token in self._special_ids,
        )
        if seq.matcher is not None and seq.matcher.is_error():
            raise RuntimeError(f"the request's constraint failed: {seq.matcher.get_error()}")
        return event


ENGINE = TransformersEngine
