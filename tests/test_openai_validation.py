"""Unit tests of the OpenAI-compatible routes: every request rule, the translation onto the pipeline, and the
response and stream shapes.

Rejections go through HTTP (FastAPI TestClient, fakeredis; validation fails before anything is queued, so no
worker runs). Accepted requests and resolved values call :func:`api.openai.routes.to_completion_request` and
:func:`api.openai.routes.to_chat_request` directly. An autouse guard makes any queued request fail the test;
``stand_in_worker`` answers with canned tokens to test response shapes over HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

import api.main
from api.app import create_app
from api.context import ModelInfo, ServerContext
from api.errors import PipelineError, ProtocolError
from api.openai.routes import to_chat_request, to_completion_request
from api.openai.schemas import ChatCompletionRequest, CompletionRequest
from api.request import QueuedRequest
from common.protocol import Finish, FinishReason, TokenEvent, TokenInfo
from common.settings import ConfigError, Settings, load_settings
from tests import helpers
from tests.fakes import FakeSubmission, patch_submit
from tests.helpers import assert_openai_error, make_ctx
from tests.sse import sse_data

MODEL = "tiny-openai"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_ITER_TIMES = 64
# tests.helpers' settings, under this module's model name and iteration cap
make_settings = partial(helpers.make_settings, model_name=MODEL, max_iter_times=MAX_ITER_TIMES)
PROMPT = "def main("
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------------------------- helpers


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **fields}


def post(client: TestClient, route: str, body: Any) -> Any:
    """POST ``body`` as ASCII-escaped JSON, so lone surrogates travel as JSON escapes, as a client may send them."""
    return client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})




async def resolve_completion(ctx: ServerContext, **fields: Any) -> QueuedRequest:
    return await to_completion_request(ctx, CompletionRequest.model_validate(completion_body(**fields)), "cmpl-1")


async def resolve_chat(ctx: ServerContext, **fields: Any) -> QueuedRequest:
    return await to_chat_request(ctx, ChatCompletionRequest.model_validate(chat_body(**fields)), "chatcmpl-1")


def canned_events(request: QueuedRequest, pieces: list[str], reason: FinishReason) -> list[TokenEvent]:
    """Token events for ``pieces`` (ids 7, 8, ...), the last with its finish."""
    tokens = [TokenInfo(id=7 + i, text=p, logprob=-0.5, special=False) for i, p in enumerate(pieces)]
    finish = Finish(
        finish_reason=reason, generated_tokens=len(tokens), prompt_tokens=len(request.input_ids),
        seed=request.params.seed, generated_text="".join(pieces),
    )
    last = len(tokens) - 1
    return [TokenEvent(index=i, token=t, finish=finish if i == last else None) for i, t in enumerate(tokens)]



# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def settings(tiny_model_path: Path) -> Settings:
    return make_settings(tiny_model_path)


@pytest.fixture(scope="module")
def ctx(settings: Settings) -> ServerContext:
    return make_ctx(settings)


@pytest.fixture(scope="module")
def plain_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model whose tokenizer has no chat template, whether or not the tiny model has one."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama-plain"
    shutil.copytree(tiny_model_path, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def chat_ctx(chat_model_path: Path) -> ServerContext:
    return make_ctx(make_settings(chat_model_path))


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    """The tiny model, which has no chat template."""
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as c:
        yield c


@pytest.fixture(scope="module")
def chat_client(chat_model_path: Path) -> Iterator[TestClient]:
    """The tiny model with a chat template."""
    with TestClient(create_app(make_settings(chat_model_path), redis=fakeredis.FakeAsyncRedis())) as c:
        yield c


@pytest.fixture(autouse=True)
def nothing_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that reaches the queue fails the test (without a worker it would hang)."""

    async def refuse(ctx, request):
        raise AssertionError(f"request was accepted and queued: {request!r}")

    patch_submit(monkeypatch, refuse)


@pytest.fixture
def stand_in_worker(monkeypatch: pytest.MonkeyPatch) -> list[QueuedRequest]:
    """Accepted requests are recorded and answered with the pieces "Hel", "" (held back), "lo", then length."""
    accepted: list[QueuedRequest] = []

    async def fake_submit(ctx, request):
        accepted.append(request)
        return FakeSubmission(ctx, canned_events(request, ["Hel", "", "lo"], "length"))

    patch_submit(monkeypatch, fake_submit)
    return accepted


# --------------------------------------------------------------------------------------------- rejections


