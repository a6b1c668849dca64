"""The continuous-batching engine: iteration-level scheduling over a Hugging Face causal LM.

Each :meth:`Engine.step` admits queued jobs (one left-padded prefill pass, bounded by the prefill limits),
runs one decode pass over the requests already running, merges the newcomers into the running batch and
drops the requests that finished, so requests join and leave between any two tokens. Memory is bounded by
reservation: a request holds ``prompt + max_new_tokens`` cache tokens for its lifetime and is only admitted
while the sum over running requests stays within ``max_batch_total_tokens``.

The engine is not thread-safe: the queue loop calls every method from one thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.protocol import ErrorEvent, Finish, FinishReason, Job, TokenEvent, TokenInfo
from common.settings import Settings
from worker.attention import accepts_4d_mask, use_padded_attention
from worker.batch import DecodeBatch
from worker.detokenizer import TextStream, make_decoder

log = logging.getLogger("ferry.engine")


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
class _Sequence:
    """Engine-side state of one request."""

    job: Job
    stream: TextStream
    max_new_tokens: int  # the request's own limit, lowered to fit the total length cap

    prefill: list[TokenInfo] = field(default_factory=list)
    started_at: float = 0.0  # unix time of admission (the prefill), for the request's queue and inference times

    @property
    def prompt_len(self) -> int:
        return len(self.job.input_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache tokens this request may grow to, held from admission to finish."""
        return self.prompt_len + self.max_new_tokens


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """Every EOS id declared by the model's generation config or config (each an int, a list or unset)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


class Engine:
    """Runs many generation requests as one batch; see the module docstring."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self._decode = make_decoder(tokenizer)
        self._eos_ids = _eos_token_ids(model)
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._vocab_size = model.config.vocab_size
        self._mask_4d = accepts_4d_mask(model)
        limits = [settings.max_seq_len, settings.max_batch_total_tokens]
        if getattr(model.config, "max_position_embeddings", None):
            limits.append(model.config.max_position_embeddings)
        self.max_total_tokens = min(limits)  # prompt + generated of one request
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # row order of self._batch
        self._batch: DecodeBatch | None = None
        self._cancelled: set[str] = set()
        self._stopping: set[str] = set()

    @classmethod
    def load(cls, settings: Settings) -> "Engine":
        """Load the model and tokenizer from ``settings.resolved_model_path`` onto ``settings.device``."""
        if settings.device.split(":", 1)[0] == "npu":
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        dtype = settings.dtype if settings.dtype == "auto" else getattr(torch, settings.dtype)
        model = AutoModelForCausalLM.from_pretrained(settings.resolved_model_path, dtype=dtype)
        model.to(torch.device(settings.device)).eval()
        use_padded_attention(model)
        tokenizer = AutoTokenizer.from_pretrained(settings.resolved_model_path)
        return cls(model, tokenizer, settings)

    # -- admission ---------------------------------------------------------------------------------

    def fits(self, job: Job) -> bool:
        """Whether the job can ever run here: prompt + 1 token within the length cap (which includes the
        KV budget), a prompt that one prefill pass can take, and token ids the model knows."""
        prompt_len = len(job.input_ids)
        return (
            prompt_len + 1 <= self.max_total_tokens
            and prompt_len <= self.settings.max_prefill_tokens
            and all(0 <= token < self._vocab_size for token in job.input_ids)
        )

    def has_room(self) -> bool:
        """Whether one more job could join: running plus queued requests leave a batch slot and KV budget
        (a queued job that does not fit yet exhausts the budget by itself, so nothing is taken past it)."""
        sequences = [*self._running, *self._waiting]
        return (
            len(sequences) < self.settings.max_batch_size
            and sum(seq.reserved_tokens for seq in sequences) < self.settings.max_batch_total_tokens
        )

    def add(self, job: Job) -> None:
        """Queue a job (it must :meth:`fits`) for admission at a following step."""
        if not self.fits(job):
            raise ValueError(f"request {job.request_id} does not fit this engine's limits")
        if self._knows(job.request_id):
            raise ValueError(f"request {job.request_id} is already queued or running")
        max_new = min(job.params.max_new_tokens, self.max_total_tokens - len(job.input_ids))
        self._waiting.append(_Sequence(job, TextStream(self._decode, job.params.stop), max_new))

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
                ids, logprobs = self._batch.decode(self.model)
            except Exception:
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
        self._waiting = deque(seq for seq in self._waiting if seq.job.request_id not in cancelled)
        keep = [row for row, seq in enumerate(self._running) if seq.job.request_id not in cancelled]
        self._running, self._batch = self._select(self._running, self._batch, keep)

    def _admit(self) -> list[_Sequence]:
        """Pop queued jobs, first come first served, while the batch, KV budget and prefill limits allow."""
        settings = self.settings
        admitted: list[_Sequence] = []
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
        self, sequences: list[_Sequence], outputs: list[StepOutput]
    ) -> tuple[list[_Sequence], DecodeBatch] | None:
        """Prefill the admitted sequences, emit their first tokens; return those still running."""
        if not sequences:
            return None
        jobs = [seq.job for seq in sequences]
        batch, ids, logprobs, prompt_logprobs = DecodeBatch.prefill(
            self.model,
            [job.input_ids for job in jobs],
            [job.params for job in jobs],
            self._pad_id,
            [job.decoder_input_details for job in jobs],
            self._mask_4d,
        )
        for seq, scores in zip(sequences, prompt_logprobs):
            if scores is not None:
                seq.prefill = self._prefill_details(seq.job.input_ids, scores)
        sequences, batch = self._advance(sequences, batch, ids, logprobs, outputs)
        return None if batch is None else (sequences, batch)

    def _prefill_details(self, input_ids: list[int], logprobs: list[float]) -> list[TokenInfo]:
        texts = self.tokenizer.batch_decode([[token] for token in input_ids], skip_special_tokens=False)
        return [
            TokenInfo(id=token, text=text, logprob=logprob, special=token in self._special_ids)
            for token, text, logprob in zip(input_ids, texts, [None, *logprobs])
        ]

    def _advance(
        self,
        sequences: list[_Sequence],
        batch: DecodeBatch,
        ids: torch.Tensor,
        logprobs: torch.Tensor,
        outputs: list[StepOutput],
    ) -> tuple[list[_Sequence], DecodeBatch | None]:
        """Turn each row's new token into an event; return the rows that keep running."""
        keep: list[int] = []
        for row, (seq, token, logprob) in enumerate(zip(sequences, ids.tolist(), logprobs.tolist())):
            try:
                event: TokenEvent | ErrorEvent = self._token_event(seq, token, logprob)
            except Exception as exc:  # this request's text handling failed; the others go on
                log.exception("request failed", extra={"request_id": seq.job.request_id})
                event = ErrorEvent(message=f"generation failed: {exc}")
            output = StepOutput(seq.job, event)
            outputs.append(output)
            if output.finished:
                self._stopping.discard(seq.job.request_id)
            else:
                keep.append(row)
        return self._select(sequences, batch, keep)

    @staticmethod
    def _select(
        sequences: list[_Sequence], batch: DecodeBatch | None, keep: list[int]
    ) -> tuple[list[_Sequence], DecodeBatch | None]:
        """Keep the rows ``keep`` of a batch (None once no row is left)."""
        if batch is None or len(keep) == len(sequences):
            return sequences, batch
        if not keep:
            return [], None
        batch.filter(keep)
        return [sequences[row] for row in keep], batch

    def _token_event(self, seq: _Sequence, token: int, logprob: float) -> TokenEvent:
        """Record one generated token and decide whether the request ends with it."""
        text, stopped = seq.stream.push(token)
        generated = len(seq.stream.ids)
        reason: FinishReason | None = None
        if stopped or seq.job.request_id in self._stopping:
            reason = "stop_sequence"
        elif token in self._eos_ids:
            reason = "eos_token"
        elif generated >= seq.max_new_tokens:
            reason = "length"
        finish = None
        if reason is not None:
            if not stopped:
                rest, stopped = seq.stream.finish()
                text += rest
                reason = "stop_sequence" if stopped else reason
            finish = Finish(
                finish_reason=reason,
                generated_tokens=generated,
                prompt_tokens=seq.prompt_len,
                seed=seq.job.params.seed,
                generated_text=seq.stream.text,
                prefill=seq.prefill,
                queue_time=max(0.0, seq.started_at - seq.job.enqueued_at),
                inference_time=time.time() - seq.started_at,
            )
        info = TokenInfo(id=token, text=text, logprob=logprob, special=token in self._special_ids)
        return TokenEvent(index=generated - 1, token=info, finish=finish)
