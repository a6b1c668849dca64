"""The Llama-family decode step gives bit-identical logits to the model's forward, and only takes what it can."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.protocol import SamplingParams
from worker.attention import use_padded_attention
from worker.batch import DecodeBatch, ForwardArgs
from worker.cpu_linear import use_packed_linear
from worker.llama_decode import LlamaDecodeStep

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def served_model(model_type: str, **overrides: object) -> PreTrainedModel:
    """A random model of ``model_type`` prepared as ``TransformersEngine.load`` prepares one."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    use_padded_attention(model)
    use_packed_linear(model)
    return model


def prefill(model: PreTrainedModel, forward: ForwardArgs, prompts: list[list[int]]) -> DecodeBatch:
    params = [SamplingParams(seed=0, max_new_tokens=16) for _ in prompts]
    batch, *_ = DecodeBatch.prefill(model, prompts, params, 0, [False] * len(prompts), forward, [None] * len(prompts))
    return batch


def assert_same_steps(model: PreTrainedModel, prompts: list[list[int]], steps: int = 6,
                      edit: Callable[[DecodeBatch], None] | None = None) -> None:
    """Decode ``steps`` tokens through the decode step and through the model's forward, from the same prompts,
    comparing logits bit for bit at every step (``edit`` changes both batches after the second step)."""
    forward = ForwardArgs.of(model)
    assert forward.decode_step is not None
    plain = dataclasses.replace(forward, decode_step=None)
    with torch.inference_mode():
        lean, reference = prefill(model, forward, prompts), prefill(model, plain, prompts)
        for step in range(steps):
            mask = torch.cat([lean.attention_mask, lean.attention_mask.new_ones((lean.size, 1))], dim=1)
            logits = forward.decode_step(lean.next_ids, mask[:, None, None, :], lean.positions, lean.cache)
            expected = plain.call(model, reference.next_ids, mask[:, None, None, :], reference.positions,
                                  reference.cache)
            assert logits.shape == expected.shape and torch.equal(logits, expected), f"step {step}"
            for batch in (lean, reference):
                batch.attention_mask = mask
                batch.next_ids = expected[:, -1].argmax(-1, keepdim=True)
                batch.positions = batch.positions + 1
            if step == 1 and edit is not None:
                edit(lean)
                edit(reference)


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 4}),  # multi-head attention: no grouped heads
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("mistral", {"sliding_window": None}),  # (its default config has a sliding window)
    ("qwen2", {}),  # biased q/k/v products
])
def test_the_step_equals_the_models_forward(model_type: str, overrides: dict[str, object]) -> None:
    model = served_model(model_type, **overrides)
    assert_same_steps(model, [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]])  # left padding in two rows
    assert_same_steps(model, [[3, 4, 5]])  # one row: the products' dense path


def test_the_step_equals_the_forward_after_filter_and_merge() -> None:
    model = served_model("llama")
    forward = ForwardArgs.of(model)

    def filter_and_merge(batch: DecodeBatch) -> None:
        batch.filter([2, 0])
        batch.merge(prefill(model, forward, [[40, 41, 42, 43, 44, 45, 46, 47]]))  # a wider cache joins

    assert_same_steps(model, [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], steps=8, edit=filter_and_merge)


def test_decode_takes_the_step_and_a_peft_model_its_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = served_model("llama")
    forward = ForwardArgs.of(model)
    calls: list[int] = []
    step = LlamaDecodeStep.__call__
    monkeypatch.setattr(LlamaDecodeStep, "__call__", lambda self, *args: calls.append(1) or step(self, *args))
    with torch.inference_mode():
        batch = prefill(model, forward, [[5, 6, 7]])
        batch.decode(model, forward)
        assert calls == [1]
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    with torch.inference_mode():
        batch = prefill(wrapped, forward, [[5, 6, 7]])
        batch.decode(wrapped, forward)  # through peft's layers, which the step would skip
    assert calls == [1]


@pytest.mark.parametrize("model_type,overrides,packed", [
    ("llama", {}, False),  # no grouped packed products (a GPU, or a torch without oneDNN)
    ("mistral", {"sliding_window": 4}, True),  # sliding-window attention
    ("qwen3", {"head_dim": 16}, True),  # q/k norms
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}, True),
    ("llama", {"hidden_act": "gelu"}, True),
])
def test_models_it_does_not_reproduce_keep_their_forward(model_type: str, overrides: dict[str, object],
                                                         packed: bool) -> None:
    torch.manual_seed(0)
    shape = {} if model_type == "gpt2" else SHAPE
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    use_padded_attention(model)
    if packed:
        use_packed_linear(model)
    assert LlamaDecodeStep.of(model) is None and ForwardArgs.of(model).decode_step is None