# (field, value, param, message fragment), rules both routes share
SHARED_RULES = [
    ("model", None, "model", "`model`: Input should be a valid string"),
    ("model", 5, "model", "`model`: Input should be a valid string"),
    ("model", "\ud800", "model", "`model` must be valid Unicode text"),  # was a 500: Redis could not take it
    ("max_tokens", 0, "max_tokens", "`max_tokens` must be strictly positive. Given: 0"),
    ("max_tokens", -1, "max_tokens", "`max_tokens` must be strictly positive"),
    ("max_tokens", 1.5, "max_tokens", "`max_tokens`: Input should be a valid integer"),
    ("temperature", -0.1, "temperature", "`temperature` must be >= 0 and <= 2 (0 = greedy). Given: -0.1"),
    ("temperature", 2.01, "temperature", "`temperature` must be >= 0 and <= 2"),
    ("temperature", "1", "temperature", "`temperature`: Input should be a valid number"),
    ("temperature", True, "temperature", "`temperature`: Input should be a valid number"),
    ("top_p", 0.0, "top_p", "`top_p` must be > 0 and <= 1 (1 = off). Given: 0.0"),
    ("top_p", 1.01, "top_p", "`top_p` must be > 0 and <= 1"),
    ("n", 2, "n", "`n` must be 1: this server returns one choice per request. Given: 2"),
    ("n", 0, "n", "`n` must be 1"),
    ("stop", ["a", "b", "c", "d", "e"], "stop", "`stop` supports up to 4 stop sequences. Given: 5"),
    ("stop", "", "stop", "each `stop` sequence must have 1 to 1024 characters. Given: 0"),
    ("stop", ["x" * 1025], "stop", "each `stop` sequence must have 1 to 1024 characters. Given: 1025"),
    ("stop", 5, "stop", "`stop`"),
    ("stop", "\ud800", "stop", "`stop` must be valid Unicode text"),
    ("seed", 2**63, "seed", "`seed` must be a 64-bit signed integer"),
    ("seed", -(2**63) - 1, "seed", "`seed` must be a 64-bit signed integer"),
    ("seed", 1.5, "seed", "`seed`: Input should be a valid integer"),
    ("presence_penalty", 0.5, "presence_penalty", "`presence_penalty` is not supported, only 0"),
    ("presence_penalty", -2, "presence_penalty", "repetition_penalty is a different"),
    ("frequency_penalty", 1.0, "frequency_penalty", "`frequency_penalty` is not supported, only 0"),
    ("logit_bias", {"50256": -100}, "logit_bias", "`logit_bias` is not supported yet, only an empty object"),
    ("stream", "yes", "stream", "`stream`: Input should be a valid boolean"),
    ("stream_options", {"include_usage": True}, "stream_options",
     "`stream_options` is only allowed when `stream` is true"),
    # vLLM's sampling extras
    ("top_k", -2, "top_k", "`top_k` must be -1 or 0 (off) or a positive integer <= 2147483647. Given: -2"),
    ("top_k", 2**31, "top_k", "`top_k` must be -1 or 0 (off) or a positive integer"),
    ("top_k", 1.5, "top_k", "`top_k`: Input should be a valid integer"),
    ("repetition_penalty", 0, "repetition_penalty",
     "`repetition_penalty` must be strictly positive (1 = off). Given: 0"),
    ("repetition_penalty", "1.2", "repetition_penalty", "`repetition_penalty`: Input should be a valid number"),
    ("ignore_eos", "yes", "ignore_eos", "`ignore_eos`: Input should be a valid boolean"),
    ("stop_token_ids", [2, -1], "stop_token_ids", "`stop_token_ids` must be token ids, >= 0. Given: -1"),
    ("stop_token_ids", [2] * 1025, "stop_token_ids", "`stop_token_ids` supports up to 1024 ids. Given: 1025"),
    ("stop_token_ids", 2, "stop_token_ids", "`stop_token_ids`: Input should be a valid list"),
    ("min_tokens", 1, "min_tokens", "`min_tokens` is not supported yet, only 0 (EOS may end the output at any "
     "length). Given: 1"),
    # any other field, vLLM's or not, is named rather than dropped
    ("min_p", 0.1, "min_p", "`min_p` is not a supported parameter"),
    ("use_beam_search", True, "use_beam_search", "`use_beam_search` is not a supported parameter"),
    ("include_stop_str_in_output", False, "include_stop_str_in_output", "is not a supported parameter"),
    # structured outputs: checked before anything is queued, one way at a time
    ("guided_json", {"type": 5}, "guided_json", "`guided_json` does not compile: type must be a string"),
    ("guided_json", "{not json", "guided_json", "`guided_json` must be a JSON schema: Expecting property name"),
    ("guided_json", [1], "guided_json", "`guided_json`: Input should be a valid dictionary"),
    ("guided_regex", "[0-9+", "guided_regex", "`guided_regex` does not compile: "),
    ("guided_choice", [], "guided_choice", "`guided_choice` must hold at least one choice"),
    ("guided_grammar", "root ::= (", "guided_grammar", "`guided_grammar` does not compile: "),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs",
     "`structured_outputs` takes one constraint. Given: regex, choice"),
    ("structured_outputs", {"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern",
     "`structured_outputs.whitespace_pattern` is not a supported parameter"),
    ("structured_outputs", {"json": {"type": "nope"}}, "structured_outputs", "`structured_outputs` does not compile"),
    ("response_format", {"type": "xml"}, "response_format.type", "`response_format.type`: Input should be 'text', "
     "'json_object' or 'json_schema'"),
    ("response_format", {"type": "json_schema"}, "response_format",
     "`response_format.json_schema` is required with type 'json_schema'"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}},
     "response_format", "`response_format` does not compile"),
    ("unknown_field", None, "unknown_field", "`unknown_field` is not a supported parameter"),
]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("field", "value", "param", "fragment"), SHARED_RULES)
def test_shared_rules(chat_client: TestClient, route: str, field: str, value: Any, param: str, fragment: str) -> None:
    body = completion_body() if route == COMPLETIONS else chat_body()
    assert_openai_error(post(chat_client, route, {**body, field: value}), 400, fragment, param)


