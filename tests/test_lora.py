"""LoRA adapters end to end: ``ferry-api`` and two ``ferry-worker`` processes over a real Redis, adapters
configured (``LORA_MODULES``) and loaded or unloaded at run time (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), selected by ``adapter_id`` (TGI, KServe) and by ``model`` (OpenAI).

Ground truth is peft's merged model (``merge_and_unload``) generating greedily in the test process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.adapters import allowed_folder
from api.app import create_app
from common.settings import Settings, load_settings
from openai import NotFoundError, OpenAI
from tests.helpers import VLLM_ARGS, Stack, require_vllm, start_stack, stop_stack
from tests.sse import sse_data
from worker.tiny_model import make_tiny_lora

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

PROMPT = "def main("
NEW_TOKENS = 8
# The seed's text example (text-stream-infer-api), its parameters as given, with a real adapter.
SEED_PARAMETERS = {
    "decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
    "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10,
    "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "stop": ["stop1", "stop2"],
}

Reference = Callable[[Path | None], list[int]]


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_tiny_lora(tiny_model_path, folder / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> Reference:
    """Greedy ids of :data:`PROMPT` from the base model, or from an adapter merged into it by peft."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    inputs = tokenizer(PROMPT, return_tensors="pt")

    def greedy(adapter: Path | None) -> list[int]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        with torch.inference_mode():
            out = model.eval().generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    return greedy


@pytest.fixture(scope="module")
def lora_stack(redis_url: str, tiny_model_path: Path, adapters: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"LORA_MODULES": json.dumps({"a": str(adapters["a"])}), "LORA_ADAPTER_ROOTS": str(adapters["b"].parent)}
    running = start_stack(redis_url, tiny_model_path, tmp_path_factory.mktemp("lora-stack"), env, workers=2)
    yield running
    stop_stack(running)


def generate(stack: Stack, **parameters: object) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True, **parameters}}
    return httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def post(stack: Stack, route: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{route}", json=body, timeout=60)


def test_an_adapter_is_selected_on_every_protocol(lora_stack: Stack, adapters: dict[str, Path],
                                                  reference: Reference, tiny_model_path: Path) -> None:
    base, adapted = reference(None), reference(adapters["a"])
    assert base != adapted  # else nothing below would show the adapter reaching the model
    assert token_ids(generate(lora_stack)) == base
    assert token_ids(generate(lora_stack, adapter_id="None")) == base
    assert token_ids(generate(lora_stack, adapter_id="a")) == adapted
    text = AutoTokenizer.from_pretrained(tiny_model_path).decode(adapted)
    kserve = post(lora_stack, f"/v2/models/{lora_stack.model_name}/generate",
                  {"text_input": PROMPT, "parameters": {"max_tokens": NEW_TOKENS, "adapter_id": "a"}})
    assert kserve.status_code == 200 and kserve.json()["text_output"] == text, kserve.text
    client = OpenAI(base_url=f"{lora_stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    completion = client.completions.create(model="a", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == text and completion.model == "a"
    metrics = httpx.get(f"{lora_stack.base_url}/metrics").text
    assert f'ferry_lora_request_count_total{{adapter="a",model="{lora_stack.model_name}"}} 3.0' in metrics


def test_the_seed_example_with_an_adapter(lora_stack: Stack) -> None:
    resp = post(lora_stack, "/", {"inputs": "My name is Olivier and I", "stream": False,
                                  "parameters": {**SEED_PARAMETERS, "adapter_id": "a"}})
    assert resp.status_code == 200, resp.text
    [answer] = resp.json()
    assert 1 <= answer["details"]["generated_tokens"] <= 20


def test_models_lists_the_adapters(lora_stack: Stack, adapters: dict[str, Path]) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{lora_stack.base_url}/v1/models").json()["data"]}
    assert cards["a"]["parent"] == lora_stack.model_name and cards["a"]["root"] == str(adapters["a"])
    assert cards[lora_stack.model_name]["parent"] is None
    assert httpx.get(f"{lora_stack.base_url}/v1/models/a").json()["parent"] == lora_stack.model_name


@pytest.mark.parametrize(("route", "body", "status", "fragment"), [
    ("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "nope"}}, 422,
     "the LoRA adapter `nope` is not loaded for model"),
    ("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "bad name"}}, 422,
     "`adapter_id` must be 1 to 256 characters"),
    ("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "x" * 257}}, 422, "`adapter_id` must be"),
    ("/v2/models/{model}/generate", {"text_input": PROMPT, "parameters": {"adapter_id": "nope"}}, 400,
     "the LoRA adapter `nope` is not loaded"),
    ("/v2/models/{model}/infer", {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                              "data": [1, 50, 60]}], "parameters": {"adapter_id": "nope"}}, 400,
     "the LoRA adapter `nope` is not loaded"),
])
def test_unknown_adapters_are_refused_in_each_protocol(lora_stack: Stack, route: str, body: dict[str, object],
                                                       status: int, fragment: str) -> None:
    resp = post(lora_stack, route.format(model=lora_stack.model_name), body)
    assert resp.status_code == status and fragment in resp.json()["error"], resp.text


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"lora_name": "c", "lora_path": "{adapter}/../nonexistent"}, 400, "/nonexistent is not a folder"),
    ({"lora_name": "c", "lora_path": "{adapter}/.."}, 400, "adapter_config.json cannot be read"),
    ({"lora_name": "c", "lora_path": "{model_path}"}, 400, "`lora_path` is not in a folder adapters may be loaded"),
    ({"lora_name": "a", "lora_path": "{adapter}"}, 400, "The lora adapter `a` has already been loaded."),
    ({"lora_name": "bad name", "lora_path": "{adapter}"}, 400, "lora_name"),
    ({"lora_name": "c", "lora_path": "{adapter}", "master_model": "other"}, 404, "The model `other` does not exist"),
    ({"lora_name": "c"}, 400, "lora_path"),
])
def test_load_refusals(lora_stack: Stack, adapters: dict[str, Path], tiny_model_path: Path,
                       body: dict[str, str], status: int, fragment: str) -> None:
    body = {key: value.format(model_path=tiny_model_path, adapter=adapters["b"]) for key, value in body.items()}
    resp = post(lora_stack, "/v1/load_lora_adapter", body)
    assert resp.status_code == status and fragment in resp.json()["error"]["message"], resp.text


