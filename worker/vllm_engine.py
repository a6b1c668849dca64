"""The vLLM engine: vLLM's scheduler, paged KV cache and kernels behind the worker's engine contract.

It drives vLLM's synchronous ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``), which maps one to
one onto the contract's add / step / cancel, so the worker's queue loop stays single-threaded and does not
change. ``LLMEngine`` runs vLLM's ``EngineCore`` in its own process, as vLLM's OpenAI server does: the core
keeps computing while this process publishes the last step's tokens to Redis, and :meth:`step` returns the
outputs the core has ready. (The async engine client would need an event loop in a worker whose loop is
synchronous by design; the core client alone would mean re-implementing vLLM's input and output processing.)

What this engine leaves to vLLM and what it keeps, so both engines answer the same request alike:

- vLLM chooses tokens: greedy (``do_sample`` false) is temperature 0; seeded per request (``seed``), top-k/p
  and the repetition penalty as vLLM defines them; logprobs are those of the distribution sampled from
  (``logprobs_mode=processed_logprobs``), prompt logprobs for ``decoder_input_details``. vLLM has no
  typical sampling: ``typical_p`` is accepted and not applied (SPEC.md lists it so; README "API examples").
- Ferry keeps the text: vLLM returns token ids only (``detokenize=False``); the shared
  :class:`worker.engine.RequestState` makes the UTF-8-safe deltas, holds back and excludes stop strings and
  decides the finish reason. EOS is the model's generation-config EOS set, given to vLLM as stop token ids
  (with ``ignore_eos``) so both engines stop on the same tokens, with the request's own ``stop_token_ids``
  (and without the EOS set when the request has ``ignore_eos``); a stop string or a stopInfer order aborts
  the vLLM request at once.
- A request whose numbers go bad (a NaN logprob: NaN or infinite logits) ends with an error of its own
  (:meth:`worker.engine.RequestState.token_event`) and is aborted; vLLM itself would sample such a row on (the
  argmax of its NaN or infinite logits, a valid id) beside the others, unaffected. Parameters vLLM's
  ``SamplingParams`` refuses (a temperature above 2) are refused when the job is added.
- Priority decides which queued jobs the worker takes (and hands vLLM) first; vLLM schedules the requests it
  holds with its default policy, first come first served.
- A constraint (structured outputs) becomes vLLM's ``structured_outputs`` of the request, enforced by its
  ``guidance`` backend (llguidance, the dialect the API checks constraints in, :mod:`common.constraints`) unless
  ``structured_outputs_config`` in the engine arguments names another. A grammar vLLM cannot compile is refused
  when the job is added. Once the output is complete the grammar allows EOS only, which ends the request, with
  ``ignore_eos`` too (:meth:`worker.engine.RequestState.token_event`).

Engine arguments come from the settings (model, dtype, maxSeqLen, maxBatchSize, trustRemoteCode) plus
``BackendConfig.vllmEngineArgs`` (env ``VLLM_ENGINE_ARGS``, a JSON object of further ``vllm.EngineArgs``
fields, e.g. ``gpu_memory_utilization`` or ``tensor_parallel_size``). The KV cache holds ``maxBatchTotalTokens``
tokens, as the built-in engine's budget does (:func:`kv_cache_bytes`), unless vLLM's own sizing is asked for:
``gpu_memory_utilization`` or ``kv_cache_memory_bytes`` in those arguments, or ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
on CPU. Left to itself vLLM takes a fraction of the whole device, which on a CPU host fails as soon as other
processes use memory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from common.model_files import ModelUnavailable, model_file
from common.protocol import AdapterRef, Constraint, ErrorEvent, Job, TokenEvent
from common.settings import Settings
from worker import lora
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

try:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase
    from vllm import EngineArgs, RequestOutput, SamplingParams, TokensPrompt
    from vllm.config import CompilationMode, StructuredOutputsConfig
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.v1.engine.llm_engine import LLMEngine
except ImportError as exc:  # load_engine turns this into one line naming the extra to install
    raise ImportError(f"vllm is not installed ({exc.name})") from exc

log = logging.getLogger("ferry.engine.vllm")

# Where a device index goes for vLLM: it takes the first visible device of its platform.
_VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# What sizes vLLM's KV cache its own way (see the module docstring): engine arguments, then env vars.
_VLLM_KV_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")
_VLLM_KV_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
# Each constraint format's field of vLLM's StructuredOutputsParams
_STRUCTURED_OUTPUTS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_outputs(constraint: Constraint | None) -> StructuredOutputsParams | None:
    """The constraint as vLLM's structured outputs (None: free text): a schema and a choice list arrive as JSON
    text, which vLLM takes as the object and the list."""
    if constraint is None:
        return None
    value: Any = json.loads(constraint.value) if constraint.format in ("json_schema", "choice") else constraint.value
    return StructuredOutputsParams(**{_STRUCTURED_OUTPUTS[constraint.format]: value})


def kv_cache_bytes(config: PretrainedConfig, dtype: str, tokens: int) -> int:
    """The bytes of ``tokens`` positions of keys and values of every attention layer of the model of
    ``config``, in ``dtype`` (``auto``: the model's own; vLLM caches keys and values in it)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    model_dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
    element = (model_dtype if dtype == "auto" else getattr(torch, dtype)).itemsize
    return tokens * text.num_hidden_layers * 2 * kv_heads * head_dim * element


class VllmEngine(Engine):
    """The contract over a ``vllm.v1.engine.llm_engine.LLMEngine``; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: PreTrainedTokenizerBase,
        settings: Settings,
        eos_ids: frozenset[int],
    ) -> None:
        self._engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self._decode = make_decoder(tokenizer)
        self._eos_ids = eos_ids
        self._special_ids = frozenset(tokenizer.all_special_ids)
        model_config = engine.vllm_config.model_config
        self._vocab_size = model_config.get_vocab_size()
        self.max_total_tokens = min(settings.max_seq_len, model_config.max_model_len)
        cache = engine.vllm_config.cache_config
        self._kv_budget = (cache.num_gpu_blocks or 0) * cache.block_size
        self._requests: dict[str, RequestState] = {}  # added and not finished, in order of arrival
        self._hf_config = model_config.hf_config  # what adapters are checked against (worker.lora.check_fits)
        self._held: deque[str] = deque()  # added, not yet handed to vLLM (see _submit_held)
        self._separate_base = engine.vllm_config.lora_config is not None and current_platform.is_cpu()
        self._lora_ids: dict[str, int] = {}  # vLLM's id of each loaded adapter, new for each load
        self._next_lora_id = 1
        self.adapters = AdapterSet(self._load_adapter, self._free_adapter)
        self._prompt_logprobs: dict[str, list[float | None]] = {}  # decoder_input_details collected so far
        self._stopping: set[str] = set()

    @classmethod
    def load(cls, settings: Settings) -> VllmEngine:
        """vLLM's engine over the model of ``settings`` (a folder or a Hugging Face id, which vLLM resolves
        as ``from_pretrained`` does); the model's config is checked first, for one clear line when it is
        missing."""
        path = str(settings.resolved_model_path)
        remote = settings.trust_remote_code
        kind, _, index = settings.device.partition(":")
        if index and kind in _VISIBLE_DEVICES:
            os.environ.setdefault(_VISIBLE_DEVICES[kind], index)
        try:
            model_file(settings.resolved_model_path, "config.json")
        except ModelUnavailable as exc:
            raise EngineLoadError(str(exc)) from None
        log.info("loading the model at %s (dtype %s, device %s)", path, settings.dtype, settings.device)
        started = time.monotonic()
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
        except (OSError, ValueError, ImportError) as exc:
            raise EngineLoadError.for_model(path, exc) from None
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # a model folder without generation_config.json
            generation = None
        max_positions = getattr(config.get_text_config(), "max_position_embeddings", None) or settings.max_seq_len
        arguments: dict[str, Any] = {
            "model": path,
            "dtype": settings.dtype,
            "trust_remote_code": remote,
            "max_model_len": min(settings.max_seq_len, max_positions),
            "max_num_seqs": settings.max_batch_size,
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": True,
            # LoRA costs vLLM memory and speed: on when the model has adapters configured (enable_lora in
            # VLLM_ENGINE_ARGS turns it on for adapters loaded at run time only)
            "enable_lora": bool(settings.served_models[0].lora_modules),
            **settings.vllm_engine_args,
        }
        # llguidance enforces constraints, as in the built-in engine; VLLM_ENGINE_ARGS may set other fields or
        # another backend (its JSON gives an object, which EngineArgs does not convert)
        arguments["structured_outputs_config"] = StructuredOutputsConfig(
            **{"backend": "guidance", **arguments.get("structured_outputs_config", {})}
        )
        if not any(key in arguments for key in _VLLM_KV_ARGS) and not any(env in os.environ for env in _VLLM_KV_ENV):
            arguments["kv_cache_memory_bytes"] = kv_cache_bytes(config, settings.dtype, settings.max_batch_total_tokens)
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(**arguments))
        except (TypeError, ValueError, RuntimeError, OSError) as exc:
            raise EngineLoadError.for_model(path, exc, "vLLM cannot serve the model") from None
        loaded = cls(engine, tokenizer, settings, eos_token_ids(generation, config))
        log.info("loaded the model at %s in %.1f s (dtype %s, device %s); KV cache of %d tokens", path,
                 time.monotonic() - started, str(engine.vllm_config.model_config.dtype).removeprefix("torch."),
                 settings.device, loaded.kv_budget_tokens)
        return loaded

    # -- admission ---------------------------------------------------------------------------------

    def refusal(self, job: Job) -> str | None:
        return limits_refusal(job, self.max_total_tokens, self._vocab_size)

    def room(self) -> int:
        """vLLM schedules and pages the KV cache itself; the worker hands it up to maxBatchSize requests
        (vLLM's ``max_num_seqs``), so the rest wait in the job streams where any worker can take them."""
        return max(0, self.settings.max_batch_size - len(self._requests))

    def prepare(self, job: Job, media: Sequence[bytes]) -> PreparedJob:
        raise RequestRefused("the vllm engine takes no media input in this version; serve multimodal models "
                             "with the transformers engine")

    def add(self, job: Job | PreparedJob) -> None:
        if isinstance(job, PreparedJob) or job.media:  # prepare refuses every job with media
            raise ValueError("the vllm engine takes no media input")
        if (reason := self.refusal(job)) is not None:
            raise ValueError(f"request {job.request_id}: {reason}")
        if job.request_id in self._requests:
            raise ValueError(f"request {job.request_id} is already queued or running")
        state = new_request_state(job, self._decode, self.max_total_tokens)
        self._check(state)
        state.started_at = time.time()
        if (adapter := job.adapter_ref) is not None:
            self.adapters.acquire(adapter)
        self._requests[job.request_id] = state
        if job.decoder_input_details:
            self._prompt_logprobs[job.request_id] = []
        enqueue(self._held, job.request_id, lambda rid: self._requests[rid].job.priority)
        self._submit_held()

    def _check(self, state: RequestState) -> None:
        """Refuse what vLLM would refuse when the request is handed over (a held one only at a later step, whose
        failure would end every request): arguments its SamplingParams refuses when made, and a constraint its
        structured-outputs backend cannot compile, which vLLM checks when the request is added."""
        try:
            params = self._sampling_params(state)
        except Exception as exc:  # VLLMValidationError in vLLM 0.32, ValueError in older ones
            raise RequestRefused(f"vLLM cannot sample with these parameters: {exc}") from None
        if (constraint := state.job.constraint) is not None:
            config = self._engine.vllm_config
            try:
                params.verify(config.model_config, config.speculative_config, config.structured_outputs_config,
                              self._engine.tokenizer)
            except Exception as exc:  # VLLMValidationError in vLLM 0.32, ValueError in older ones
                raise RequestRefused(f"vLLM cannot enforce the {constraint.format} constraint: {exc}") from None

    def _submit_held(self) -> None:
        """Hand vLLM the requests held back, in order, while they may join its batch: on CPU, where vLLM's LoRA
        kernels give a base-model row wrong logits when it shares a batch with adapter rows (tests/
        test_lora_engine.py shows it), base and adapter requests take turns instead of sharing a batch."""
        while self._held:
            state = self._requests[self._held[0]]
            if self._separate_base and any((other.job.adapter is None) != (state.job.adapter is None)
                                           for rid, other in self._requests.items() if rid not in self._held):
                return
            self._held.popleft()
            job = state.job
            [prompt] = self._engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=job.input_ids)])
            adapter = job.adapter_ref
            lora = None if adapter is None else LoRARequest(adapter.name, self._lora_ids[adapter.name], adapter.path)
            try:
                self._engine.add_request(job.request_id, prompt, self._sampling_params(state), lora_request=lora)
            except BaseException:
                self._forget(job.request_id)
                raise

    def _sampling_params(self, state: RequestState) -> SamplingParams:
        params = state.job.params
        sampled = params.do_sample
        # vLLM stops on EOS (unless the request ignores it) and the request's stop ids, as RequestState decides
        stop_ids = state.stop_ids if params.ignore_eos else state.stop_ids | self._eos_ids
        return SamplingParams(
            temperature=params.temperature if sampled else 0.0,
            top_k=params.top_k if sampled else 0,
            top_p=params.top_p if sampled else 1.0,
            repetition_penalty=params.repetition_penalty,
            seed=params.seed if sampled else None,
            max_tokens=state.max_new_tokens,
            ignore_eos=True,
            stop_token_ids=sorted(stop_ids),
            logprobs=0,
            prompt_logprobs=0 if state.job.decoder_input_details else None,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs(state.job.constraint),
        )

    def cancel(self, request_id: str) -> bool:
        submitted = request_id not in self._held
        known = self._forget(request_id)
        if known and submitted:
            self._engine.abort_request([request_id])
        return known

    def stop(self, request_id: str) -> bool:
        known = request_id in self._requests
        if known:
            self._stopping.add(request_id)
        return known

    def _forget(self, request_id: str) -> bool:
        if request_id in self._held:
            self._held.remove(request_id)
        self._stopping.discard(request_id)
        self._prompt_logprobs.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is not None and state.job.adapter is not None:
            self.adapters.release(state.job.adapter)
        return state is not None

    # -- LoRA adapters -------------------------------------------------------------------------------

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def _load_adapter(self, ref: AdapterRef) -> None:
        if self._engine.vllm_config.lora_config is None:
            raise RequestRefused(f"this vllm worker runs without LoRA, so it cannot load the adapter `{ref.name}`: "
                                 "configure the model's loraModules, or set VLLM_ENGINE_ARGS {\"enable_lora\": true}")
        lora_id = self._next_lora_id
        try:
            lora.check_fits(ref.path, self._hf_config)  # vLLM would load some adapters that do not fit
            self._engine.add_lora(LoRARequest(ref.name, lora_id, ref.path))
        except Exception as exc:  # peft and vLLM raise what the adapter's files or shapes make them raise
            refused = lora.refusal(ref, exc)
            log.warning("%s", refused)
            raise refused from None
        self._next_lora_id += 1
        self._lora_ids[ref.name] = lora_id

    def _free_adapter(self, name: str) -> None:
        self._engine.remove_lora(self._lora_ids.pop(name))

    # -- state -------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._requests

    @property
    def batch_size(self) -> int:
        return sum(1 for state in self._requests.values() if state.stream.ids)

    @property
    def waiting(self) -> int:
        return sum(1 for state in self._requests.values() if not state.stream.ids)

    @property
    def reserved_tokens(self) -> int:
        """Tokens in the KV cache of the running requests (vLLM allocates pages as they grow)."""
        return sum(state.prompt_len + len(state.stream.ids) for state in self._requests.values() if state.stream.ids)

    @property
    def kv_budget_tokens(self) -> int:
        return self._kv_budget

    @property
    def compiled(self) -> bool:
        """vLLM compiles before it serves, unless told not to (``enforce_eager``, compilation mode NONE)."""
        return self._engine.vllm_config.compilation_config.mode != CompilationMode.NONE

    def close(self) -> None:
        self._engine.engine_core.shutdown()

    # -- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        self._submit_held()
        if not self._requests or not self._engine.has_unfinished_requests():
            return outputs
        try:
            results = self._engine.step()
        except Exception:
            self._engine.abort_request([rid for rid in self._requests if rid not in self._held])
            for request_id in list(self._requests):
                self._forget(request_id)
            raise
        for result in results:
            assert isinstance(result, RequestOutput)  # a generating model's (PoolingRequestOutput: an embedding's)
            state = self._requests.get(result.request_id)
            if state is None:  # cancelled while the core computed this step
                continue
            if result.prompt_logprobs and result.request_id in self._prompt_logprobs:
                self._collect_prompt_logprobs(state, result.prompt_logprobs)
            completion = result.outputs[0]
            finished = False
            for position, token in enumerate(completion.token_ids):
                event = self._token_event(state, token, completion.logprobs, position)
                outputs.append(StepOutput(state.job, event))
                if isinstance(event, ErrorEvent) or event.finish is not None:
                    finished = True
                    self._forget(state.request_id)
                    if not result.finished:  # a stop string or stop order: vLLM would go on
                        self._engine.abort_request([state.request_id])
                    break
            if result.finished and not finished:
                self._forget(state.request_id)
                reason = completion.finish_reason or "an unknown reason"
                outputs.append(StepOutput(state.job, ErrorEvent(message=f"vLLM ended the request early ({reason})")))
        return outputs

    def _collect_prompt_logprobs(self, state: RequestState, chunk: Sequence[Any]) -> None:
        """Prompt logprobs arrive with the prefill (in pieces when vLLM splits a long prompt), one entry per
        prompt position, None for the first token."""
        collected = self._prompt_logprobs[state.request_id]
        for entry in chunk:
            token = state.job.input_ids[len(collected)]
            collected.append(None if entry is None else entry[token].logprob)
        if len(collected) == state.prompt_len:
            state.prefill = prompt_details(self.tokenizer, state.job.input_ids, collected[1:], self._special_ids)

    def _token_event(self, state: RequestState, token: int, logprobs: Any, position: int) -> TokenEvent | ErrorEvent:
        try:
            logprob = logprobs[position][token].logprob if logprobs else 0.0
            return state.token_event(
                token, logprob, stopping=state.request_id in self._stopping, eos=token in self._eos_ids,
                special=token in self._special_ids,
            )
        except Exception as exc:  # this request's text handling failed; the others go on
            log.exception("request failed", extra={"request_id": state.request_id})
            return ErrorEvent(message=f"generation failed: {exc}")


ENGINE = VllmEngine
