"""oneDNN-packed linear layers compute what ``nn.Linear`` computes, and only CPU float models switch."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.cpu_linear import PackedLinear, use_packed_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


def test_a_half_precision_model_keeps_nn_linear(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).eval()
    assert use_packed_linear(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())
