"""Attention for padded decode batches: SDPA with a boolean mask, without copying grouped KV heads.

A continuous batch almost always holds left padding, so every decode step needs an attention mask. Given
a mask, ``transformers``' SDPA integration expands the KV cache of grouped-query attention models to one
copy per query head (``repeat_kv``) at every layer of every step, because PyTorch's GQA mode does not take
a mask on every backend. For a single query token there is a cheaper equivalent: the query heads that
share a KV head are folded into the query-length dimension, so SDPA reads the cache as it is and the
[batch, 1, 1, keys] padding mask broadcasts over the folded queries. Prompts (more than one query) take
the stock path. :func:`use_padded_attention` switches a model to this function through the public
``AttentionInterface`` / ``AttentionMaskInterface`` registries, under its own name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PADDED_SDPA = "ferry_padded_sdpa"
_SDPA_KINDS = ("sdpa", PADDED_SDPA)


def padded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function: query [batch, heads, q, dim], key/value [batch, kv_heads, k, dim],
    boolean mask [batch, 1, q, k] or None; returns [batch, q, heads, dim]."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is None or queries != 1 or heads == kv_heads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Query head h uses KV head h // groups, so the folded query row g of KV head j is query head j * groups + g.
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, 1, heads, dim), None


def uses_full_attention(model: PreTrainedModel) -> bool:
    """Every layer attends to the whole causal prefix (no sliding-window or chunked layers)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return not getattr(config, "sliding_window", None) and all(kind == "full_attention" for kind in layer_types)


def use_padded_attention(model: PreTrainedModel) -> None:
    """Switch an SDPA model with full attention to :func:`padded_sdpa_attention` (other models are left as
    they are; a model that cannot switch implementations keeps its own, with a warning from transformers)."""
    if model.config._attn_implementation != "sdpa" or not uses_full_attention(model):
        return
    AttentionInterface.register(PADDED_SDPA, padded_sdpa_attention)
    AttentionMaskInterface.register(PADDED_SDPA, sdpa_mask)
    model.set_attn_implementation(PADDED_SDPA)


def accepts_4d_mask(model: PreTrainedModel) -> bool:
    """Whether the engine may hand the model a ready boolean [batch, 1, q, k] mask instead of the 2D padding
    mask. From a padded 2D mask, transformers rebuilds the 4D mask with ``vmap`` at every forward pass, which
    costs more than a decode step of a small model; a boolean mask is only right for SDPA kinds of attention
    on full-attention models."""
    return model.config._attn_implementation in _SDPA_KINDS and uses_full_attention(model)
