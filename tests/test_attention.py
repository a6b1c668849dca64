"""The padded-batch SDPA attention equals transformers' SDPA path (which repeats the grouped KV heads)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.attention import padded_sdpa_attention


@pytest.mark.parametrize("queries", [1, 5])
def test_matches_transformers_sdpa_with_a_padding_mask(queries: int) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, keys, dim = 3, 8, 2, 11, 16
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    query = torch.randn(batch, queries, heads, dim).transpose(1, 2)  # non-contiguous, as the models make it
    key, value = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)
    padding = torch.ones(batch, keys, dtype=torch.bool)
    padding[0, :4] = padding[2, :1] = False
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = (causal & padding[:, None, :])[:, None]
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    output, _ = padded_sdpa_attention(module, query, key, value, mask, scaling=dim**-0.5)
    assert output.shape == (batch, queries, heads, dim)
    torch.testing.assert_close(output, expected)
