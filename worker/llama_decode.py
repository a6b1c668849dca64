"""A decode step of a Llama-family model with fewer small ops than its ``transformers`` forward, and compiled.

On CPU a decode step of a small batch is its matrix products plus a few hundred small ops between them, and
those cost as much again when run one by one after the products have streamed the weights through the caches
(bench/RESULTS.md); vLLM compiles them into a few fused kernels. :class:`LlamaDecodeStep` runs the step from
the model's own modules (embeddings, RMSNorms, rotary embedding, LM head), its grouped oneDNN products
(:class:`worker.cpu_linear.SiblingGroup`) and its attention function, but takes the query and key heads of the
stacked q/k/v product as one tensor and rotates them together (``roll`` and a sign-folded sine in place of
``rotate_half``'s slices and ``cat``), and the gated MLP's halves as views of one product: the same operations
on the same values in the same order, so its logits are bit-identical to the model's forward
(tests/test_llama_decode.py), in about 8 % less time per step at 8 rows and 4 % at 32 on the bench model (the
same at 1 row; bench/RESULTS.md).

With ``compile`` (the worker's ``compileDecode`` setting, on by default, as vLLM compiles its CPU models), the
step is also compiled by ``torch.compile`` with Inductor, once, at load: the small ops become a few generated C++
kernels and the products stay oneDNN calls (``torch.ops.ferry.packed_linear``). Its logits match the eager
step's within float rounding (Inductor reorders the RMSNorm's sums). Batches of one row (their products take
MKL's dense path) and caches of under two positions run the eager step, so that one graph, dynamic in rows and
length, serves every other step; where Inductor cannot compile (no C++ compiler, say), the step stays eager,
with a warning.

It only takes the families whose decoder layer it reproduces (:data:`FAMILIES`), prepared as :func:`applies`
checks; every other model, a model wrapped by peft for LoRA, and prompt passes run the model's forward.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F
from transformers import PreTrainedModel

from worker.attention import PADDED_SDPA, padded_sdpa_attention
from worker.cpu_linear import DENSE_ROWS
from worker.kv_cache import GrowingCache

log = logging.getLogger(__name__)

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
"""``model_type``s whose decoder layer is Llama's: pre-norm RMSNorm, rotary q/k/v attention without q/k norms,
a SiLU-gated MLP, plain residual adds, unscaled embeddings (bit-equality with their forward is tested)."""


INDUCTOR_OPTIONS: dict[str, Any] = {
    "dce": True, "size_asserts": False, "nan_asserts": False, "epilogue_fusion": True, "cpp.dynamic_threads": True,
}
"""vLLM's Inductor options on CPU: no size or NaN checks at every call, and kernels that take torch's thread count
at run time (the worker binds its threads after load, worker/cpu_threads.py) rather than the one at compile time."""

COMPILED_MIN_LENGTH = 2
"""Cached positions from which the compiled step runs: below, torch.compile would specialise a graph on a
length of 0 or 1."""


def applies(model: PreTrainedModel) -> bool:
    """Whether :class:`LlamaDecodeStep` reproduces this model's decode step: a causal LM of :data:`FAMILIES` with
    the padded SDPA attention (full attention, :func:`worker.attention.use_padded_attention`), a SiLU MLP and
    grouped packed products in every layer (:func:`worker.cpu_linear.use_packed_linear` on CPU)."""
    config = model.config
    inner = getattr(model, "model", None)
    if (config.model_type not in FAMILIES or config._attn_implementation != PADDED_SDPA
            or config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1
            or inner is None or not hasattr(model, "lm_head")):
        return False
    return all(
        getattr(layer.self_attn.q_proj, "group", None) is not None
        and layer.self_attn.q_proj.group.members == [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        and getattr(layer.mlp.gate_proj, "group", None) is not None
        and layer.mlp.gate_proj.group.members == [layer.mlp.gate_proj, layer.mlp.up_proj]
        for layer in inner.layers
    )


class LlamaDecodeStep:
    """The logits of one decode step of a model :func:`applies` takes; see the module docstring."""

    @classmethod
    def of(cls, model: PreTrainedModel, compile: bool = False) -> "LlamaDecodeStep | None":
        """The step for ``model``, or None where it does not apply (:func:`applies`); ``compile``: compiled
        (:meth:`compile`)."""
        if not applies(model):
            return None
        step = cls(model)
        if compile:
            step.compile()
        return step

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.compiled: Any = None  # the compiled _layers, once compile() succeeded

    def compile(self) -> bool:
        """Compile the step and run it once on a small batch, so that requests do not wait for Inductor;
        returns whether it compiled (the step stays eager where it did not)."""
        compiled = torch.compile(self._layers, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
        started = time.monotonic()
        rows, length = DENSE_ROWS + 1, COMPILED_MIN_LENGTH
        device, dtype = self.model.device, self.model.dtype
        shape = (rows, self.kv_heads, length + 2, self.head_dim)
        try:
            with torch.inference_mode(), shape_config.patch(use_duck_shape=False):  # tensors as the engine's
                buffers = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                           for _ in self.model.model.layers]
                compiled(torch.zeros((rows, 1), dtype=torch.long, device=device),
                         torch.ones((rows, 1, 1, length + 1), dtype=torch.bool, device=device),
                         torch.full((rows, 1), length, device=device), length, buffers)
        except Exception as exc:  # Inductor's failures have no common type (a missing compiler, an unsupported op)
            log.warning("the decode step stays eager: torch.compile failed: %s", str(exc).strip().splitlines()[0])
            return False
        log.info("compiled the decode step in %.1f s", time.monotonic() - started)
        self.compiled = compiled
        return True

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: GrowingCache) -> torch.Tensor:
        """``input_ids`` and ``positions`` [batch, 1], ``mask`` boolean [batch, 1, 1, keys] over the cache and
        the new token; appends each layer's key and value to ``cache``; returns logits [batch, 1, vocab]."""
        layers = cache.layers
        buffers = [layer.reserve(layer.keys[..., :1, :], layer.values[..., :1, :])[:2] for layer in layers]
        length = cache.get_seq_length()
        if self.compiled is not None and input_ids.shape[0] > DENSE_ROWS and length >= COMPILED_MIN_LENGTH:
            with shape_config.patch(use_duck_shape=False):  # sizes that happen to be equal stay distinct symbols
                logits = self.compiled(input_ids, mask, positions, length, buffers)
        else:
            logits = self._layers(input_ids, mask, positions, length, buffers)
        for layer in layers:
            layer.commit(length + 1)
        return logits

    def _layers(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, length: int,
                buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step on the cache's key and value buffers (:meth:`worker.kv_cache.GrowingLayer.reserve`), which
        hold ``length`` positions: writes each layer's new key and value at ``length``."""
        inner = self.model.model
        batch = input_ids.shape[0]
        heads, kv_heads, dim, half = self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)  # [batch, 1, dim]
        cos = cos[:, :, None, :]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None, :]
        rotated = (heads + kv_heads) * dim  # the query and key columns of the q/k/v product
        for layer, (keys, values) in zip(inner.layers, buffers):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = attention.q_proj.group.stacked(layer.input_layernorm(hidden))
            query_key = qkv[..., :rotated].view(batch, 1, heads + kv_heads, dim)
            query_key = query_key * cos + torch.roll(query_key, half, -1) * sin
            keys[:, :, length:length + 1].copy_(query_key[:, :, heads:].transpose(1, 2))
            values[:, :, length:length + 1].copy_(qkv[..., rotated:].view(batch, 1, kv_heads, dim).transpose(1, 2))
            output, _ = padded_sdpa_attention(attention, query_key[:, :, :heads].transpose(1, 2),
                                              keys[:, :, :length + 1], values[:, :, :length + 1], mask,
                                              scaling=attention.scaling)
            hidden = hidden + attention.o_proj(output.reshape(batch, 1, heads * dim))
            gate_up = mlp.gate_proj.group.stacked(layer.post_attention_layernorm(hidden))
            gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
        return self.model.lm_head(inner.norm(hidden))