COMPLETION_RULES = [
    ("prompt", None, "`prompt` must be a string, a list of integer token ids, or a list holding one of either"),
    ("prompt", 5, "`prompt` must be a string, a list of integer token ids"),
    ("prompt", [1, True], "`prompt` must be a string, a list of integer token ids"),
    ("prompt", [1, "a"], "`prompt` must be a string, a list of integer token ids"),
    ("prompt", [[1], ["a"]], "`prompt` must be a string, a list of integer token ids"),
    ("prompt", "", "`prompt` cannot be empty"),
    ("prompt", [""], "`prompt` cannot be empty"),
    ("prompt", [], "`prompt` must be one prompt: send one request per prompt (batches are not supported). "
                   "Given: a list of 0 prompts"),
    ("prompt", ["a", "b"], "Given: a list of 2 prompts"),
    ("prompt", [[1, 2], [3]], "Given: a list of 2 prompts"),
    ("prompt", [[]], "`prompt` cannot be an empty list of token ids"),
    ("prompt", [1, -2], "`prompt` token ids must be >= 0. Given: -2"),
    ("prompt", "\ud800", "`prompt` must be valid Unicode text"),
    ("echo", True, "`echo` is not supported, only false"),
    ("best_of", 2, "`best_of` must be 1: best-of sampling is not supported. Given: 2"),
    ("suffix", "}", "`suffix` is not supported (no insertion mode)"),
    ("logprobs", 0, "`logprobs` is not supported yet. Given: 0"),
    ("logprobs", 5, "`logprobs` is not supported yet"),
]


@pytest.mark.parametrize(("field", "value", "fragment"), COMPLETION_RULES)
def test_completion_rules(client: TestClient, field: str, value: Any, fragment: str) -> None:
    assert_openai_error(post(client, COMPLETIONS, completion_body(**{field: value})), 400, fragment, field)


