"""oneDNN-packed linear layers compute what ``nn.Linear`` computes, and only CPU float models switch."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.cpu_linear import DENSE_ROWS, PackedLinear, SiblingGroup, packed_dtypes, use_packed_linear


@pytest.mark.parametrize("dtype", packed_dtypes())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64)])
def test_packed_linear_equals_nn_linear(dtype: torch.dtype, bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=bias, dtype=dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        expected = layer(x)
        layer.__class__ = PackedLinear
        layer.pack()
        output = layer(x)
    assert output.shape == expected.shape and output.dtype == dtype
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(output, expected, **tolerance)


def test_pack_follows_a_changed_weight() -> None:
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = PackedLinear
    layer.pack()
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer.weight.mul_(2)
        layer.pack()
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_packed_layer_survives_deepcopy_and_pickle() -> None:
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = PackedLinear
    layer.pack()
    x = torch.randn(3, 16)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is PackedLinear and clone.weight is not layer.weight
        torch.testing.assert_close(clone(x), layer(x))


def test_a_cpu_model_switches_every_float_linear(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.tensor([[1, 20, 30, 40]])
    with torch.inference_mode():
        expected = model(ids).logits
        assert use_packed_linear(model) == len(linears) > 0
        output = model(ids).logits
    assert all(type(m) is PackedLinear for m in linears)
    assert use_packed_linear(model) == 0  # already switched: nothing left to do
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)


def test_siblings_share_one_packed_product(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    use_packed_linear(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.group is attention.k_proj.group is attention.v_proj.group is not None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None
    assert attention.o_proj.group is None and mlp.down_proj.group is None
    assert not hasattr(attention.q_proj, "packed_weight")  # the group's stacked copy replaces the members'


def _group(sizes: list[int], bias: bool = True) -> list[PackedLinear]:
    torch.manual_seed(0)
    layers = []
    for size in sizes:
        layer = torch.nn.Linear(32, size, bias=bias)
        layer.__class__ = PackedLinear
        layer.pack()
        layers.append(layer)
    SiblingGroup(layers)
    return layers


def _reference(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


@pytest.mark.parametrize("bias", [True, False])
def test_a_group_gives_each_member_its_own_output(bias: bool) -> None:
    first, second, third = _group([16, 8, 8], bias)
    x, y = torch.randn(4, 3, 32), torch.randn(4, 3, 32)
    with torch.inference_mode():
        outputs = [third(x), first(x), second(y), second(y), first(x)]  # any order, other inputs, repeats
        expected = [_reference(third, x), _reference(first, x), _reference(second, y), _reference(second, y),
                    _reference(first, x)]
    for output, want in zip(outputs, expected, strict=True):
        assert output.is_contiguous()
        torch.testing.assert_close(output, want, atol=1e-5, rtol=1e-5)


def test_a_group_follows_a_changed_member_weight() -> None:
    first, second = _group([16, 8])
    x = torch.randn(5, 32)
    with torch.no_grad():
        second.weight.mul_(3)
        second.pack()
        torch.testing.assert_close(second(x), _reference(second, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(first(x), _reference(first, x), atol=1e-5, rtol=1e-5)


def test_a_copy_of_a_member_stands_alone() -> None:
    first, _ = _group([16, 8])
    x = torch.randn(5, 32)
    clone = copy.deepcopy(first)
    assert clone.group is None
    torch.testing.assert_close(clone(x), _reference(first, x), atol=1e-5, rtol=1e-5)


def test_a_single_row_takes_the_dense_weight() -> None:
    """MKL's matrix-vector product on the dense weight: the same numbers as ``F.linear``, bit for bit."""
    first, _ = _group([16, 8])
    with torch.inference_mode():
        for rows in range(1, DENSE_ROWS + 1):
            x = torch.randn(1, rows, 32)
            assert torch.equal(first(x), _reference(first, x))


def test_a_bfloat16_model_switches_only_where_onednn_packs_bfloat16(tiny_model_path: Path) -> None:
    """On a CPU without oneDNN's bf16 instructions the layers stay nn.Linear rather than fail at load."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.tensor([[1, 20, 30, 40]])
    with torch.inference_mode():
        expected = model(ids).logits
        switched = use_packed_linear(model)
        output = model(ids).logits
    assert switched == (len(linears) if torch.bfloat16 in packed_dtypes() else 0)
    torch.testing.assert_close(output, expected, atol=5e-2, rtol=5e-2)


def test_a_cpu_without_bfloat16_packing_keeps_bfloat16_layers(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CI machines' CPUs lack those instructions; this one may not, so it is told so."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert packed_dtypes() == (torch.float32,)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()
    assert use_packed_linear(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())


def test_a_half_precision_model_keeps_nn_linear(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).eval()
    assert use_packed_linear(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())
