"""The Llama-family step (decode steps and prompt passes) gives bit-identical logits to the model's forward, and
only takes what it can; compiled, it gives the same logits within float rounding, with no graph built after
the compile, and a worker serves at once, eagerly, then the same tokens with its compiled passes."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import torch._dynamo
from peft import LoraConfig, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.protocol import SamplingParams
from tests.helpers import free_port, start_stack, stop_stack
from worker.attention import use_padded_attention
from worker.batch import DecodeBatch, ForwardArgs
from worker.cpu_linear import use_packed_linear
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


@pytest.mark.integration  # compiles the step (torch.compile): tens of seconds
@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("qwen2", {"num_key_value_heads": 4}),  # biased q/k/v products, multi-head attention
])
def test_the_compiled_step_equals_the_forward_without_new_graphs(model_type: str,
                                                                overrides: dict[str, object]) -> None:
    """Rows, prompt widths, cache lengths and buffers change from pass to pass (a filter, a merge, buffers that
    fill up and grow): the graphs built at load serve them all, and the passes they do not take run eagerly."""
    model = served_model(model_type, **overrides)
    forward = ForwardArgs.of(model)
    step = forward.step
    assert step is not None and step.compile()
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
    forward = ForwardArgs.of(model)
    assert forward.step is not None
    with caplog.at_level(logging.WARNING, logger="worker.llama_step"):
        forward.step.compile_behind()
        forward.step.wait_compiled()
    assert forward.step.compiled is None
    assert "the model's passes stay eager: torch.compile failed: no C++ compiler found" in caplog.text
    assert_same_steps(model, [[5, 6, 7], [8, 9]], forward=forward)


def test_a_compiling_worker_serves_at_once_then_compiled(redis_url: str, tiny_model_path: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """The served default (COMPILE_MODEL on): a worker is healthy and answers as soon as its model is loaded,
    eagerly, while it compiles behind; once compiled (its log and its ``ferry_worker_compiled`` gauge say so)
    it answers concurrent requests with the same greedy tokens. A stop during the compile is a clean one."""
    prompts = ["The river runs", "A small boat", "Under the bridge the water"]
    log_dir = tmp_path_factory.mktemp("compile")
    worker_log = log_dir / "worker0.log"
    metrics_port = free_port()
    stack = start_stack(redis_url, tiny_model_path, log_dir,
                        {"COMPILE_MODEL": "true", "WORKER_METRICS_PORT": str(metrics_port)})
    try:
        def generate_all() -> list[list[int]]:
            def generate(prompt: str) -> list[int]:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True, "do_sample": False}}
                answer = httpx.post(f"{stack.base_url}/generate", json=body, timeout=120)
                assert answer.status_code == 200, answer.text
                return [token["id"] for token in answer.json()["details"]["tokens"]]

            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(generate, prompts))

        def compiled() -> float:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
            return next(sample.value for family in text_string_to_metric_families(text)
                        for sample in family.samples if sample.name == "ferry_worker_compiled")

        eager = generate_all()
        log_text = worker_log.read_text()
        assert "compiling the model's decode steps and prompt passes" in log_text
        assert "compiled the model's decode steps and prompt passes in" not in log_text  # still compiling
        assert compiled() == 0
        # A compile with a cold Inductor cache (a fresh clone, a loaded CI machine) took over 120 s.
        deadline = time.monotonic() + 400
        while compiled() != 1:
            assert time.monotonic() < deadline, "the worker did not finish compiling"
            time.sleep(1)
        assert "compiled the model's decode steps and prompt passes in" in worker_log.read_text()
        assert generate_all() == eager and all(eager)
    finally:
        stop_stack(stack)
    assert stack.processes[0].returncode == 0  # the worker


def test_a_worker_stopped_while_it_compiles_stops_cleanly(redis_url: str, tiny_model_path: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """The compile thread does not hold up a stop: the worker exits at once, with status 0."""
    log_dir = tmp_path_factory.mktemp("compile-stop")
    stack = start_stack(redis_url, tiny_model_path, log_dir, {"COMPILE_MODEL": "true"})
    stop_stack(stack)
    assert "compiled the model's decode steps and prompt passes in" not in (log_dir / "worker0.log").read_text()
    assert stack.processes[0].returncode == 0  # the worker