def test_unknown_stream_option_is_named(client: TestClient) -> None:
    body = completion_body(stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert_openai_error(post(client, COMPLETIONS, body), 400,
                        "`stream_options.include_obfuscation` is not a supported parameter",
                        "stream_options.include_obfuscation")


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stop_token_ids_below_the_vocabulary(chat_client: TestClient, ctx: ServerContext, route: str) -> None:
    vocab_size = ctx.model.vocab_size
    body = completion_body() if route == COMPLETIONS else chat_body()
    response = post(chat_client, route, {**body, "stop_token_ids": [2, vocab_size]})
    fragment = f"`stop_token_ids` must be < the vocabulary size {vocab_size}. Given: {vocab_size}"
    assert_openai_error(response, 400, fragment, "stop_token_ids")


def test_completion_prompt_is_required(client: TestClient) -> None:
    body = completion_body()
    del body["prompt"]
    assert_openai_error(post(client, COMPLETIONS, body), 400, "`prompt`: Field required", "prompt")


def test_prompt_text_at_most_4_mib(client: TestClient) -> None:
    body = completion_body(prompt="x" * (4 * 1024 * 1024 + 1))
    assert_openai_error(post(client, COMPLETIONS, body), 400, "`prompt` must have at most 4194304 characters", "prompt")


def test_prompt_token_ids_below_the_vocabulary(client: TestClient, ctx: ServerContext) -> None:
    vocab_size = ctx.model.vocab_size
    response = post(client, COMPLETIONS, completion_body(prompt=[1, vocab_size]))
    fragment = f"`prompt` token ids must be < the vocabulary size {vocab_size}. Given: {vocab_size}"
    assert_openai_error(response, 400, fragment, "prompt")


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_prompt_longer_than_the_input_limit(chat_model_path: Path, route: str) -> None:
    settings = make_settings(chat_model_path, max_input_token_len=8)
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as small:
        if route == COMPLETIONS:
            response, field = post(small, route, completion_body(prompt=list(range(1, 10)))), "prompt"
        else:
            response, field = post(small, route, chat_body()), "messages"
    fragment = f"`{field}` must have at most 8 tokens. Given: "
    assert_openai_error(response, 400, fragment, field, "context_length_exceeded")


def message(role: str = "user", content: Any = "Hi", **fields: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **fields}


# (messages, param, fragment)
MESSAGE_RULES = [
    ([], "messages", "`messages` must hold at least one message"),
    ("Hi", "messages", "`messages`: Input should be a valid list"),
    ([message(role="tool")], "messages", "`messages[0].role` 'tool' is not supported: this server has no tool calling"),
    ([message(), message(role="function")], "messages", "`messages[1].role` 'function' is not supported"),
    ([message(role="robot")], "messages",
     "`messages[0].role` must be one of 'system', 'developer', 'user', 'assistant'. Given: 'robot'"),
    ([{"content": "Hi"}], "messages.0.role", "`messages.0.role`: Field required"),
    ([message(content=None)], "messages", "`messages[0].content` is required"),
    ([{"role": "user"}], "messages", "`messages[0].content` is required"),
    ([message(content=5)], "messages.0.content", "`messages.0.content`"),
    ([message(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])], "messages",
     "`messages[0].content[0]` (image_url): the model `"),  # the tiny model is text-only
    ([message(content=[{"type": "text", "text": "Hi"}, {"type": "audio_url", "audio_url": {"url": "a.wav"}}])],
     "messages", "`messages[0].content[1]` (audio_url): the model `"),
    ([message(content=[{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])], "messages",
     "`messages[0].content[0]` of type 'input_audio' is not supported: content parts are text, image_url"),
    ([message(content=[{"type": "image_url"}])], "messages", "`messages[0].content[0].image_url` is required"),
    ([message(content=[{"type": "image_url", "image_url": {"url": "a.png", "detail": "max"}}])],
     "messages.0.content.0.image_url.detail", "Input should be 'auto', 'low' or 'high'"),
    ([message(content=[{"type": "text"}])], "messages", "`messages[0].content[0].text` is required"),
    ([message(role="assistant", content="", tool_calls=[{"id": "1", "type": "function"}])], "messages",
     "`messages[0].tool_calls` is not supported"),
    ([message(content="\ud800")], "messages", "`messages[0].content` must be valid Unicode text"),
    ([message(name="a\udcffb")], "messages", "`messages[0].name` must be valid Unicode text"),
    ([message(content="x" * (4 * 1024 * 1024 + 1))], "messages",
     "`messages` must have at most 4194304 characters of content"),
]


@pytest.mark.parametrize(("messages", "param", "fragment"), MESSAGE_RULES)
def test_message_rules(chat_client: TestClient, messages: Any, param: str, fragment: str) -> None:
    assert_openai_error(post(chat_client, CHAT, chat_body(messages=messages)), 400, fragment, param)


CHAT_RULES = [
    ("max_completion_tokens", 0, "max_completion_tokens", "`max_completion_tokens` must be strictly positive"),
    ("logprobs", True, "logprobs", "`logprobs` is not supported yet, only false"),
    ("top_logprobs", 2, "top_logprobs", "`top_logprobs` is not supported yet"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tools",
     "`tools` is not supported: this server has no tool calling"),
    ("tool_choice", "auto", "tool_choice", "`tool_choice` is not supported, only 'none'"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice", "`tool_choice` is not supported"),
    ("functions", [{"name": "f"}], "functions", "`functions` is not supported"),
    ("function_call", "auto", "function_call", "`function_call` is not supported"),
]


@pytest.mark.parametrize(("field", "value", "param", "fragment"), CHAT_RULES)
def test_chat_rules(chat_client: TestClient, field: str, value: Any, param: str, fragment: str) -> None:
    assert_openai_error(post(chat_client, CHAT, chat_body(**{field: value})), 400, fragment, param)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS = [  # each way a client asks for structured outputs, and the constraint the job carries
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_schema", {"type": "object"})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     ("json_schema", SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", SCHEMA)),
    ({"structured_outputs": {"json_object": True}}, ("json_schema", {"type": "object"})),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, ("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, ("grammar", 'root ::= "a" | "b"')),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA)),
    ({"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
    ({"guided_choice": ["x"]}, ("choice", ["x"])),
    ({"guided_grammar": 'start: "a"'}, ("grammar", 'start: "a"')),
]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("fields", "expected"), CONSTRAINTS)
def test_structured_outputs_reach_the_job(
    chat_client: TestClient, stand_in_worker: list[QueuedRequest], route: str, fields: dict[str, Any],
    expected: tuple[str, Any] | None,
) -> None:
    body = completion_body(**fields) if route == COMPLETIONS else chat_body(**fields)
    assert post(chat_client, route, body).status_code == 200
    constraint = stand_in_worker[0].constraint
    if expected is None:
        assert constraint is None
        return
    assert constraint is not None and constraint.format == expected[0]
    value = constraint.value if expected[0] in ("regex", "grammar") else json.loads(constraint.value)
    if expected[0] == "json_schema":  # compact JSON unless the schema says otherwise
        assert value.pop("x-guidance") == {"whitespace_flexible": False}
    assert value == expected[1]


def test_a_schema_s_own_whitespace_option_is_kept(
    chat_client: TestClient, stand_in_worker: list[QueuedRequest]
) -> None:
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert post(chat_client, CHAT, chat_body(guided_json=schema)).status_code == 200
    constraint = stand_in_worker[0].constraint
    assert constraint is not None and json.loads(constraint.value) == schema


def test_one_constraint_at_a_time(chat_client: TestClient) -> None:
    body = chat_body(guided_regex="a", response_format={"type": "json_object"})
    assert_openai_error(post(chat_client, CHAT, body), 400, "the output takes one constraint. Given: response_format, "
                        "guided_regex")


def test_max_tokens_and_max_completion_tokens_must_agree(chat_client: TestClient) -> None:
    response = post(chat_client, CHAT, chat_body(max_tokens=5, max_completion_tokens=6))
    assert_openai_error(response, 400, "`max_tokens` and `max_completion_tokens` disagree: give one of them. "
                        "Given: 5 and 6")


def test_chat_without_a_chat_template(plain_model_path: Path) -> None:
    with TestClient(create_app(make_settings(plain_model_path), redis=fakeredis.FakeAsyncRedis())) as plain:
        response = post(plain, CHAT, chat_body())
    assert_openai_error(response, 400, f"the model `{MODEL}` has no chat template, so it cannot take `messages`: "
                        "use /v1/completions with a `prompt`", "messages")


# --------------------------------------------------------------------------------------------- --chat-template


OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.mark.parametrize("given_as", ["inline", "file"])
@pytest.mark.parametrize("model", ["plain", "chat"])
def test_chat_template_option_renders_the_messages(
    plain_model_path: Path, chat_model_path: Path, tmp_path: Path, stand_in_worker: list[QueuedRequest],
    given_as: str, model: str,
) -> None:
    """CHAT_TEMPLATE (``--chat-template``, ``ServerConfig.chatTemplate``), inline or a file, is the default
    model's template: it lets a model without one chat, and replaces a model's own."""
    template_file = tmp_path / "template.jinja"
    template_file.write_text(OTHER_TEMPLATE)
    value = OTHER_TEMPLATE if given_as == "inline" else str(template_file)
    settings = make_settings(plain_model_path if model == "plain" else chat_model_path, chat_template=value)
    assert settings.chat_template == OTHER_TEMPLATE
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as served:
        assert post(served, CHAT, chat_body()).status_code == 200
        tokenizer = AutoTokenizer.from_pretrained(served.app.state.ctx.model.path)
    expected = "[system] Be brief.\n[user] Hello\n[assistant] "
    assert stand_in_worker[0].input_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(("value", "fragment"), [
    ("/no/such/template.jinja", "cannot read the chat template file /no/such/template.jinja: No such file"),
    ("{% for m in messages %}", "the chat template is not valid Jinja"),
    ("{{ messages }", "the chat template is not valid Jinja: unexpected '}' (line 1)"),
])
def test_a_broken_chat_template_stops_the_pod(value: str, fragment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAT_TEMPLATE", value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "`ServerConfig.chatTemplate` (env CHAT_TEMPLATE): " in str(caught.value) and fragment in str(caught.value)


def test_chat_template_command_line_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ferry-api --chat-template`` overrides CHAT_TEMPLATE."""
    served: list[Settings] = []
    monkeypatch.setenv("CHAT_TEMPLATE", "{{ 'from the environment' }}")
    monkeypatch.setattr(api.main, "serve", served.append)
    api.main.main(["--chat-template", OTHER_TEMPLATE])
    assert [settings.chat_template for settings in served] == [OTHER_TEMPLATE]


async def test_chat_template_errors_are_400(chat_ctx: ServerContext) -> None:
    """A template's own ``raise_exception`` (e.g. roles must alternate) is the client's error, not a 500."""
    tokenizer = ModelInfo.load(chat_ctx.settings).tokenizer
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    )
    strict = dataclasses.replace(chat_ctx, model=dataclasses.replace(chat_ctx.model, tokenizer=tokenizer))
    with pytest.raises(ProtocolError) as caught:
        await resolve_chat(strict)
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert "the model's chat template rejected the `messages`: no system role" in caught.value.message


@pytest.mark.parametrize("name", ["dummy", "tgi", "gpt-4o", ""])
@pytest.mark.parametrize(("route", "body"), [(COMPLETIONS, completion_body()), (CHAT, chat_body())])
def test_one_served_model_answers_to_any_name(
    chat_client: TestClient, stand_in_worker: list[QueuedRequest], route: str, body: dict[str, Any], name: str
) -> None:
    """TGI's rule, which huggingface_hub relies on (it sends ``"dummy"``): with one model, the name is not
    checked; the answer names the model that served it."""
    response = post(chat_client, route, {**body, "model": name})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL


@pytest.fixture(scope="module")
def two_models_client(plain_model_path: Path, chat_model_path: Path) -> Iterator[TestClient]:
    """The plain tiny model as the default, and the chat model as ``chatty``."""
    chatty = {"modelName": "chatty", "modelWeightPath": str(chat_model_path)}
    settings = make_settings(plain_model_path, models=[chatty])
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as c:
        yield c


@pytest.mark.parametrize(("route", "body"), [(COMPLETIONS, completion_body()), (CHAT, chat_body())])
def test_with_several_models_an_unknown_name_is_404(
    two_models_client: TestClient, route: str, body: dict[str, Any]
) -> None:
    response = post(two_models_client, route, {**body, "model": "dummy"})
    assert_openai_error(response, 404, f"The model `dummy` does not exist: this server serves `{MODEL}`, `chatty`.",
                        "model", "model_not_found")


@pytest.mark.parametrize(("route", "body"), [
    (COMPLETIONS, completion_body()),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
    ("/v1/unload_lora_adapter", {"lora_name": "a"}),
])
def test_a_model_name_that_is_not_unicode_is_400(two_models_client: TestClient, route: str, body: dict[str, Any]
                                                 ) -> None:
    """Not a 500 (the fuzzer's find): the name was looked up in Redis, or repeated in the 404's JSON, and neither
    takes a lone surrogate."""
    param = "model" if route == COMPLETIONS else "master_model"
    response = post(two_models_client, route, {**body, param: "a\ud800"})
    assert_openai_error(response, 400, f"`{param}` must be valid Unicode text", param)


def test_with_several_models_the_named_one_answers(
    two_models_client: TestClient, stand_in_worker: list[QueuedRequest], chat_model_path: Path
) -> None:
    """Each request goes to the model it names: only ``chatty`` has a chat template."""
    response = post(two_models_client, CHAT, chat_body(model="chatty"))
    assert response.status_code == 200 and response.json()["model"] == "chatty"
    assert stand_in_worker[0].input_ids == rendered_ids(two_models_client.app.state.ctx.models["chatty"], MESSAGES)
    assert_openai_error(post(two_models_client, CHAT, chat_body()), 400, f"the model `{MODEL}` has no chat template",
                        "messages")
    assert post(two_models_client, COMPLETIONS, completion_body(model="chatty")).json()["model"] == "chatty"
    listing = two_models_client.get("/v1/models").json()
    assert [card["id"] for card in listing["data"]] == [MODEL, "chatty"]
    assert two_models_client.get("/v1/models/chatty").json()["id"] == "chatty"


@pytest.mark.parametrize(("raw", "fragment"), [
    (b"{not json", "the body is not valid JSON"),
    (b"[]", "Input should be a valid dictionary"),
    (b"", "the request body is required"),
])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_body_must_be_a_json_object(client: TestClient, route: str, raw: bytes, fragment: str) -> None:
    response = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, fragment)


def test_non_json_content_type_is_415(client: TestClient) -> None:
    response = client.post(COMPLETIONS, content=b"prompt=x", headers={"content-type": "text/plain"})
    assert_openai_error(response, 415, "Content-Type must be application/json")


# --------------------------------------------------------------------------------------------- translation


async def test_completion_defaults(ctx: ServerContext) -> None:
    """OpenAI's defaults: temperature 1 (sampling), top_p 1, max_tokens 16; a server-chosen seed; the model's
    top_k, as on the TGI routes."""
    request = await resolve_completion(ctx)
    assert request.request_id == "cmpl-1"
    assert request.input_ids == AutoTokenizer.from_pretrained(ctx.model.path)(PROMPT)["input_ids"]
    params = request.params
    assert (params.do_sample, params.temperature, params.top_p, params.max_new_tokens) == (True, 1.0, 1.0, 16)
    assert params.top_k == min(ctx.model.default_top_k, ctx.model.vocab_size)
    assert (params.repetition_penalty, params.stop, request.decoder_input_details) == (1.0, [], False)
    assert 0 < params.seed < 2**64


async def test_chat_defaults(chat_ctx: ServerContext) -> None:
    """Chat has no max_tokens default but the server's cap, maxIterTimes."""
    params = (await resolve_chat(chat_ctx)).params
    assert (params.do_sample, params.temperature, params.top_p) == (True, 1.0, 1.0)
    assert params.max_new_tokens == MAX_ITER_TIMES


@pytest.mark.parametrize(("temperature", "do_sample", "resolved"), [
    (0, False, 1.0), (0.0, False, 1.0), (5e-6, False, 1.0), (1e-5, True, 1e-5), (0.7, True, 0.7), (2, True, 2.0),
])
async def test_temperature_zero_is_greedy(
    ctx: ServerContext, temperature: float, do_sample: bool, resolved: float
) -> None:
    params = (await resolve_completion(ctx, temperature=temperature)).params
    assert (params.do_sample, params.temperature) == (do_sample, resolved)


@pytest.mark.parametrize(("fields", "attribute", "resolved"), [
    ({"top_p": 1}, "top_p", 1.0),
    ({"top_p": 1e-9}, "top_p", 1e-9),
    ({"max_tokens": 1}, "max_new_tokens", 1),
    ({"max_tokens": MAX_ITER_TIMES + 1}, "max_new_tokens", MAX_ITER_TIMES),  # capped at maxIterTimes (SPEC.md)
    ({"max_tokens": 2**70}, "max_new_tokens", MAX_ITER_TIMES),
    ({"seed": 0}, "seed", 0),
    ({"seed": INT64_MAX}, "seed", INT64_MAX),
    ({"seed": -1}, "seed", 2**64 - 1),  # a negative seed is used modulo 2^64
    ({"seed": -(2**63)}, "seed", 2**63),
    ({"stop": "\n"}, "stop", ["\n"]),
    ({"stop": ["a", "b", "c", "d"]}, "stop", ["a", "b", "c", "d"]),
    ({"stop": []}, "stop", []),
    # vLLM's extras: top_k -1 and 0 are off, a top_k past the vocabulary is all of it
    ({"top_k": 5}, "top_k", 5),
    ({"top_k": 0}, "top_k", 0),
    ({"top_k": -1}, "top_k", 0),
    ({"top_k": 2**31 - 1}, "top_k", 4096),
    ({"repetition_penalty": 1.3}, "repetition_penalty", 1.3),
    ({"repetition_penalty": 0.5}, "repetition_penalty", 0.5),
    ({"ignore_eos": True}, "ignore_eos", True),
    ({"ignore_eos": False}, "ignore_eos", False),
    ({"stop_token_ids": [2, 4095]}, "stop_token_ids", [2, 4095]),
    ({"stop_token_ids": []}, "stop_token_ids", []),
])
async def test_completion_parameters(ctx: ServerContext, fields: dict[str, Any], attribute: str, resolved: Any) -> None:
    assert getattr((await resolve_completion(ctx, **fields)).params, attribute) == resolved


@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT]])
async def test_text_prompt_forms(ctx: ServerContext, prompt: Any) -> None:
    expected = AutoTokenizer.from_pretrained(ctx.model.path)(PROMPT)["input_ids"]
    assert (await resolve_completion(ctx, prompt=prompt)).input_ids == expected


@pytest.mark.parametrize("prompt", [[1, 396, 0], [[1, 396, 0]]])
async def test_token_id_prompt_forms(ctx: ServerContext, prompt: Any) -> None:
    """Token ids are used as given: no BOS is added."""
    assert (await resolve_completion(ctx, prompt=prompt)).input_ids == [1, 396, 0]


async def test_token_id_edge_below_the_vocabulary(ctx: ServerContext) -> None:
    vocab_size = ctx.model.vocab_size
    assert (await resolve_completion(ctx, prompt=[vocab_size - 1])).input_ids == [vocab_size - 1]


# Values that are accepted because they ask for nothing unsupported; ``user`` and ``metadata`` are documented
# as accepted and ignored (they cannot change the output).
HARMLESS = {
    "n": 1, "best_of": 1, "echo": False, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0.0,
    "logit_bias": {}, "user": "user-1234", "stream": False, "metadata": {"a": "b"}, "min_tokens": 0,
}


async def test_harmless_values_are_accepted(ctx: ServerContext) -> None:
    request = await resolve_completion(ctx, **HARMLESS)
    assert request.params.max_new_tokens == 16


async def test_null_means_unset(ctx: ServerContext, chat_ctx: ServerContext) -> None:
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                           "frequency_penalty", "logit_bias", "user", "metadata", "stream", "stream_options", "top_k",
                           "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens"])
    completion = await resolve_completion(ctx, **nulls, echo=None, best_of=None, suffix=None, logprobs=None)
    assert (completion.params.do_sample, completion.params.max_new_tokens, completion.params.stop) == (True, 16, [])
    assert (completion.params.top_k, completion.params.repetition_penalty) == (ctx.model.default_top_k, 1.0)
    assert (completion.params.ignore_eos, completion.params.stop_token_ids) == (False, [])
    chat = await resolve_chat(chat_ctx, **nulls, max_completion_tokens=None, logprobs=None, top_logprobs=None,
                              response_format=None, tools=None, tool_choice=None, functions=None, function_call=None,
                              parallel_tool_calls=None)
    assert chat.params.max_new_tokens == MAX_ITER_TIMES


