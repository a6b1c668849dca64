"""End to end with the vLLM engine: ``ferry-api`` + ``ferry-worker --engine vllm`` over a real Redis, driven by
the real clients (text-generation, huggingface_hub, openai, tritonclient). Every answer is compared with the
same request served by the built-in engine's stack: whichever engine runs, clients see the same greedy text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from huggingface_hub import InferenceClient
from text_generation import Client

from openai import OpenAI
from tests.helpers import VLLM_ARGS, Stack, require_vllm, start_stack, stop_stack

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

PROMPT = "def main("


@pytest.fixture(scope="module")
def vllm_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The tiny model behind the vLLM engine, with TGI's int stream ids (what the text-generation client reads)."""
    require_vllm()
    env = {"ENGINE": "vllm", "VLLM_ENGINE_ARGS": json.dumps(VLLM_ARGS), "TGI_STREAM_FORMAT": "int"}
    running = start_stack(redis_url, tiny_model_path, tmp_path_factory.mktemp("stack-vllm"), env)
    yield running
    stop_stack(running)


def built_in(stack: Stack, max_new_tokens: int, **parameters: object) -> dict:
    """The same request on the built-in engine's stack."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **parameters}}
    response = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_text_generation_client(vllm_stack: Stack, tgi_int_stack: Stack) -> None:
    expected = built_in(tgi_int_stack, 10, decoder_input_details=True)
    client = Client(vllm_stack.base_url, timeout=60)
    response = client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True)
    assert response.generated_text == expected["generated_text"]
    assert [t.id for t in response.details.tokens] == [t["id"] for t in expected["details"]["tokens"]]
    assert [t.id for t in response.details.prefill] == [t["id"] for t in expected["details"]["prefill"]]
    assert response.details.prefill[0].logprob is None
    assert [t.logprob for t in response.details.tokens] == pytest.approx(
        [t["logprob"] for t in expected["details"]["tokens"]], abs=1e-3
    )
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=10))
    assert "".join(r.token.text for r in streamed) == response.generated_text
    assert streamed[-1].details.generated_tokens == 10 and streamed[-1].details.finish_reason.value == "length"


def test_huggingface_hub_client_stop_and_seed(vllm_stack: Stack, tgi_int_stack: Stack) -> None:
    client = InferenceClient(model=vllm_stack.base_url, timeout=60)
    text = client.text_generation(PROMPT, max_new_tokens=12)
    assert text == built_in(tgi_int_stack, 12)["generated_text"]
    stop = text[4:8]
    cut = client.text_generation(PROMPT, max_new_tokens=12, stop=[stop], details=True)
    assert cut.generated_text == text[: text.find(stop)] and cut.details.finish_reason == "stop_sequence"
    pieces = list(client.text_generation(PROMPT, max_new_tokens=12, stream=True))
    assert "".join(pieces) == text
    sampled = [client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, temperature=1.2, seed=42)
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_openai_client(vllm_stack: Stack, tgi_int_stack: Stack) -> None:
    client = OpenAI(base_url=f"{vllm_stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    completion = client.completions.create(model=vllm_stack.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == built_in(tgi_int_stack, 8)["generated_text"]
    chunks = list(client.completions.create(
        model=vllm_stack.model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    ))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == completion.choices[0].text


def test_tritonclient_infer(vllm_stack: Stack, tgi_int_stack: Stack) -> None:
    expected = built_in(tgi_int_stack, 6)
    prompt_ids = [token["id"] for token in built_in(tgi_int_stack, 1, decoder_input_details=True)["details"]["prefill"]]
    client = triton.InferenceServerClient(url=vllm_stack.base_url.removeprefix("http://"), network_timeout=120)
    tensor = triton.InferInput("input0", [1, len(prompt_ids)], "UINT32")
    tensor.set_data_from_numpy(np.array([prompt_ids], dtype=np.uint32))
    result = client.infer(vllm_stack.model_name, [tensor], outputs=[triton.InferRequestedOutput("output0")],
                          parameters={"max_new_tokens": 6})
    assert result.as_numpy("output0")[0].tolist() == prompt_ids + [t["id"] for t in expected["details"]["tokens"]]
