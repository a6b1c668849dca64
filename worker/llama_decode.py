"""A decode step of a Llama-family model with fewer small ops than its ``transformers`` forward, same result.

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

It only takes the families whose decoder layer it reproduces (:data:`FAMILIES`), prepared as :func:`applies`
checks; every other model, a model wrapped by peft for LoRA, and prompt passes run the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from worker.attention import PADDED_SDPA, padded_sdpa_attention

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
"""``model_type``s whose decoder layer is Llama's: pre-norm RMSNorm, rotary q/k/v attention without q/k norms,
a SiLU-gated MLP, plain residual adds, unscaled embeddings (bit-equality with their forward is tested)."""


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
    def of(cls, model: PreTrainedModel) -> "LlamaDecodeStep | None":
        """The step for ``model``, or None where it does not apply (:func:`applies`)."""
        return cls(model) if applies(model) else None

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        """``input_ids`` and ``positions`` [batch, 1], ``mask`` boolean [batch, 1, 1, keys] over the cache and
        the new token; appends each layer's key and value to ``cache``; returns logits [batch, 1, vocab]."""
        inner = self.model.model
        batch = input_ids.shape[0]
        heads, kv_heads, dim, half = self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)  # [batch, 1, dim]
        cos = cos[:, :, None, :]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None, :]
        rotated = (heads + kv_heads) * dim  # the query and key columns of the q/k/v product
        for index, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = attention.q_proj.group.stacked(layer.input_layernorm(hidden))
            query_key = qkv[..., :rotated].view(batch, 1, heads + kv_heads, dim)
            query_key = query_key * cos + torch.roll(query_key, half, -1) * sin
            keys, values = cache.update(query_key[:, :, heads:].transpose(1, 2),
                                        qkv[..., rotated:].view(batch, 1, kv_heads, dim).transpose(1, 2), index)
            output, _ = padded_sdpa_attention(attention, query_key[:, :, :heads].transpose(1, 2), keys, values,
                                              mask, scaling=attention.scaling)
            hidden = hidden + attention.o_proj(output.reshape(batch, 1, heads * dim))
            gate_up = mlp.gate_proj.group.stacked(layer.post_attention_layernorm(hidden))
            gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
        return self.model.lm_head(inner.norm(hidden))
