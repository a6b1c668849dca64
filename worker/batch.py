"""The tensors of a running batch and the three things done to them: prefill, decode, filter/merge.

Rows are left-padded to a common cache width, so a decode step is one forward pass of shape [batch, 1]
whatever the rows' lengths: the attention mask hides each row's padding and explicit position ids keep
every row's positions starting at 0, exactly as if it ran alone. Rows that finish are filtered out and
padding columns no remaining row needs are trimmed; newly prefilled rows are merged in by left-padding
the narrower of the two caches. The KV cache is a ``transformers`` 5 ``DynamicCache`` whose layers append in
place (:mod:`worker.kv_cache`), read through its public ``layers`` and built only through its public ``update`` API.

Each row also carries the name of its LoRA adapter (None: the base model). Once the model is wrapped in a
peft ``PeftModel`` every pass gives peft these names (its ``adapter_names``), so rows of several adapters
and of the base model share one batch, each row computed with its own adapter only.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from llguidance import LLMatcher
from peft import PeftModel
from transformers import DynamicCache, PreTrainedModel

from common.protocol import SamplingParams
from worker.attention import accepts_4d_mask
from worker.kv_cache import GrowingCache
from worker.llama_step import LlamaStep
from worker.sampling import BatchSampler

BASE_ADAPTER = "__base__"
"""peft's ``adapter_names`` entry for a row without adapter."""


@dataclass(frozen=True)
class ForwardArgs:
    """How to call one model's forward: which of the optional arguments it declares (a model that has no
    ``position_ids``, such as Bloom with ALiBi, derives positions from the mask; one without
    ``logits_to_keep`` returns every position's logits) and whether it takes a ready 4D mask. These are read
    from the Hugging Face model: a ``PeftModel`` wrapping it passes them on without declaring them."""

    mask_4d: bool
    position_ids: bool
    logits_to_keep: bool
    step: LlamaStep | None = None  # the model's passes without its forward, where they apply

    @classmethod
    def of(cls, model: PreTrainedModel) -> ForwardArgs:
        declared = inspect.signature(model.forward).parameters
        return cls(accepts_4d_mask(model), "position_ids" in declared, "logits_to_keep" in declared,
                   LlamaStep.of(model))

    def step_for(self, model: PreTrainedModel | PeftModel) -> LlamaStep | None:
        """:attr:`step` when passes of ``model`` run it: there is one, and the model is not wrapped by peft (an
        adapter's layers are in the wrapper's forward only); else None."""
        return self.step if self.step is not None and model is self.step.model else None

    def call(
        self, model: PreTrainedModel | PeftModel, input_ids: torch.Tensor, mask: torch.Tensor,
        positions: torch.Tensor, cache: DynamicCache, logits_to_keep: int | None = None,
        extra_inputs: dict[str, torch.Tensor] | None = None, adapter_names: list[str] | None = None,
    ) -> torch.Tensor:
        """The logits of one forward pass (``mask`` already in the form :attr:`mask_4d` says); ``adapter_names``
        (one per row) go to a ``PeftModel``."""
        kwargs: dict[str, Any] = dict(extra_inputs or {})
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names
        if self.position_ids:
            kwargs["position_ids"] = positions
        if self.logits_to_keep and logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        return model(
            input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True, **kwargs
        ).logits