def test_adapters_load_only_from_the_allowed_folders(tiny_model_path: Path, adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """loraAdapterRoots and the configured adapters' own folders; any other path, existing or not, reached by a
    symlink or ``..`` or not, gets one refusal naming no path."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(adapters["b"], root / "b")
    shutil.copytree(adapters["b"], outside)  # a real adapter, outside every allowed folder
    (root / "escape").symlink_to(outside)
    settings = Settings(model_path=tiny_model_path, lora_modules={"a": str(adapters["a"])}, lora_adapter_roots=[root])
    refusal = "The lora adapter `x` cannot be loaded: `lora_path` is not in a folder adapters may be loaded from"
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as client:
        for path in (outside, tmp_path / "missing", "/etc", root / "escape", f"{root}/b/../../outside", "a\x00b"):
            resp = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
            assert resp.status_code == 400 and resp.json()["error"]["message"] == refusal + " (loraAdapterRoots)"
        inside = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "nope")})
        assert inside.status_code == 400 and "is not a folder" in inside.json()["error"]["message"]
        for name, path in (("b", root / "b"), ("again", adapters["a"])):
            resp = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert resp.status_code == 200, resp.text
    default = Settings(model_path=tiny_model_path, lora_modules={"a": str(adapters["a"])})
    assert not allowed_folder(default, str(root / "b")) and allowed_folder(default, str(adapters["a"]))
    assert load_settings(lora_adapter_roots=f"{root}, {outside}").lora_adapter_roots == [root, outside]


def test_unload_of_an_unknown_adapter_is_404(lora_stack: Stack) -> None:
    resp = post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert resp.status_code == 404 and "cannot be found" in resp.json()["error"]["message"], resp.text


def test_load_use_unload_and_reuse_at_run_time(lora_stack: Stack, adapters: dict[str, Path],
                                               reference: Reference) -> None:
    """Both workers serve an adapter loaded at run time; after an unload it is refused, OpenAI's ``model`` too
    (not answered by the only model); loaded again under the same name from another folder, the workers serve
    the new weights."""
    resp = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'b' added successfully.", resp.text

    async def many(adapter: str, count: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=lora_stack.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/generate", json={"inputs": PROMPT, "parameters": {
                "max_new_tokens": NEW_TOKENS, "details": True, "adapter_id": adapter}}) for _ in range(count)))

    expected = reference(adapters["b"])
    assert all(token_ids(resp) == expected for resp in asyncio.run(many("b", 8)))
    resp = post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'b' removed successfully.", resp.text
    assert generate(lora_stack, adapter_id="b").status_code == 422
    client = OpenAI(base_url=f"{lora_stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(NotFoundError) as caught:
        client.completions.create(model="b", prompt=PROMPT, max_tokens=NEW_TOKENS)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    resp = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["a"])})
    assert resp.status_code == 200, resp.text
    assert all(token_ids(resp) == reference(adapters["a"]) for resp in asyncio.run(many("b", 8)))
    assert post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200


def test_unload_lets_running_requests_finish(lora_stack: Stack, adapters: dict[str, Path]) -> None:
    """An adapter unloaded while a request streams with it: the stream runs to its end with the adapter."""
    resp = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["b"])})
    assert resp.status_code == 200, resp.text
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 300, "adapter_id": "c", "details": True}}
    with httpx.stream("POST", f"{lora_stack.base_url}/generate_stream", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
        events = sse_data("\n".join([first, *lines]))
    assert len(events) == 300 and events[-1]["details"]["finish_reason"] == "length"
    assert all("error" not in event for event in events)


def test_the_vllm_engine_serves_the_same_adapter(redis_url: str, tiny_model_path: Path, adapters: dict[str, Path],
                                                 lora_stack: Stack, reference: Reference,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """The vllm engine (vLLM's LoRA requests) answers an adapter's request as the built-in engine does."""
    require_vllm()
    env = {"ENGINE": "vllm", "VLLM_ENGINE_ARGS": json.dumps(VLLM_ARGS),
           "LORA_MODULES": json.dumps({"a": str(adapters["a"])}), "LORA_ADAPTER_ROOTS": str(adapters["b"].parent)}
    vllm = start_stack(redis_url, tiny_model_path, tmp_path_factory.mktemp("lora-vllm"), env)
    try:
        for adapter in ("a", "None"):
            assert token_ids(generate(vllm, adapter_id=adapter)) == token_ids(generate(lora_stack, adapter_id=adapter))
        resp = post(vllm, "/", {"inputs": "My name is Olivier and I",
                                "parameters": {**SEED_PARAMETERS, "adapter_id": "a"}})
        assert resp.status_code == 200, resp.text
        loaded = post(vllm, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
        assert loaded.status_code == 200, loaded.text
        assert token_ids(generate(vllm, adapter_id="b")) == reference(adapters["b"])  # loaded at run time
    finally:
        stop_stack(vllm)
