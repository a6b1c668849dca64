"""LoRA adapters in both engines (the same tests): each adapter's output is peft's merged model's, adapters and
the base model share batches without changing any row, adapters are freed on unload (at once, or after their
last request), and an adapter that cannot be loaded is refused without harming what the engine serves.

Ground truth is peft's merged model (``merge_and_unload``) generating greedily, and the base model's
``generate``; the end-to-end tests through the API are in tests/test_lora.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common.protocol import Job, TokenEvent
from common.settings import Settings
from tests.helpers import ENGINES, PROMPTS, VLLM_ARGS, collect, greedy_reference, make_job, require_vllm, token_ids
from tests.helpers import run_complete as run  # the built-in engine fails no request here
from worker import tiny_model
from worker.cpu_linear import PackedLinear
from worker.engine import Engine, RequestRefused, load_engine
from worker.tiny_model import make_tiny_lora
from worker.transformers_engine import TransformersEngine

pytestmark = pytest.mark.integration  # a real model's forward passes, checked against references

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_tiny_lora(tiny_model_path, folder / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def prompts(tiny_model_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return [tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="module", params=ENGINES)
def shared_engine(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[Engine]:
    """One engine per kind for the module (vLLM with LoRA on, two adapters per batch)."""
    kind = request.param
    if kind == "vllm":
        require_vllm()
    engine = load_engine(Settings(model_path=tiny_model_path, engine=kind, vllm_engine_args={
        **VLLM_ARGS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}))
    yield engine
    engine.close()


@pytest.fixture
def engine(shared_engine: Engine) -> Iterator[Engine]:
    """Each engine kind, left idle by the test and with its adapters unloaded after it."""
    yield shared_engine
    for name in list(shared_engine.adapters.loaded):
        shared_engine.unload_adapter(name)
    assert shared_engine.idle and not shared_engine.adapters.loaded and not lora_layers(shared_engine)


@pytest.fixture
def built_in(tiny_model_path: Path) -> Iterator[TransformersEngine]:
    """A fresh built-in engine, for what only it does (peft's layers over the model's own)."""
    engine = TransformersEngine.load(Settings(model_path=tiny_model_path))
    yield engine
    engine.close()


def merged_reference(base: Path, adapter: Path | None, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy ids from the base model, or from peft's merge of ``adapter`` into it."""
    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.inference_mode():
        return greedy_reference(model.eval(), input_ids, max_new_tokens)


def adapter_job(input_ids: list[int], adapter: tuple[str, Path] | None, max_new_tokens: int = NEW_TOKENS) -> Job:
    job = make_job(input_ids, max_new_tokens=max_new_tokens)
    if adapter is None:
        return job
    name, path = adapter
    return job.model_copy(update={"adapter": name, "adapter_path": str(path)})


def alone(engine: Engine, job: Job) -> list[int]:
    """The job's ids when it runs by itself (a fresh request id, the engine idle before and after)."""
    assert engine.idle
    copy = make_job(job.input_ids).model_copy(
        update={"params": job.params, "adapter": job.adapter, "adapter_path": job.adapter_path})
    return token_ids(run(engine, {0: [copy]})[copy.request_id])


def lora_layers(engine: Engine) -> list[BaseTunerLayer]:
    """The built-in engine's peft layers (none for vLLM, whose layers are its own)."""
    model = getattr(engine, "model", None)
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)] if model else []


def loaded(engine: Engine) -> set[str]:
    """The adapters the engine holds; in the built-in engine, those its model's LoRA layers hold too."""
    names = set(engine.adapters.loaded)
    if isinstance(engine, TransformersEngine):
        assert names == {name for layer in lora_layers(engine) for name in layer.lora_A}
    return names


# -- outputs -----------------------------------------------------------------------------------------


