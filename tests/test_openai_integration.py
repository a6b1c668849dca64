"""End to end over a real Redis: the OpenAI-compatible routes of separate API and worker processes, driven by
the official ``openai`` client (sync and async, streamed and not) and ``huggingface_hub``'s ``InferenceClient``,
cross-checked against the TGI routes.

Completions run on the session ``stack`` (the tiny model); chat runs on a stack of the tiny model given the
tests' chat template by the ``CHAT_TEMPLATE`` setting (a file), as ``--chat-template`` gives it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, ConfigDict
from transformers import AutoTokenizer

import openai
from openai import AsyncOpenAI, OpenAI
from tests.helpers import Stack, start_stack, stop_stack
from worker.tiny_model import CHAT_TEMPLATE

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

PROMPT = "def main("
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a function."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def chat_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("stack-chat")
    template = log_dir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    running = start_stack(redis_url, tiny_model_path, log_dir, {"CHAT_TEMPLATE": str(template)})
    yield running
    stop_stack(running)


def client_for(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def async_client_for(stack: Stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def tgi_greedy(stack: Stack, inputs: str, max_new_tokens: int = MAX_TOKENS) -> dict:
    """The TGI route's greedy generation of the same prompt: the reference for temperature 0."""
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": True, "do_sample": False}}
    response = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_path: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_model_path)(PROMPT).input_ids


@pytest.fixture(scope="module")
def chat_prompt(tiny_model_path: Path) -> str:
    """The messages as the chat template renders them, ready for the assistant's turn, without the template's
    leading BOS: the TGI route adds BOS itself, so it then gets the same prompt ids as the chat route."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rendered = tokenizer.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.startswith(tokenizer.bos_token)
    return rendered.removeprefix(tokenizer.bos_token)


def test_models(stack: Stack) -> None:
    client = client_for(stack)
    assert [model.id for model in client.models.list()] == [stack.model_name]
    model = client.models.retrieve(stack.model_name)
    assert (model.id, model.object, model.owned_by) == (stack.model_name, "model", "ferry")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_completion_greedy_equals_tgi(stack: Stack, prompt_ids: list[int]) -> None:
    expected = tgi_greedy(stack, PROMPT)
    completion = client_for(stack).completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == stack.model_name
    [choice] = completion.choices
    assert choice.text == expected["generated_text"]
    assert choice.finish_reason == "length" and choice.index == 0
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    assert completion.usage.total_tokens == len(prompt_ids) + MAX_TOKENS


def test_completion_of_token_ids_equals_text_prompt(stack: Stack, prompt_ids: list[int]) -> None:
    completion = client_for(stack).completions.create(
        model=stack.model_name, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == tgi_greedy(stack, PROMPT)["generated_text"]


def test_completion_stream_with_usage(stack: Stack, prompt_ids: list[int]) -> None:
    chunks = list(client_for(stack).completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == tgi_greedy(stack, PROMPT)["generated_text"]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_with_continuous_usage(stack: Stack, prompt_ids: list[int]) -> None:
    """guidellm's stream_options: each chunk's usage counts the tokens generated so far, one per text chunk."""
    chunks = list(client_for(stack).completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))
    *text_chunks, usage_chunk = chunks
    counts = [c.usage.completion_tokens for c in text_chunks if c.usage is not None]
    assert counts == sorted(counts) and len(counts) == len(text_chunks)
    assert {c.usage.prompt_tokens for c in text_chunks if c.usage is not None} == {len(prompt_ids)}
    assert text_chunks[-1].usage == usage_chunk.usage
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == MAX_TOKENS


def test_stop_string_is_excluded(stack: Stack) -> None:
    full = tgi_greedy(stack, PROMPT, 20)["generated_text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    client = client_for(stack)
    completion = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop
    )
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "never seen"], stream=True
    ))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(stack: Stack) -> None:
    client = client_for(stack)

    def sample(seed: int) -> str:
        return client.completions.create(
            model=stack.model_name, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed
        ).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_errors_in_openai_shape(stack: Stack) -> None:
    client = client_for(stack)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=stack.model_name, prompt=PROMPT, n=2, stream=True)
    assert bad.value.status_code == 400 and bad.value.param == "n" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=stack.model_name, prompt=PROMPT, extra_body={"min_p": 0.05})
    assert unknown.value.param == "min_p" and "`min_p` is not a supported parameter" in unknown.value.message
    with pytest.raises(openai.NotFoundError) as no_route:
        client.embeddings.create(model=stack.model_name, input="x")
    assert no_route.value.code == "not_found" and "/v1/embeddings" in no_route.value.message


def test_any_model_name_when_one_model_is_served(stack: Stack) -> None:
    """TGI's rule: TGI's documents send ``"tgi"``, huggingface_hub ``"dummy"``."""
    expected = tgi_greedy(stack, PROMPT)["generated_text"]
    for name in ("tgi", "dummy"):
        completion = client_for(stack).completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        assert (completion.model, completion.choices[0].text) == (stack.model_name, expected)


def test_vllm_sampling_extras_equal_tgi(stack: Stack) -> None:
    """vLLM's top_k and repetition_penalty with a seed sample exactly what the TGI route samples with them."""
    extras = {"top_k": 5, "repetition_penalty": 1.3}
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "do_sample": True, "seed": 77, **extras}}
    expected = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()["generated_text"]
    completion = client_for(stack).completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=77, extra_body=extras
    )
    assert completion.choices[0].text == expected
    plain = client_for(stack).completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=12, seed=77)
    assert plain.choices[0].text != expected


