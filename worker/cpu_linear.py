"""Linear layers on CPU through oneDNN, with each weight reordered once at load instead of at every call.

A decode step of a small batch is a chain of skinny matrix products ([batch, hidden] x [hidden, out]); on
CPU, ``torch.nn.functional.linear`` hands each to MKL's plain sgemm, which at 2 to 32 rows spends much of its
time re-laying out the weight. oneDNN's inner product on a weight already in its blocked layout does not,
which is what vLLM's CPU backend does for its linear layers too. The measured effect is in
bench/RESULTS.md ("The built-in engine on CPU"). A single float32 row is the exception: MKL's matrix-vector
product on the dense weight beats oneDNN there (:data:`DENSE_ROWS`).

:func:`use_packed_linear` switches every ``torch.nn.Linear`` of a CPU model whose weight dtype oneDNN packs on
this CPU (:func:`packed_dtypes`) to :class:`PackedLinear` (a subclass, so code that looks for ``nn.Linear``,
peft's adapters included, still finds it). The packed weight is a copy: the dense weight stays, because tied
weights (an LM head shared with the input embeddings) and adapters read it; a model's linear weights take
twice their memory on CPU.

Layers that a model calls one after the other on the same input (:data:`SIBLINGS`: attention's query, key and
value projections, a gated MLP's gate and up projections) share one packed weight, their weights stacked, and
one oneDNN product serves them all, as vLLM's merged QKV and gate-up layers do: fewer, wider products.

Every product on a packed weight goes through one operator of this module, ``torch.ops.ferry.packed_linear``:
eagerly it is oneDNN's inner product; under ``torch.compile`` it stays one opaque call, because Inductor lowers
``mkldnn._linear_pointwise`` only on weights it packed itself (the compiled passes of worker/llama_step.py).
"""

from __future__ import annotations

from typing import Any, TypeGuard, cast

import torch
from transformers import PreTrainedModel

BATCH_HINT = 32
"""The row count oneDNN is told to expect when it chooses the weight's layout (any count works: the hint made no
difference measured here)."""

DENSE_ROWS = 1
"""Float32 inputs of at most this many rows take ``F.linear`` on the dense weight instead of oneDNN: MKL's
matrix-vector product is faster for a single row, oneDNN from two rows on (bench/RESULTS.md)."""

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of linear layers of one module that the model calls on the same input, one after the other (the
Llama family's names: Llama, Mistral, Qwen, Gemma and more)."""


_OPS = torch.library.Library("ferry", "DEF")  # the registration of packed_linear lives as long as this module
_OPS.define("packed_linear(Tensor input, Tensor packed_weight, Tensor? bias) -> Tensor")


def _packed_linear(input: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(input, packed_weight, bias, "none", [], "")


for _key in ("CPU", "MkldnnCPU"):  # the input's key, or the packed weight's where it is the only tensor that counts
    _OPS.impl("packed_linear", _packed_linear, _key)


@torch.library.register_fake("ferry::packed_linear", lib=_OPS)
def _packed_linear_shape(input: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], packed_weight.shape[0]))