def test_an_adapter_generates_what_its_merged_model_does(
    engine: Engine, adapters: dict[str, Path], prompts: list[list[int]], tiny_model_path: Path
) -> None:
    for prompt in prompts[:3]:
        base = merged_reference(tiny_model_path, None, prompt, NEW_TOKENS)
        adapted = merged_reference(tiny_model_path, adapters["a"], prompt, NEW_TOKENS)
        assert adapted != base  # else nothing here would show the adapter reaching the model
        assert alone(engine, adapter_job(prompt, ("a", adapters["a"]))) == adapted
        assert alone(engine, adapter_job(prompt, None)) == base
    # peft wrapped the oneDNN-packed linear layers, and runs them as they are
    if isinstance(engine, TransformersEngine):
        layers = lora_layers(engine)
        assert layers and all(isinstance(layer.get_base_layer(), PackedLinear) for layer in layers)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(
    engine: Engine, adapters: dict[str, Path], prompts: list[list[int]]
) -> None:
    choices = [None, ("a", adapters["a"]), ("b", adapters["b"])]
    # Three requests of each (base, a, b), added together, of different lengths (rows leave at different
    # steps), then one more joining the running batch.
    together = [adapter_job(prompts[index], choice, max_new_tokens=4 + 5 * index + 2 * order)
                for order, choice in enumerate(choices) for index in range(3)]
    late = adapter_job(prompts[3], choices[1], max_new_tokens=10)
    events = run(engine, {0: together, 3: [late]})
    assert loaded(engine) == {"a", "b"}
    batched = {job.request_id: token_ids(events[job.request_id]) for job in [*together, late]}
    # the same prompt through the base model and each adapter: three different outputs
    assert len({tuple(batched[together[order * 3].request_id][:4]) for order in range(3)}) == 3
    for job in [*together, late]:
        assert batched[job.request_id] == alone(engine, job), job.adapter


# -- unloading ---------------------------------------------------------------------------------------


def test_an_unused_adapter_is_freed_at_once(
    engine: Engine, adapters: dict[str, Path], prompts: list[list[int]], tiny_model_path: Path
) -> None:
    prompt = prompts[0]
    assert alone(engine, adapter_job(prompt, ("a", adapters["a"]))) == merged_reference(
        tiny_model_path, adapters["a"], prompt, NEW_TOKENS)
    engine.unload_adapter("a")
    assert not loaded(engine) and not lora_layers(engine)  # the last adapter gone, the model is unwrapped
    engine.unload_adapter("a")  # not loaded: nothing
    # the name again, with another folder: the new weights
    assert alone(engine, adapter_job(prompt, ("a", adapters["b"]))) == merged_reference(
        tiny_model_path, adapters["b"], prompt, NEW_TOKENS)
    assert alone(engine, adapter_job(prompt, None)) == merged_reference(tiny_model_path, None, prompt, NEW_TOKENS)


def test_an_adapter_in_use_is_freed_after_its_last_request(
    engine: Engine, adapters: dict[str, Path], prompts: list[list[int]], tiny_model_path: Path
) -> None:
    prompt = prompts[1]
    job = adapter_job(prompt, ("a", adapters["a"]), max_new_tokens=20)
    other = adapter_job(prompt, ("b", adapters["b"]), max_new_tokens=20)
    events: dict[str, list[TokenEvent]] = {}
    engine.add(job)
    engine.add(other)
    for _ in range(3):
        collect(engine.step(), events)
    engine.unload_adapter("a")
    assert loaded(engine) == {"a", "b"}
    with pytest.raises(RequestRefused, match="running requests still use its weights from"):
        engine.add(adapter_job(prompt, ("a", adapters["b"])))
    run(engine, {}, events)
    assert token_ids(events[job.request_id]) == merged_reference(tiny_model_path, adapters["a"], prompt, 20)
    assert token_ids(events[other.request_id]) == merged_reference(tiny_model_path, adapters["b"], prompt, 20)
    assert loaded(engine) == {"b"}
    # a cancelled request is a last request too
    cancelled = adapter_job(prompt, ("b", adapters["b"]), max_new_tokens=20)
    engine.add(cancelled)
    collect(engine.step(), events)
    engine.unload_adapter("b")
    assert loaded(engine) == {"b"}
    engine.cancel(cancelled.request_id)
    engine.step()
    assert engine.idle and not loaded(engine)


