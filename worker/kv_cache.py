"""The running batch's KV cache: ``transformers``' ``DynamicCache`` whose layers append in place.

A stock ``DynamicLayer`` appends a decode step's keys and values with ``torch.cat``, which copies the whole
cache of every layer at every step: with the ``cat`` calls of rotary embeddings, a sizeable share of a decode
step's CPU time (bench/RESULTS.md). :class:`GrowingLayer` keeps each layer's
keys and values in a buffer with room for :data:`SPARE_POSITIONS` more positions and writes new ones into it;
its ``keys``/``values`` are views of the filled part, so everything that reads a ``DynamicLayer`` (the model's
attention, :mod:`worker.batch`) reads it unchanged. A buffer is copied only when it is full, once every
:data:`SPARE_POSITIONS` decode steps.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

SPARE_POSITIONS = 32
"""Positions a layer's buffer holds beyond what it was last grown to: the memory a row may hold beyond its
cached tokens (like the unused tail of a paged cache's last block), against one full copy per that many steps."""


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` that appends into a buffer with spare positions instead of concatenating."""

    def __init__(self) -> None:
        super().__init__()
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` [batch, heads, new, dim]; returns all keys and values so far."""
        keys, values, length = self.reserve(key_states, value_states)
        end = length + key_states.shape[-2]
        keys[..., length:end, :].copy_(key_states)
        values[..., length:end, :].copy_(value_states)
        return self.commit(end)

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The key and value buffers, with room after the cached positions for states shaped like
        ``key_states``/``value_states``, and the number of cached positions; write the new states after them,
        then :meth:`commit`. A buffer always keeps one position unused, so that ``keys`` never spans a whole
        buffer: its strides are the same at every length (a compiled decode step is specialised on them). An
        uninitialised layer is initialised first, as ``update`` does."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._appends_in_place(key_states, end):
            rows_heads, capacity = key_states.shape[:-2], end + SPARE_POSITIONS + 1  # and the unused one
            keys = key_states.new_empty((*rows_heads, capacity, key_states.shape[-1]))
            values = value_states.new_empty((*rows_heads, capacity, value_states.shape[-1]))  # its own head dim
            if length:
                cached_keys, cached_values = self.cached()
                keys[..., :length, :].copy_(cached_keys)
                values[..., :length, :].copy_(cached_values)
            self._buffers = (keys, values)
        assert self._buffers is not None  # made above, or _appends_in_place found them
        keys, values = self._buffers
        return keys, values, length

    def commit(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the first ``end`` positions of the buffers the cached keys and values; returns them."""
        assert self._buffers is not None, "commit before reserve"
        keys, values = self._buffers
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values (``DynamicLayer`` has them None until its first update)."""
        assert self.keys is not None and self.values is not None, "the layer has had no update"
        return self.keys, self.values

    def _appends_in_place(self, key_states: torch.Tensor, end: int) -> bool:
        """Whether the buffer can take positions up to ``end`` and keep one spare: it exists, has room, has
        the new states' rows and heads, and ``keys`` is still the view this layer made (``DynamicLayer``'s
        own methods, such as ``batch_select_indices``, replace it with a tensor of their own)."""
        if self._buffers is None:
            return False
        buffer = self._buffers[0]
        return (
            end < buffer.shape[-2]
            and buffer.shape[:-2] == key_states.shape[:-2]
            and buffer.dtype == key_states.dtype
            and self.keys is not None
            and self.keys.data_ptr() == buffer.data_ptr()
        )


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` made of :class:`GrowingLayer` (one per model layer, created at its first update)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)

    @property
    def growing_layers(self) -> list[GrowingLayer]:
        """``layers``, typed as what they are: this cache makes no other layer (``Cache.layers`` is declared
        with every layer class of ``transformers``)."""
        return cast("list[GrowingLayer]", self.layers)

    def reserve(self, layers: int, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """:meth:`GrowingLayer.reserve` of each of ``layers`` layers (made as ``update`` makes them) and the
        number of cached positions, for a pass that writes the buffers itself, then commits."""
        buffers = []
        length = self.get_seq_length()
        growing = self.growing_layers
        for index in range(layers):
            if index == len(growing):
                growing.append(GrowingLayer())
            keys, values, _ = growing[index].reserve(key_states, value_states)
            buffers.append((keys, values))
        return buffers, length

    def commit(self, end: int) -> None:
        """:meth:`GrowingLayer.commit` of every layer."""
        for layer in self.growing_layers:
            layer.commit(end)