packed_linear = torch.ops.ferry.packed_linear
"""``packed_linear(input, packed_weight, bias)``: ``F.linear`` on a weight packed by :func:`_pack`."""


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward pass runs oneDNN's inner product on a weight packed by :func:`pack`, or
    takes its output from its :class:`SiblingGroup` when it belongs to one."""

    packed_weight: torch.Tensor
    group: SiblingGroup | None = None

    def pack(self) -> None:
        """(Re)build the packed copy from the dense weight; call it after changing ``weight``."""
        if self.group is not None:
            self.group.pack()
        else:
            self.packed_weight = _pack(self.weight)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out the packed weight (oneDNN's opaque tensors have no storage to copy)
        and the sibling group (a copy of one layer has no siblings)..."""
        state = self.__dict__.copy()
        state.pop("packed_weight", None)
        state.pop("group", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """...and pack it again from the copied dense weight."""
        super().__setstate__(state)
        self.pack()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _dense(input, self.in_features):
            return self.dense(input)
        if self.group is not None:
            return self.group.output(self, input)
        return packed_linear(input, self.packed_weight, None if self.bias is None else self.bias.detach())

    def dense(self, input: torch.Tensor) -> torch.Tensor:
        """The output through ``F.linear`` on the dense weight (:data:`DENSE_ROWS`)."""
        bias = None if self.bias is None else self.bias.detach()
        return torch.nn.functional.linear(input, self.weight.detach(), bias)


class SiblingGroup:
    """Packed layers that read one input, computed as one: the first member called with an input computes
    every member's output in one oneDNN product and the others take theirs for that same input tensor.
    An input is matched by identity, so a member called with another tensor (a model that feeds them
    different inputs) gets a product of its own; the outputs are held only until every member took its own,
    and each is made contiguous, as a layer's own output is (models ``view`` them)."""

    def __init__(self, members: list[PackedLinear]) -> None:
        self.members = members
        self._sizes = [member.out_features for member in members]
        self._input: torch.Tensor | None = None
        self._outputs: dict[int, torch.Tensor] = {}
        for member in members:
            member.group = self
            member.__dict__.pop("packed_weight", None)  # the group's stacked copy replaces it
        self.pack()

    def pack(self) -> None:
        """(Re)build the stacked packed weight (and bias) from the members' dense ones."""
        self.packed_weight = _pack(torch.cat([member.weight.detach() for member in self.members]))
        biases = [member.bias for member in self.members]
        self.bias = None if biases[0] is None else torch.cat([bias.detach() for bias in biases])

    def stacked(self, input: torch.Tensor) -> torch.Tensor:
        """Every member's output for ``input``, side by side in the last dimension in member order (one product;
        one per member through its dense weight for a single row, :data:`DENSE_ROWS`)."""
        if _dense(input, self.members[0].in_features):
            return torch.cat([member.dense(input) for member in self.members], dim=-1)
        return packed_linear(input, self.packed_weight, self.bias)

    def output(self, member: PackedLinear, input: torch.Tensor) -> torch.Tensor:
        if input is not self._input or id(member) not in self._outputs:
            stacked = self.stacked(input)
            self._input = input
            parts = stacked.split(self._sizes, dim=-1)
            self._outputs = {id(m): part.contiguous() for m, part in zip(self.members, parts, strict=True)}
        output = self._outputs.pop(id(member))
        if not self._outputs:
            self._input = None
        return output


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs here: float32 always; bfloat16 only on a CPU with the instructions its bf16
    path needs (avx512bw/vl/dq or avx_ne_convert), elsewhere bfloat16 layers stay plain ``nn.Linear``."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packs_linear(model: PreTrainedModel) -> bool:
    """Whether :func:`use_packed_linear` applies: a model on CPU, with a torch that has oneDNN."""
    return model.device.type == "cpu" and torch.backends.mkldnn.is_available()


def use_packed_linear(model: PreTrainedModel) -> int:
    """Switch the model's linear layers to :class:`PackedLinear` and group :data:`SIBLINGS` (see the module
    docstring); returns how many layers switched."""
    if not packs_linear(model):
        return 0
    dtypes = packed_dtypes()
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in dtypes:
            module.__class__ = PackedLinear
            cast(PackedLinear, module).pack()  # what it is now, which mypy cannot follow
            count += 1
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if _groupable(members):
                SiblingGroup(members)
    return count


def _groupable(members: list[Any]) -> TypeGuard[list[PackedLinear]]:
    """Packed layers, in no group yet, of one input size, dtype and bias kind."""
    first = members[0]
    return all(
        type(member) is PackedLinear and member.group is None and member.in_features == first.in_features
        and member.weight.dtype == first.weight.dtype and (member.bias is None) == (first.bias is None)
        for member in members
    )


def _dense(input: torch.Tensor, in_features: int) -> bool:
    """Whether ``input`` takes the dense weight's ``F.linear`` (:data:`DENSE_ROWS`)."""
    return input.numel() <= DENSE_ROWS * in_features and input.dtype == torch.float32


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=BATCH_HINT)