# -- adapters that cannot be loaded --------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_adapters(tiny_model_path: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, tuple[Path, str]]:
    """Folders no adapter loads from, each with (a part of) the reason the engine gives."""
    folder = tmp_path_factory.mktemp("bad-adapters")
    narrow = folder / "narrow-model"  # a Llama of another hidden size: its adapter's shapes do not fit
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(narrow)
    # an adapter of a layer type LoRA does not support, after one it does: peft fails half-way in
    half_way = shutil.copytree(adapters["a"], folder / "half-way")
    adapter_config = json.loads((half_way / "adapter_config.json").read_text())
    adapter_config["target_modules"] = ["q_proj", "input_layernorm"]
    (half_way / "adapter_config.json").write_text(json.dumps(adapter_config))
    return {
        "missing": (folder / "nothing-here", "no such folder"),
        "not an adapter": (tiny_model_path, "holds no peft adapter (no adapter_config.json)"),
        "another model's": (make_tiny_lora(narrow, folder / "narrow"), "size mismatch for"),
        "half-way": (half_way, "is not supported"),
    }


@pytest.mark.parametrize("kind", ["missing", "not an adapter", "another model's", "half-way"])
@pytest.mark.parametrize("first", [True, False], ids=["first adapter", "beside another"])
def test_an_adapter_that_cannot_be_loaded_is_refused_and_leaves_the_engine_serving(
    engine: Engine, adapters: dict[str, Path], bad_adapters: dict[str, tuple[Path, str]],
    prompts: list[list[int]], tiny_model_path: Path, kind: str, first: bool,
) -> None:
    prompt = prompts[2]
    good = adapter_job(prompt, ("a", adapters["a"]))
    if not first:
        alone(engine, good)
    modules = dict(engine.model.named_modules()) if isinstance(engine, TransformersEngine) else {}
    path, reason = bad_adapters[kind]
    with pytest.raises(RequestRefused) as refused:
        engine.add(adapter_job(prompt, ("bad", path)))
    message = str(refused.value)
    assert message.startswith(f"the LoRA adapter `bad` cannot be loaded from {path}: "), message
    assert "\n" not in message and len(message) < 600
    assert reason in message
    if isinstance(engine, TransformersEngine):
        assert dict(engine.model.named_modules()) == modules  # the model as it was
    assert engine.idle
    assert alone(engine, adapter_job(prompt, None)) == merged_reference(tiny_model_path, None, prompt, NEW_TOKENS)
    assert alone(engine, good) == merged_reference(tiny_model_path, adapters["a"], prompt, NEW_TOKENS)
    assert loaded(engine) == {"a"}


def test_the_base_models_row_name(engine: Engine, adapters: dict[str, Path], prompts: list[list[int]],
                                  tiny_model_path: Path) -> None:
    """peft names the rows without adapter ``__base__``: the built-in engine refuses it as an adapter's name
    (it would silently run the base model); vLLM has no such name and serves it as any other."""
    job = adapter_job(prompts[0], ("__base__", adapters["a"]))
    if isinstance(engine, TransformersEngine):
        with pytest.raises(RequestRefused, match="the name is reserved"):
            engine.add(job)
        assert engine.idle and not loaded(engine)
    else:
        assert alone(engine, job) == merged_reference(tiny_model_path, adapters["a"], prompts[0], NEW_TOKENS)


# -- ferry-tiny-model --kind lora ----------------------------------------------------------------------


def test_the_cli_makes_an_adapter_peft_loads(tiny_model_path: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    tiny_model.main(["--kind", "lora", str(tiny_model_path), str(tmp_path / "lora"), "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "lora")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "lora")
    assert model.peft_config["default"].r == 8
    with pytest.raises(SystemExit):
        tiny_model.main(["--kind", "lora", str(tmp_path / "lora-without-base")])
    assert "--kind lora takes two folders, BASE and DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tiny_model.main([str(tiny_model_path), str(tmp_path / "llm")])
    assert "--kind llm takes one folder, DIR" in capsys.readouterr().err
