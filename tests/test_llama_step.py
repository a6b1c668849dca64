"""The Llama-family step (decode steps and prompt passes) gives bit-identical logits to the model's forward, and
only takes what it can; compiled, it gives the same logits within float rounding, with no graph built after
load, and a worker serves the same tokens with it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import torch._dynamo
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.protocol import SamplingParams
from worker.attention import use_padded_attention
from worker.batch import DecodeBatch, ForwardArgs
from worker.cpu_linear import use_packed_linear
from tests.conftest import start_stack, stop_stack
from worker.llama_step import LlamaStep

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


def prefill(model: PreTrainedModel, forward: ForwardArgs, prompts: list[list[int]],
            details: bool = False) -> DecodeBatch:
    return prefill_scores(model, forward, prompts, details)[0]


def prefill_scores(model: PreTrainedModel, forward: ForwardArgs, prompts: list[list[int]],
                   details: bool = False) -> tuple[DecodeBatch, torch.Tensor]:
    """The batch after the prompt pass, and the logprobs of the rows' first tokens."""
    params = [SamplingParams(seed=0, max_new_tokens=16) for _ in prompts]
    batch, _, logprobs, _ = DecodeBatch.prefill(model, prompts, params, 0, [details] * len(prompts), forward,
                                                [None] * len(prompts))
    return batch, logprobs


def assert_same_steps(model: PreTrainedModel, prompts: list[list[int]], steps: int = 6,
                      edit: Callable[[DecodeBatch], None] | None = None, forward: ForwardArgs | None = None) -> None:
    """Run the prompts and decode ``steps`` tokens through the step (``forward``'s, else an eager one) and through
    the model's forward, comparing the first tokens and their logprobs, then the logits at every step: bit for
    bit, or within float rounding for a compiled step (``edit`` changes both batches after the second step)."""
    forward = forward or ForwardArgs.of(model)
    assert forward.step is not None
    compiled = forward.step.compiled is not None
    plain = dataclasses.replace(forward, step=None)
    with torch.inference_mode():
        (lean, lean_scores), (reference, scores) = prefill_scores(model, forward, prompts), prefill_scores(
            model, plain, prompts)
        assert torch.equal(lean.next_ids, reference.next_ids)
        if compiled:
            torch.testing.assert_close(lean_scores, scores, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(lean_scores, scores)
        for step in range(steps):
            mask = torch.cat([lean.attention_mask, lean.attention_mask.new_ones((lean.size, 1))], dim=1)
            logits = forward.step(lean.next_ids, mask[:, None, None, :], lean.positions, lean.cache)
            expected = plain.call(model, reference.next_ids, mask[:, None, None, :], reference.positions,
                                  reference.cache)
            assert logits.shape == expected.shape, f"step {step}"
            if compiled:
                torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5, msg=f"step {step}")
            else:
                assert torch.equal(logits, expected), f"step {step}"
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


def test_passes_take_the_step_and_a_peft_model_or_prompt_details_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = served_model("llama")
    forward = ForwardArgs.of(model)
    calls: list[int] = []
    step = LlamaStep.__call__
    monkeypatch.setattr(LlamaStep, "__call__", lambda self, *args: calls.append(1) or step(self, *args))
    with torch.inference_mode():
        batch = prefill(model, forward, [[5, 6, 7]])
        batch.decode(model, forward)
        assert calls == [1, 1]  # the prompt pass, the decode step
        prefill(model, forward, [[5, 6, 7]], details=True)  # every prompt position's logits: the forward
        assert calls == [1, 1]
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    with torch.inference_mode():
        batch = prefill(wrapped, forward, [[5, 6, 7]])
        batch.decode(wrapped, forward)  # through peft's layers, which the step would skip
    assert calls == [1, 1]


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
    assert LlamaStep.of(model) is None and ForwardArgs.of(model).step is None


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("qwen2", {"num_key_value_heads": 4}),  # biased q/k/v products, multi-head attention
])
def test_the_compiled_step_equals_the_forward_without_new_graphs(model_type: str,
                                                                overrides: dict[str, object]) -> None:
    """Rows, prompt widths, cache lengths and buffers change from pass to pass (a filter, a merge, buffers that
    fill up and grow): the graphs built at load serve them all, and the passes they do not take run eagerly."""
    model = served_model(model_type, **overrides)
    forward = ForwardArgs.of(model, compile_model=True)
    step = forward.step
    assert step is not None and step.compiled is not None
    calls: list[tuple[int, int]] = []  # (rows, new positions) of each compiled pass
    graph = step.compiled
    step.compiled = lambda *args: calls.append(tuple(args[0].shape)) or graph(*args)

    def filter_and_merge(batch: DecodeBatch) -> None:
        batch.filter([2, 0])
        batch.merge(prefill(model, forward, [[40, 41, 42, 43, 44, 45, 46, 47], [50, 51]]))  # a wider cache

    with torch._dynamo.config.patch(error_on_recompile=True):
        assert_same_steps(model, [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], steps=40, edit=filter_and_merge,
                          forward=forward)  # 40 steps: past the buffers' spare positions
        assert set(calls) == {(3, 5), (3, 1), (2, 8), (4, 1)}
        calls.clear()
        assert_same_steps(model, [[3, 4, 5]], forward=forward)  # one row: its decode steps run eagerly
        assert calls == [(1, 3)]
        assert_same_steps(model, [[3], [4]], steps=1, forward=forward)  # one-token prompts, a one-position cache
    assert calls == [(1, 3)]


def test_a_step_that_does_not_compile_stays_eager(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Inductor fails where it has no C++ compiler: the worker still serves, with the eager step."""
    def failing(*args: object) -> None:
        raise RuntimeError("no C++ compiler found\n(details)")

    monkeypatch.setattr(torch, "compile", lambda function, **options: failing)
    model = served_model("llama")
    with caplog.at_level(logging.WARNING, logger="worker.llama_step"):
        forward = ForwardArgs.of(model, compile_model=True)
    assert forward.step is not None and forward.step.compiled is None
    assert "the model's passes stay eager: torch.compile failed: no C++ compiler found" in caplog.text
    assert_same_steps(model, [[5, 6, 7], [8, 9]], forward=forward)


def test_a_compiling_worker_serves_the_same_tokens(redis_url: str, tiny_model_path: Path,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """The served default (COMPILE_MODEL on): a worker compiles its step at start and serves concurrent
    requests with the same greedy tokens as an eager worker."""
    prompts = ["The river runs", "A small boat", "Under the bridge the water"]
    generated: dict[str, list[list[int]]] = {}
    for setting in ("true", "false"):
        log_dir = tmp_path_factory.mktemp(f"compile-{setting}")
        # A compile with a cold Inductor cache (a fresh clone, a loaded CI machine) took over 120 s.
        stack = start_stack(redis_url, tiny_model_path, log_dir, {"COMPILE_MODEL": setting}, health_timeout=360)
        try:
            def generate(prompt: str) -> list[int]:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True, "do_sample": False}}
                answer = httpx.post(f"{stack.base_url}/generate", json=body, timeout=120)
                assert answer.status_code == 200, answer.text
                return [token["id"] for token in answer.json()["details"]["tokens"]]

            with ThreadPoolExecutor(len(prompts)) as pool:
                generated[setting] = list(pool.map(generate, prompts))
        finally:
            stop_stack(stack)
        compiled = "compiled the model's decode steps and prompt passes in" in (log_dir / "worker0.log").read_text()
        assert compiled == (setting == "true")
    assert generated["true"] == generated["false"]
    assert all(generated["true"])
