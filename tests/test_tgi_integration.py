"""End to end over a real Redis: separate API and worker processes, TGI routes and official TGI clients."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from huggingface_hub import InferenceClient
from text_generation import AsyncClient, Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import Stack
from tests.sse import sse_data

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

PROMPT = "def main("


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path):
    """The same model loaded in the test process: ground truth for greedy outputs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()

    def greedy(prompt: str, max_new_tokens: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        return out[0, ids.shape[1] :].tolist()

    return tokenizer, greedy



def test_non_stream_list_shape_with_details(stack: Stack, reference) -> None:
    tokenizer, greedy = reference
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "details": True, "do_sample": False}}
    resp = httpx.post(f"{stack.base_url}/", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    payload = resp.json()
    assert isinstance(payload, list) and len(payload) == 1
    details = payload[0]["details"]
    expected = greedy(PROMPT, 16)
    assert [t["id"] for t in details["tokens"]] == expected
    assert details["generated_tokens"] == 16
    assert details["finish_reason"] == "length"
    assert details["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)
    assert details["prefill"] == []
    assert isinstance(details["seed"], int) and details["seed"] > 0
    assert payload[0]["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert all(isinstance(t["logprob"], float) and t["logprob"] <= 0 for t in details["tokens"])
    assert "".join(t["text"] for t in details["tokens"]) == payload[0]["generated_text"]


def test_details_absent_unless_requested_and_prefill_on_request(stack: Stack, reference) -> None:
    tokenizer, _ = reference
    plain = httpx.post(f"{stack.base_url}/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert set(plain.json()[0]) == {"generated_text"}
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "decoder_input_details": True}}
    detailed = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()
    prefill = detailed["details"]["prefill"]
    assert [t["id"] for t in prefill] == tokenizer(PROMPT).input_ids
    assert prefill[0]["logprob"] is None and all(t["logprob"] <= 0 for t in prefill[1:])


def test_stream_seed_format_on_root(stack: Stack, reference) -> None:
    _, greedy = reference
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 12, "details": True, "do_sample": False}}
    with httpx.stream("POST", f"{stack.base_url}/", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        resp.read()
    events = sse_data(resp.text)
    assert len(events) == 12
    assert [e["token"]["id"] for e in events] == [[i] for i in greedy(PROMPT, 12)]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 12
    assert set(last["details"]) == {"finish_reason", "generated_tokens", "prompt_tokens", "seed"}


def test_generate_and_generate_stream_routes(stack: Stack, reference) -> None:
    _, greedy = reference
    expected = greedy(PROMPT, 8)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}}
    one = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()
    assert isinstance(one, dict) and [t["id"] for t in one["details"]["tokens"]] == expected
    with httpx.stream("POST", f"{stack.base_url}/generate_stream", json=body, timeout=60) as resp:
        resp.read()
    events = sse_data(resp.text)
    assert [e["token"]["id"] for e in events] == expected  # TGI's int ids on /generate_stream
    assert events[-1]["generated_text"] == one["generated_text"]


def test_info_and_health(stack: Stack) -> None:
    info = httpx.get(f"{stack.base_url}/info").json()
    assert info["model_id"] == stack.model_name
    assert info["max_input_length"] < info["max_total_tokens"]
    assert httpx.get(f"{stack.base_url}/health").status_code == 200


def test_text_generation_client(tgi_int_stack: Stack, reference) -> None:
    _, greedy = reference
    client = Client(tgi_int_stack.base_url, timeout=60)
    response = client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True)
    assert [t.id for t in response.details.tokens] == greedy(PROMPT, 10)
    assert response.details.finish_reason.value == "length"
    assert response.details.prefill[0].logprob is None
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=10))
    assert [r.token.id for r in streamed] == greedy(PROMPT, 10)
    assert streamed[-1].generated_text == response.generated_text
    assert streamed[-1].details.generated_tokens == 10


async def test_text_generation_async_client(tgi_int_stack: Stack) -> None:
    client = AsyncClient(tgi_int_stack.base_url, timeout=60)
    response = await client.generate(PROMPT, max_new_tokens=5)
    assert response.details.generated_tokens == 5
    tokens = [r.token.id async for r in client.generate_stream(PROMPT, max_new_tokens=5)]
    assert tokens == [t.id for t in response.details.tokens]


def test_huggingface_hub_client(stack: Stack, reference) -> None:
    """InferenceClient.text_generation against the seed's stream id format of ``POST /``."""
    check_huggingface_hub_client(stack, reference)