def rendered_ids(model: ModelInfo, messages: list[dict[str, str]]) -> list[int]:
    """The ids transformers gives the rendered messages (the pod renders and tokenizes without it)."""
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_chat_messages_are_rendered_with_the_template(chat_ctx: ServerContext) -> None:
    """The template's text, tokenized without adding special tokens: its own BOS is the only one."""
    request = await resolve_chat(chat_ctx)
    assert request.request_id == "chatcmpl-1"
    assert request.input_ids == rendered_ids(chat_ctx.model, MESSAGES)
    reference = AutoTokenizer.from_pretrained(chat_ctx.model.path)
    bos = reference.bos_token_id
    assert request.input_ids[0] == bos and request.input_ids.count(bos) == 1
    prompt = reference.decode(request.input_ids, skip_special_tokens=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHello<|im_end|>" in prompt


async def test_chat_message_forms(chat_ctx: ServerContext) -> None:
    """Text parts are joined with newlines, ``developer`` is the system role, ``name`` reaches the template,
    an assistant turn and harmless tool fields are accepted."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "name": "ann",
         "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi!", "tool_calls": []},
        {"role": "user", "content": ""},
    ]
    request = await resolve_chat(chat_ctx, messages=messages, tools=[], tool_choice="none",
                                 response_format={"type": "text"}, logprobs=False, top_logprobs=0,
                                 parallel_tool_calls=False)
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere", "name": "ann"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": ""}]
    assert request.input_ids == rendered_ids(chat_ctx.model, expected)


@pytest.mark.parametrize(("fields", "resolved"), [
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 6}, 6),
    ({"max_tokens": 7, "max_completion_tokens": 7}, 7),
    ({"max_completion_tokens": MAX_ITER_TIMES + 1}, MAX_ITER_TIMES),
])
async def test_chat_token_limit(chat_ctx: ServerContext, fields: dict[str, Any], resolved: int) -> None:
    assert (await resolve_chat(chat_ctx, **fields)).params.max_new_tokens == resolved


async def test_chat_sampling_is_translated_as_for_completions(chat_ctx: ServerContext) -> None:
    params = (await resolve_chat(chat_ctx, temperature=0, top_p=0.5, seed=7, stop=["\n\n"])).params
    assert (params.do_sample, params.top_p, params.seed, params.stop) == (False, 0.5, 7, ["\n\n"])
    params = (await resolve_chat(chat_ctx, top_k=3, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[9])).params
    assert (params.top_k, params.repetition_penalty, params.ignore_eos, params.stop_token_ids) == (3, 1.1, True, [9])


# --------------------------------------------------------------------------------------------- responses


def test_completion_response(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    response = post(client, COMPLETIONS, completion_body(max_tokens=3))
    assert response.status_code == 200
    body = response.json()
    request = stand_in_worker[0]
    assert body["id"] == request.request_id and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"text": "Hello", "index": 0, "logprobs": None, "finish_reason": "length"}]
    prompt_tokens = len(request.input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}


def test_the_end_user_reaches_the_job(
    client: TestClient, chat_client: TestClient, stand_in_worker: list[QueuedRequest]
) -> None:
    """OpenAI's ``user`` goes to the job (its log line names it), on both routes; unset, none."""
    assert post(client, COMPLETIONS, completion_body(user="ann")).status_code == 200
    assert post(chat_client, CHAT, chat_body(user="bob")).status_code == 200
    assert post(client, COMPLETIONS, completion_body()).status_code == 200
    assert [request.user for request in stand_in_worker] == ["ann", "bob", None]
    response = post(client, COMPLETIONS, completion_body(user="x" * 257))
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"


def test_chat_response(chat_client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    body = post(chat_client, CHAT, chat_body()).json()
    assert body["id"] == stand_in_worker[0].request_id and body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("reason", "expected"), [("eos_token", "stop"), ("stop_sequence", "stop"), ("length", "length")]
)
def test_finish_reasons(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, reason: FinishReason, expected: str
) -> None:
    async def fake_submit(ctx, request):
        return FakeSubmission(ctx, canned_events(request, ["a"], reason))

    patch_submit(monkeypatch, fake_submit)
    assert post(client, COMPLETIONS, completion_body()).json()["choices"][0]["finish_reason"] == expected
    stream = sse_data(post(client, COMPLETIONS, completion_body(stream=True)).text)
    assert stream[-2]["choices"][0]["finish_reason"] == expected


def test_completion_stream(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    """One chunk per non-empty delta, a closing chunk with the finish reason, ``[DONE]``; no usage key."""
    response = post(client, COMPLETIONS, completion_body(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert all(" " not in line[len("data: ") :] for line in lines), "chunks are compact JSON"
    *chunks, done = sse_data(response.text)
    assert done == "[DONE]"
    request_id = stand_in_worker[0].request_id
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {(request_id, "text_completion", MODEL)}
    assert len({c["created"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"text": "Hel", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": "lo", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    ]


def test_chat_stream(chat_client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    """The role first (content ""), content deltas, an empty delta with the finish reason, ``[DONE]``."""
    *chunks, done = sse_data(post(chat_client, CHAT, chat_body(stream=True)).text)
    assert done == "[DONE]"
    assert {(c["id"], c["object"]) for c in chunks} == {(stand_in_worker[0].request_id, "chat.completion.chunk")}
    assert all("usage" not in c for c in chunks)
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hel"}, None),
        ({"content": "lo"}, None),
        ({}, "length"),
    ]
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stream_include_usage(chat_client: TestClient, stand_in_worker: list[QueuedRequest], route: str) -> None:
    """OpenAI's form: every chunk has ``usage`` null, then one extra chunk with no choices and the usage."""
    body = completion_body() if route == COMPLETIONS else chat_body()
    body.update(stream=True, stream_options={"include_usage": True})
    *chunks, usage_chunk, done = sse_data(post(chat_client, route, body).text)
    assert done == "[DONE]"
    assert all(c["usage"] is None and c["choices"] for c in chunks)
    prompt_tokens = len(stand_in_worker[0].input_ids)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                    "total_tokens": prompt_tokens + 3}
    assert usage_chunk["id"] == chunks[0]["id"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stream_continuous_usage(chat_client: TestClient, stand_in_worker: list[QueuedRequest],
                                 route: str) -> None:
    """vLLM's continuous_usage_stats (guidellm sends it): every chunk has the usage so far, growing by the
    chunk's tokens ("lo" also brings the held-back token), the last choice chunk's equal to the usage chunk's."""
    body = completion_body() if route == COMPLETIONS else chat_body()
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, usage_chunk, done = sse_data(post(chat_client, route, body).text)
    assert done == "[DONE]"
    prompt_tokens = len(stand_in_worker[0].input_ids)
    assert all(c["choices"] and c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == ([0] if route == CHAT else []) + [1, 3, 3]  # (the role,) "Hel", "lo", the finish reason
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                                           "total_tokens": prompt_tokens + 3}


def test_continuous_usage_needs_include_usage(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    """As in vLLM, continuous_usage_stats alone adds no usage."""
    body = completion_body(stream=True, stream_options={"continuous_usage_stats": True})
    *chunks, done = sse_data(post(client, COMPLETIONS, body).text)
    assert done == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in chunks)


def test_stream_without_include_usage(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    body = completion_body(stream=True, stream_options={"include_usage": False})
    *chunks, done = sse_data(post(client, COMPLETIONS, body).text)
    assert all("usage" not in c and c["choices"] for c in chunks)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_failure_after_the_stream_started_is_a_last_error_event(
    chat_client: TestClient, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    async def failing(ctx, request):
        first = canned_events(request, ["Hel", "lo"], "length")[:1]
        return FakeSubmission(ctx, first, PipelineError("the worker died", "generation"))

    patch_submit(monkeypatch, failing)
    body = completion_body(stream=True) if route == COMPLETIONS else chat_body(stream=True)
    response = post(chat_client, route, body)
    assert response.status_code == 200
    events = sse_data(response.text)
    assert "[DONE]" not in events
    assert events[-1] == {"error": {"message": "the worker died", "type": "server_error", "param": None,
                                    "code": "generation"}}
    assert "Hel" in json.dumps(events[-2])


def test_chat_role_chunk_goes_out_with_the_first_token(chat_client: TestClient,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM: the role chunk waits for the first token (vLLM's ``bench serve`` times the first token by the
    first chunk with choices), so a request that fails before its first token streams the error alone."""

    async def failing(ctx, request):
        return FakeSubmission(ctx, [], PipelineError("the worker died", "generation"))

    patch_submit(monkeypatch, failing)
    response = post(chat_client, CHAT, chat_body(stream=True))
    assert response.status_code == 200
    assert sse_data(response.text) == [{"error": {"message": "the worker died", "type": "server_error",
                                                  "param": None, "code": "generation"}}]


@pytest.mark.parametrize(("error_type", "status", "openai_type"), [
    ("generation", 500, "server_error"),
    ("incomplete_generation", 500, "server_error"),
    ("overloaded", 503, "server_error"),
    ("unavailable", 503, "server_error"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_pipeline_failures(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, error_type: str, status: int, openai_type: str, stream: bool
) -> None:
    """Failures before the stream starts (queue full, Redis down) and of a whole non-stream request."""

    async def failing(ctx, request):
        if stream:
            raise PipelineError("no luck", error_type)
        return FakeSubmission(ctx, [], PipelineError("no luck", error_type))

    patch_submit(monkeypatch, failing)
    response = post(client, COMPLETIONS, completion_body(stream=stream))
    assert_openai_error(response, status, "no luck", None, error_type, openai_type)


def test_duplicate_request_id_is_400(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    async def duplicate(ctx, request):
        raise PipelineError(f"a request with id '{request.request_id}' is already in flight", "validation")

    patch_submit(monkeypatch, duplicate)
    assert_openai_error(post(client, COMPLETIONS, completion_body()), 400, "is already in flight")


# --------------------------------------------------------------------------------------------- models


def test_models(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    card = listing["data"][0]
    assert (card["id"], card["object"], card["owned_by"]) == (MODEL, "model", "ferry")
    assert isinstance(card["created"], int)
    assert client.get(f"/v1/models/{MODEL}").json() == card
    assert_openai_error(client.get("/v1/models/org/other-model"), 404, "The model `org/other-model` does not exist",
                        "model", "model_not_found")


@pytest.mark.parametrize(("method", "path", "status"), [
    ("get", "/v1/nope", 404),
    ("post", "/v1/embeddings", 404),
    ("get", "/v1", 404),
    ("get", COMPLETIONS, 405),
    ("post", "/v1/models", 405),
])
def test_unknown_routes_answer_in_openai_format(client: TestClient, method: str, path: str, status: int) -> None:
    """Not FastAPI's ``{"detail": ...}``: the openai client reads ``error.message``."""
    code = "not_found" if status == 404 else "method_not_allowed"
    message = assert_openai_error(client.request(method, path), status, path, None, code)
    assert ("no such route" if status == 404 else "is not allowed") in message
