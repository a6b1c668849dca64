"""Linear layers on CPU through oneDNN, with each weight reordered once at load instead of at every call.

A decode step of a small batch is a chain of skinny matrix products ([batch, hidden] x [hidden, out]); on
CPU, ``torch.nn.functional.linear`` hands each to MKL's plain sgemm, which at 2 to 32 rows spends much of its
time re-laying out the weight. oneDNN's inner product on a weight already in its blocked layout does not,
which is what vLLM's CPU backend does for its linear layers too. The measured effect is in
bench/RESULTS.md ("The built-in engine on CPU").

:func:`use_packed_linear` switches every ``torch.nn.Linear`` of a CPU model whose weight dtype oneDNN packs on
this CPU (:func:`packed_dtypes`) to :class:`PackedLinear` (a subclass, so code that looks for ``nn.Linear``, peft's adapters included, still
finds it). The packed weight is a copy: the dense weight stays, because tied weights (an LM head shared
with the input embeddings) and adapters read it; a model's linear weights take twice their memory on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

BATCH_HINT = 32
"""The row count oneDNN is told to expect when it chooses the weight's layout (any count works; measured
here, hints from 1 to 128 gave the same speed within noise at 1 to 256 rows)."""


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward pass runs oneDNN's inner product on a weight packed by :func:`pack`."""

    packed_weight: torch.Tensor

    def pack(self) -> None:
        """(Re)build the packed copy from the dense weight; call it after changing ``weight``."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_size=BATCH_HINT)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out the packed weight (oneDNN's opaque tensors have no storage to copy)..."""
        state = self.__dict__.copy()
        state.pop("packed_weight", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """...and pack it again from the copied dense weight."""
        super().__setstate__(state)
        self.pack()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(input, self.packed_weight, bias, "none", [], "")


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs here: float32 always; bfloat16 only on a CPU with the instructions its bf16
    path needs (avx512bw/vl/dq or avx_ne_convert), elsewhere bfloat16 layers stay plain ``nn.Linear``."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packs_linear(model: PreTrainedModel) -> bool:
    """Whether :func:`use_packed_linear` applies: a model on CPU, with a torch that has oneDNN."""
    return model.device.type == "cpu" and torch.backends.mkldnn.is_available()


def use_packed_linear(model: PreTrainedModel) -> int:
    """Switch the model's linear layers to :class:`PackedLinear` (see the module docstring); returns how many."""
    if not packs_linear(model):
        return 0
    dtypes = packed_dtypes()
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in dtypes:
            module.__class__ = PackedLinear
            module.pack()
            count += 1
    return count