def test_huggingface_hub_client_on_tgi_stream_format(tgi_int_stack: Stack, reference) -> None:
    """The same against TGI's int stream ids."""
    check_huggingface_hub_client(tgi_int_stack, reference)


def check_huggingface_hub_client(served: Stack, reference) -> None:
    _, greedy = reference
    client = InferenceClient(model=served.base_url, timeout=60)
    text = client.text_generation(PROMPT, max_new_tokens=6)
    detailed = client.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert detailed.generated_text == text
    assert [t.id for t in detailed.details.tokens] == greedy(PROMPT, 6)
    pieces = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True))
    assert "".join(pieces) == text
    chunks = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert chunks[-1].generated_text == text and chunks[-1].details.generated_tokens == 6


async def test_concurrent_requests_get_their_own_tokens(stack: Stack, reference) -> None:
    _, greedy = reference
    prompts = [f"request number {i}: " + "x" * (i % 5) for i in range(20)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:

        async def one(prompt: str, n: int) -> list[int]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
            resp = await client.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            return [t["id"] for t in resp.json()["details"]["tokens"]]

        results = await asyncio.gather(*(one(p, 4 + i % 7) for i, p in enumerate(prompts)))
    for i, (prompt, tokens) in enumerate(zip(prompts, results, strict=True)):
        assert tokens == greedy(prompt, 4 + i % 7), f"request {i} got someone else's tokens"


def test_stop_sequence_cuts_text_and_is_excluded(stack: Stack, reference) -> None:
    tokenizer, greedy = reference
    full = tokenizer.decode(greedy(PROMPT, 20), skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected_text = full[: full.index(stop)]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 20, "stop": [stop], "details": True}}
    result = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()
    assert result["generated_text"] == expected_text
    assert result["details"]["finish_reason"] == "stop_sequence"
    with httpx.stream("POST", f"{stack.base_url}/generate_stream", json=body, timeout=60) as resp:
        resp.read()
    events = sse_data(resp.text)
    assert "".join(e["token"]["text"] for e in events) == expected_text
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"


def test_seed_reproducibility(stack: Stack) -> None:
    def sample(seed: int | None) -> dict:
        params = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "top_k": 50, "details": True}
        if seed is not None:
            params["seed"] = seed
        body = {"inputs": PROMPT, "parameters": params}
        return httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()

    first, second = sample(1234), sample(1234)
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 1234
    assert sample(99)["generated_text"] != first["generated_text"]
    server_seeded = sample(None)
    replay = sample(server_seeded["details"]["seed"])
    assert replay["generated_text"] == server_seeded["generated_text"]


def test_return_full_text(stack: Stack) -> None:
    params = {"max_new_tokens": 5}
    plain = httpx.post(f"{stack.base_url}/generate", json={"inputs": PROMPT, "parameters": params}, timeout=60).json()
    full = httpx.post(
        f"{stack.base_url}/generate",
        json={"inputs": PROMPT, "parameters": {**params, "return_full_text": True}},
        timeout=60,
    ).json()
    assert full["generated_text"] == PROMPT + plain["generated_text"]


def test_validation_error_before_stream_starts(stack: Stack) -> None:
    body = {"inputs": PROMPT, "stream": True, "parameters": {"top_p": 1.0}}
    resp = httpx.post(f"{stack.base_url}/", json=body, timeout=60)
    assert resp.status_code == 422
    assert resp.json()["error_type"] == "validation"
    assert "top_p" in resp.json()["error"]


GRADE = {"type": "object", "properties": {"grade": {"enum": ["A", "B", "C"]}, "passed": {"type": "boolean"}},
         "required": ["grade", "passed"], "additionalProperties": False}


def test_huggingface_hub_grammar(stack: Stack) -> None:
    """``text_generation(grammar=...)`` (TGI >= 1.4.3's parameter): a JSON schema and a regex hold, sampled and
    streamed too; the tiny model's text is random, so the constraint is what makes them hold."""
    client = InferenceClient(model=stack.base_url, timeout=60)
    schema = {"type": "json", "value": GRADE}
    for do_sample in (False, True):
        text = client.text_generation(PROMPT, max_new_tokens=48, grammar=schema, do_sample=do_sample, seed=3)
        jsonschema.validate(json.loads(text), GRADE)
    streamed = "".join(client.text_generation(PROMPT, max_new_tokens=48, grammar=schema, stream=True))
    jsonschema.validate(json.loads(streamed), GRADE)
    digits = client.text_generation(PROMPT, max_new_tokens=16, do_sample=True, seed=5,
                                    grammar={"type": "regex", "value": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", digits), digits