class DecodeBatch:
    """Left-padded KV cache plus per-row state; row order is the order of the engine's running list."""

    def __init__(
        self,
        cache: GrowingCache,
        attention_mask: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        sampler: BatchSampler,
        adapters: list[str | None],
    ) -> None:
        self.cache = cache
        self.attention_mask = attention_mask  # bool [batch, cache width], False on left padding
        self.next_ids = next_ids  # [batch, 1]: the last chosen token, not yet in the cache
        self.positions = positions  # [batch, 1]: position id of next_ids
        self.sampler = sampler
        self.adapters = adapters  # each row's LoRA adapter; None: the base model

    @classmethod
    def prefill(
        cls,
        model: PreTrainedModel | PeftModel,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        pad_id: int,
        prompt_details: Sequence[bool],
        forward: ForwardArgs,
        adapters: Sequence[str | None],
        extra_inputs: dict[str, torch.Tensor] | None = None,
        matchers: Sequence[LLMatcher | None] | None = None,
    ) -> tuple[DecodeBatch, torch.Tensor, torch.Tensor, list[list[float] | None]]:
        """Run the prompts through the model in one left-padded pass and choose each row's first token, each
        row with its adapter of ``adapters`` and its grammar's matcher of ``matchers`` (the first token is
        constrained too; None: no row is); ``extra_inputs`` go to the model's forward too (the rows' media
        features, in row order).

        Returns the batch, the chosen ids and their logprobs, and for rows that asked for details the
        logprob of each prompt token after the first. Full-sequence logits are only materialised then.
        """
        width = max(len(prompt) for prompt in prompts)
        padded = [[pad_id] * (width - len(prompt)) + list(prompt) for prompt in prompts]
        present = [[False] * (width - len(prompt)) + [True] * len(prompt) for prompt in prompts]
        input_ids = torch.tensor(padded, dtype=torch.long, device=model.device)
        attention_mask = torch.tensor(present, dtype=torch.bool, device=model.device)
        positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        cache = GrowingCache()
        mask = _causal_mask(attention_mask) if forward.mask_4d else attention_mask
        step = forward.step_for(model)
        if step is not None and not any(prompt_details) and not extra_inputs:
            logits = step(input_ids, mask, positions, cache)
        else:
            logits = forward.call(model, input_ids, mask, positions, cache, 0 if any(prompt_details) else 1,
                                  extra_inputs, _adapter_names(model, adapters))
        sampler = BatchSampler.create(params, prompts, logits.shape[-1], model.device, matchers)
        ids, logprobs = sampler(logits[:, -1, :])
        prompt_logprobs = [
            _prompt_logprobs(logits[row], prompt) if details else None
            for row, (prompt, details) in enumerate(zip(prompts, prompt_details, strict=True))
        ]
        batch = cls(cache, attention_mask, ids[:, None], positions[:, -1:] + 1, sampler, list(adapters))
        return batch, ids, logprobs, prompt_logprobs

    @property
    def size(self) -> int:
        return self.next_ids.shape[0]

    def decode(self, model: PreTrainedModel | PeftModel, forward: ForwardArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's last token, append it to the cache and choose the next one."""
        attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((self.size, 1))], dim=1)
        mask = attention_mask[:, None, None, :] if forward.mask_4d else attention_mask
        if (step := forward.step_for(model)) is not None:
            logits = step(self.next_ids, mask, self.positions, self.cache)
        else:
            logits = forward.call(model, self.next_ids, mask, self.positions, self.cache,
                                  adapter_names=_adapter_names(model, self.adapters))
        self.attention_mask = attention_mask
        ids, logprobs = self.sampler(logits[:, -1, :])
        self.next_ids = ids[:, None]
        self.positions = self.positions + 1
        return ids, logprobs

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (in that order) and drop leading columns that are padding in all."""
        index = torch.tensor(keep, dtype=torch.long, device=self.next_ids.device)
        attention_mask = self.attention_mask[index]
        start = int(attention_mask.any(dim=0).int().argmax())
        self.attention_mask = attention_mask[:, start:]
        self.cache = _build_cache(
            (keys[index, :, start:], values[index, :, start:]) for keys, values in _layers(self.cache)
        )
        self.next_ids = self.next_ids[index]
        self.positions = self.positions[index]
        self.sampler = self.sampler.select(keep)
        self.adapters = [self.adapters[row] for row in keep]

    def merge(self, other: DecodeBatch) -> None:
        """Append the rows of ``other``, left-padding whichever cache is narrower."""
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        self.attention_mask = _stack_left_padded([self.attention_mask, other.attention_mask], width, seq_dim=1)
        self.cache = _build_cache(
            (_stack_left_padded([keys, other_keys], width, seq_dim=2),
             _stack_left_padded([values, other_values], width, seq_dim=2))
            for (keys, values), (other_keys, other_values)
            in zip(_layers(self.cache), _layers(other.cache), strict=True)
        )
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
        self.positions = torch.cat([self.positions, other.positions])
        self.sampler = BatchSampler.concat(self.sampler, other.sampler)
        self.adapters = self.adapters + other.adapters


def _adapter_names(model: PreTrainedModel | PeftModel, adapters: Sequence[str | None]) -> list[str] | None:
    """peft's ``adapter_names`` for the rows (:data:`BASE_ADAPTER`: none) when the model is wrapped: every pass
    must name each row's adapter, else peft applies its active adapter to all rows. None for a plain model."""
    return [name or BASE_ADAPTER for name in adapters] if isinstance(model, PeftModel) else None


def _causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, 1, query, key] prefill mask: causal, padding keys hidden. Padding queries attend to themselves
    only, so that no row is fully masked (SDPA would turn it into NaN, and NaN cached keys poison a batch)."""
    width = attention_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return ((causal & attention_mask[:, None, :]) | diagonal)[:, None]


def _prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int]) -> list[float]:
    """log-softmax of each position's logits at the next prompt token (``logits`` is one left-padded row)."""
    width = logits.shape[0]
    scores = logits[width - len(prompt) : width - 1].float()
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    return (scores.gather(1, targets[:, None]).squeeze(1) - scores.logsumexp(dim=-1)).tolist()


def _stack_left_padded(tensors: list[torch.Tensor], width: int, seq_dim: int) -> torch.Tensor:
    """Concatenate along the batch dimension, right-aligning each tensor's ``seq_dim`` in ``width`` zeros."""
    first = tensors[0]
    shape = list(first.shape)
    shape[0] = sum(tensor.shape[0] for tensor in tensors)
    shape[seq_dim] = width
    out = first.new_zeros(shape)
    row = 0
    for tensor in tensors:
        rows, length = tensor.shape[0], tensor.shape[seq_dim]
        out.narrow(0, row, rows).narrow(seq_dim, width - length, length).copy_(tensor)
        row += rows
    return out


def _layers(cache: GrowingCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, [batch, kv_heads, width, head_dim] each (transformers 5's ``Cache.layers``)."""
    return [layer.cached() for layer in cache.growing_layers]


def _build_cache(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> GrowingCache:
    """A new cache holding the given (keys, values) of each layer, in layer order."""
    cache = GrowingCache()
    for layer, (keys, values) in enumerate(layers):
        cache.update(keys, values, layer)
    return cache
