"""The in-place KV cache layer holds exactly what transformers' concatenating ``DynamicLayer`` holds."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from worker.kv_cache import SPARE_POSITIONS, GrowingCache, GrowingLayer


def _states(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, length, 4), torch.randn(batch, 2, length, 4)


def test_appends_like_dynamic_layer_across_buffer_growth() -> None:
    torch.manual_seed(0)
    growing, stock = GrowingLayer(), DynamicLayer()
    # a prompt, then more single-token steps than one buffer's spare positions hold
    for new in [5] + [1] * (2 * SPARE_POSITIONS + 3):
        keys, values = _states(3, new)
        got, want = growing.update(keys, values), stock.update(keys, values)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert growing.get_seq_length() == stock.get_seq_length() == 5 + 2 * SPARE_POSITIONS + 3


def test_values_keep_their_own_head_dim() -> None:
    """Some attention kinds (DeepSeek's MLA) cache values narrower than keys."""
    torch.manual_seed(0)
    growing, stock = GrowingLayer(), DynamicLayer()
    for new in (4, 1, 1):
        keys, values = torch.randn(2, 2, new, 6), torch.randn(2, 2, new, 4)
        got, want = growing.update(keys, values), stock.update(keys, values)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_steps_write_into_one_buffer_until_it_is_full() -> None:
    layer = GrowingLayer()
    layer.update(*_states(2, 10))
    buffer, strides = layer.keys.data_ptr(), layer.keys.stride()
    for _ in range(SPARE_POSITIONS):
        keys, _ = layer.update(*_states(2, 1))
        assert keys.data_ptr() == buffer  # no copy of the cache
        assert keys.stride() == strides  # never the whole buffer (a compiled step is specialised on strides)
    keys, _ = layer.update(*_states(2, 1))
    assert keys.data_ptr() != buffer and keys.shape == (2, 2, 10 + SPARE_POSITIONS + 1, 4)


def test_a_replaced_or_cropped_cache_stays_right() -> None:
    """``DynamicLayer``'s own methods replace or shorten ``keys``; appends after them see their result."""
    torch.manual_seed(0)
    growing, stock = GrowingLayer(), DynamicLayer()
    for layer in (growing, stock):
        torch.manual_seed(1)
        layer.update(*_states(3, 6))
        layer.batch_select_indices(torch.tensor([2, 0]))
        layer.update(*_states(2, 1))
        layer.crop(-3)
        layer.update(*_states(2, 2))
    torch.testing.assert_close(growing.keys, stock.keys, rtol=0, atol=0)
    torch.testing.assert_close(growing.values, stock.values, rtol=0, atol=0)
    assert growing.keys.shape == (2, 2, 6, 4)


def test_cache_makes_one_growing_layer_per_model_layer() -> None:
    cache = GrowingCache()
    for layer_idx in range(3):
        cache.update(*_states(1, 4), layer_idx)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer] * 3
    assert cache.get_seq_length() == 4