def test_stop_token_ids_end_the_completion(stack: Stack) -> None:
    """A stop token id ends the completion with finish_reason stop, the token kept (vLLM's rule)."""
    tokens = [token["id"] for token in tgi_greedy(stack, PROMPT)["details"]["tokens"]]
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    completion = client_for(stack).completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [tokens[at]], "ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "stop" and completion.usage.completion_tokens == at + 1
    assert completion.choices[0].text == tgi_greedy(stack, PROMPT, at + 1)["generated_text"]


async def test_async_client_completions(stack: Stack) -> None:
    expected = tgi_greedy(stack, PROMPT)["generated_text"]
    async with async_client_for(stack) as client:
        completion = await client.completions.create(
            model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        stream = await client.completions.create(
            model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        streamed = "".join([chunk.choices[0].text async for chunk in stream])
    assert completion.choices[0].text == streamed == expected


def test_chat_greedy_equals_tgi(chat_stack: Stack, chat_prompt: str) -> None:
    expected = tgi_greedy(chat_stack, chat_prompt)
    completion = client_for(chat_stack).chat.completions.create(
        model=chat_stack.model_name, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    [choice] = completion.choices
    assert (choice.message.role, choice.message.content) == ("assistant", expected["generated_text"])
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected["details"]["prompt_tokens"], MAX_TOKENS)
    assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS


def test_chat_stream_with_usage(chat_stack: Stack, chat_prompt: str) -> None:
    chunks = list(client_for(chat_stack).chat.completions.create(
        model=chat_stack.model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    first, *content, last, usage_chunk = chunks
    assert first.object == "chat.completion.chunk"
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content for c in content) == tgi_greedy(chat_stack, chat_prompt)["generated_text"]
    assert all(c.choices[0].finish_reason is None for c in content)
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content is None
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS


async def test_async_client_chat(chat_stack: Stack, chat_prompt: str) -> None:
    expected = tgi_greedy(chat_stack, chat_prompt)["generated_text"]
    async with async_client_for(chat_stack) as client:
        completion = await client.chat.completions.create(
            model=chat_stack.model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
        )
        stream = await client.chat.completions.create(
            model=chat_stack.model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert completion.choices[0].message.content == streamed == expected


def test_huggingface_hub_chat_completion(chat_stack: Stack, chat_prompt: str) -> None:
    """``InferenceClient(url).chat_completion`` sends ``"model": "dummy"``; with one model served it is that model."""
    expected = tgi_greedy(chat_stack, chat_prompt)["generated_text"]
    client = InferenceClient(chat_stack.base_url, timeout=60)
    output = client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert (output.model, output.choices[0].message.content) == (chat_stack.model_name, expected)
    assert output.choices[0].finish_reason == "length" and output.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected


def test_chat_stop_string_is_excluded(chat_stack: Stack, chat_prompt: str) -> None:
    full = tgi_greedy(chat_stack, chat_prompt, 20)["generated_text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    completion = client_for(chat_stack).chat.completions.create(
        model=chat_stack.model_name, messages=MESSAGES, max_tokens=20, temperature=0, stop=[stop]
    )
    assert completion.choices[0].message.content == full[: full.index(stop)]
    assert completion.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------ structured outputs
# The tiny model's text is random: what these check is what the constraint guarantees.


class Verdict(BaseModel):
    """A schema whose every value is bounded (an enum, a boolean), so that a random model ends it soon."""

    model_config = ConfigDict(extra="forbid")

    answer: Literal["yes", "no", "maybe"]
    sure: bool


def test_openai_parse_returns_the_schema_s_object(chat_stack: Stack) -> None:
    """``client.chat.completions.parse(response_format=Model)``: the answer parses as the model, streamed too."""
    client = client_for(chat_stack)
    for temperature in (0, 1):
        completion = client.chat.completions.parse(model=chat_stack.model_name, messages=MESSAGES,
                                                   response_format=Verdict, max_tokens=64, temperature=temperature)
        [choice] = completion.choices
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), choice.message.content
    with client.chat.completions.stream(model=chat_stack.model_name, messages=MESSAGES, response_format=Verdict,
                                        max_tokens=64, temperature=1) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Verdict)


@pytest.mark.parametrize(("extra", "matches"), [
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, re.compile(r"[0-9]{3}-[a-z]{2}").fullmatch),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, {"red", "green", "blue"}.__contains__),
    ({"guided_grammar": 'root ::= "a" | "b" "c"'}, {"a", "bc"}.__contains__),
    ({"guided_json": Verdict.model_json_schema()}, lambda text: Verdict.model_validate_json(text) is not None),
])
def test_completions_keep_their_constraint(stack: Stack, extra: dict[str, Any], matches: Any) -> None:
    """A regex, a choice list, a grammar and a JSON schema hold on /v1/completions, greedy and sampled (any JSON
    object, unbounded, a random model never ends: tests/test_openai_validation.py shows it reaches the job)."""
    client = client_for(stack)
    for temperature in (0, 1):
        completion = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=48,
                                               temperature=temperature, seed=7, extra_body=extra)
        [choice] = completion.choices
        assert choice.finish_reason == "stop" and matches(choice.text), choice.text


def test_a_constraint_that_does_not_compile_is_a_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client_for(stack).completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=4,
                                             extra_body={"guided_regex": "[0-9"})
    assert refused.value.status_code == 400 and "`guided_regex` does not compile" in str(refused.value)
