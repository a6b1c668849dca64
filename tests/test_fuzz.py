"""Property tests: whatever body a client sends to a TGI, KServe, OpenAI or MindIE route, the answer is never a 5xx.

Bodies are built from the request schemas' field names with values of random types (often plausible,
often not), plus raw random bytes under random content types. Requests go through FastAPI's TestClient
over fakeredis; a request that passes validation is answered by a stand-in for the queue and the workers
(tests/fakes.py), so no worker runs. Every 4xx must be in the route's own error format, with a status the
route's protocol gives; on the OpenAI and MindIE routes every 200 must be the route's own answer (or stream),
and bodies built valid must get one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import PIL.Image
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.mindie.routes import NUL_STREAM
from api.mindie.schemas import NUL
from api.mindie_format import REQUEST_UUID
from api.openai.schemas import CHAT_ROLES, INT32_MAX, INT64_MAX, INT64_MIN, TOOL_ROLES
from api.rules import MAX_INPUT_CHARS
from api.tgi_format import UINT32_MAX_PARAM, UINT64_MAX
from common.settings import ModelEntry, Settings
from tests.fakes import one_token_submit, patch_submit
from tests.helpers import examples
from tests.sse import sse_data

FUZZ = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL, SECOND_MODEL = "fuzz", "second"  # the two models the app serves (client)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LOAD_ADAPTER, UNLOAD_ADAPTER = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
STAND_IN_TEXT = "x"  # what the stand-in worker generates (one_token_submit)
TINY_VOCABULARY = 4096  # the tiny model's vocabulary size

TGI_PARAMETERS = [
    "best_of", "decoder_input_details", "details", "do_sample", "max_new_tokens", "repetition_penalty",
    "return_full_text", "seed", "temperature", "top_k", "top_p", "truncate", "typical_p", "watermark", "stop",
    "adapter_id", "frequency_penalty", "grammar",
]
SAMPLING = ["temperature", "top_k", "top_p", "do_sample", "seed", "repetition_penalty", "max_new_tokens"]

# Leaves: every JSON type, edge numbers, text that is not valid Unicode once decoded (lone surrogates).
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-7, 0.5, 1.0, 1.0000001, 2.0]),
    st.text(max_size=20),
    st.sampled_from(["", "\ud800", "a\udfffb", "input0", "output0", "UINT32", "hello 你好"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


def maybe(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything."""
    return st.one_of(plausible, plausible, json_values)


def objects(fields: dict[str, st.SearchStrategy[Any]], extra: bool = True, *,
            required: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the ``required`` fields (whose values may still be anything), any subset of ``fields`` and,
    sometimes, unknown keys."""
    base = st.fixed_dictionaries(required or {}, optional=fields)
    if not extra:
        return base
    return st.tuples(base, st.dictionaries(st.text(max_size=8), json_values, max_size=2)).map(
        lambda parts: {**parts[1], **parts[0]}
    )


parameter_values: dict[str, st.SearchStrategy[Any]] = {
    name: maybe(st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(-1, 3), st.text(max_size=5)))
    for name in TGI_PARAMETERS
}
tgi_bodies = objects({
    "inputs": maybe(st.text(max_size=40)),
    "parameters": maybe(objects(parameter_values)),
    "stream": maybe(st.booleans()),
})

# The multimodal list form: sources from the allowed one to every kind of refusal (no network is reached: no
# host is listed in ALLOWED_MEDIA_DOMAINS_ENV), as the seed's string or OpenAI's {"url": ...}.
media_paths = st.one_of(st.sampled_from([
    "test.png", "notes.png", "missing.png", "../escape.png", "/etc/passwd", "file:///etc/passwd", "file://host/x",
    "http://169.254.169.254/", "http://127.0.0.1.nip.io/a.png", "https://[::1]/a.png", "ftp://x/y.png", "",
    "data:image/jpeg;base64,/9j/4AAQ", "data:image/png;base64,AAAA", "data:,", "\x00", "a\ud800",
]), st.text(max_size=20))
media_sources = st.one_of(media_paths, media_paths, objects({"url": maybe(media_paths), "detail": json_values}))
well_formed_items = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text}, st.text(max_size=20)),
    st.tuples(st.sampled_from(["image_url", "image_url", "video_url", "audio_url"]), media_sources).map(
        lambda item: {"type": item[0], item[0]: item[1]}),
)
list_items = st.one_of(well_formed_items, well_formed_items, objects({
    "type": maybe(st.sampled_from(["text", "image_url", "video_url", "audio_url", "picture"])),
    "text": maybe(st.text(max_size=20)),
    **{kind: maybe(media_sources) for kind in ("image_url", "video_url", "audio_url")},
}))
list_tgi_bodies = objects({
    "inputs": maybe(st.lists(list_items, max_size=4)),
    "parameters": st.one_of(st.just({"max_new_tokens": 4}), maybe(objects(parameter_values))),
    "stream": maybe(st.booleans()),
})

token_ids = st.lists(st.integers(-2, 5000), max_size=6)
tensors = objects({
    "name": maybe(st.just("input0")),
    "shape": maybe(st.lists(st.integers(-1, 6), max_size=3)),
    "datatype": maybe(st.sampled_from(["UINT32", "INT64", "FP32"])),
    "data": maybe(token_ids),
    "parameters": maybe(objects({name: parameter_values[name] for name in SAMPLING + ["binary_data_size"]
                                 if name in parameter_values})),
})
infer_bodies = objects({
    "id": maybe(st.text(max_size=10)),
    "inputs": maybe(st.lists(tensors, max_size=2)),
    "outputs": maybe(st.lists(objects({"name": maybe(st.just("output0")), "parameters": json_values}), max_size=2)),
    "parameters": maybe(objects({name: parameter_values[name] for name in SAMPLING})),
    **{name: parameter_values[name] for name in SAMPLING},
})
generate_bodies = objects({
    "text_input": maybe(st.text(max_size=40)),
    "parameters": maybe(objects({**{name: parameter_values[name] for name in SAMPLING},
                                 "stop": parameter_values["stop"], "max_tokens": parameter_values["max_new_tokens"]})),
    "stop": parameter_values["stop"],
    **{name: parameter_values[name] for name in SAMPLING},
})
stop_bodies = objects({"id": maybe(st.text(max_size=10))})

# -- OpenAI and MindIE (vLLM's sampling fields on both) -------------------------------------------------------

LONG_TEXT = "hello world " * 2000  # more tokens than the tiny model's prompt limit (2047)
TOO_LONG_TEXT = "a" * (MAX_INPUT_CHARS + 1)  # more characters than any prompt may have
texts = st.one_of(st.text(max_size=40), st.text(max_size=40),
                  st.sampled_from(["", "\ud800", "a\udcffb", "<s>", LONG_TEXT, TOO_LONG_TEXT]))
numbers = st.one_of(st.none(), st.integers(-3, 600), st.floats(-1, 3), st.sampled_from(
    [INT32_MAX + 1, INT64_MAX + 1, INT64_MIN - 1, 2**64, 1e-320, 1e308, -0.0]))
model_names = st.one_of(st.sampled_from([MODEL, SECOND_MODEL, "dummy", "\ud800", ""]), st.text(max_size=8))
stops = st.one_of(st.none(), texts, st.lists(texts, max_size=6))
VLLM_NUMBERS = ["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "repetition_penalty", "presence_penalty",
                "frequency_penalty"]
vllm_fields = {
    **{name: maybe(numbers) for name in VLLM_NUMBERS},
    "stop": maybe(stops),
    "stop_token_ids": maybe(token_ids),
    "ignore_eos": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
}
openai_fields = {
    **vllm_fields,
    "min_tokens": maybe(numbers),
    "logit_bias": maybe(st.dictionaries(st.text(max_size=4), numbers, max_size=2)),
    "user": maybe(texts),
    "metadata": maybe(st.dictionaries(st.text(max_size=4), texts, max_size=2)),
    "stream_options": maybe(objects({"include_usage": maybe(st.booleans()),
                                     "continuous_usage_stats": maybe(st.booleans())})),
}
# the model and the prompt are always there (their values may be anything): most bodies would else stop at the
# first missing field
completion_bodies = objects({
    **openai_fields,
    "echo": maybe(st.booleans()),
    "best_of": maybe(numbers),
    "suffix": maybe(texts),
    "logprobs": maybe(numbers),
}, required={"model": maybe(model_names),
             "prompt": maybe(st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=2)))})
# the content parts are the TGI list form's items: OpenAI's chat takes the same, its media only as {"url": ...}
chat_messages = objects({
    "content": maybe(st.one_of(st.none(), texts, st.lists(list_items, max_size=3))),
    "name": maybe(texts),
    "tool_calls": maybe(st.lists(json_values, max_size=1)),
}, required={"role": maybe(st.sampled_from([*CHAT_ROLES, *TOOL_ROLES, "robot"]))})
tool_choices = maybe(st.one_of(st.sampled_from(["none", "auto"]), st.dictionaries(st.text(max_size=4), json_values,
                                                                                  max_size=2)))
chat_bodies = objects({
    **openai_fields,
    "max_completion_tokens": maybe(numbers),
    "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(numbers),
    "response_format": maybe(objects({"type": maybe(st.sampled_from(["text", "json_object"]))})),
    "tools": maybe(st.lists(json_values, max_size=1)),
    "functions": maybe(st.lists(json_values, max_size=1)),
    "tool_choice": tool_choices,
    "function_call": tool_choices,
    "parallel_tool_calls": maybe(st.booleans()),
}, required={"model": maybe(model_names), "messages": maybe(st.lists(chat_messages, max_size=3))})
media_chat_bodies = st.fixed_dictionaries({
    "model": model_names,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES),
                                                "content": st.lists(list_items, max_size=4)}), min_size=1, max_size=2),
    "max_tokens": st.just(4),
})

# Bodies every rule accepts: each field in its documented range (a float parameter also within float32's normal
# range, which SamplingParams requires), ``stream_options`` only with ``stream`` true.
prompt_texts = st.text(min_size=1, max_size=20)
vocabulary_ids = st.integers(0, TINY_VOCABULARY - 1)
valid_openai_fields = {
    "max_tokens": st.integers(min_value=1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.integers(-1, INT32_MAX),
    "n": st.just(1),
    "seed": st.integers(INT64_MIN, INT64_MAX),
    "repetition_penalty": st.floats(1e-6, 1e6),
    "presence_penalty": st.sampled_from([0, 0.0]),
    "frequency_penalty": st.sampled_from([0, 0.0]),
    "stop": st.one_of(prompt_texts, st.lists(prompt_texts, max_size=4)),
    "stop_token_ids": st.lists(vocabulary_ids, max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.just(0),
    "logit_bias": st.just({}),
    "user": st.text(max_size=10),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
}


def valid(required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
          ) -> st.SearchStrategy[dict[str, Any]]:
    """Valid OpenAI bodies: ``required`` and the shared fields, with ``stream_options`` only when streaming."""
    bodies = st.fixed_dictionaries({"model": st.sampled_from([MODEL, SECOND_MODEL]), **required},
                                   optional={**valid_openai_fields, **optional})
    return bodies.map(lambda body: body if body.get("stream") else {k: v for k, v in body.items()
                                                                    if k != "stream_options"})


valid_completion_bodies = valid(
    {"prompt": st.one_of(prompt_texts, st.lists(vocabulary_ids, min_size=1, max_size=6)).flatmap(
        lambda prompt: st.sampled_from([prompt, [prompt]]))},
    {"echo": st.just(False), "best_of": st.just(1), "suffix": st.just(""), "logprobs": st.none()},
)
valid_chat_bodies = valid(
    {"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(CHAT_ROLES),
         "content": st.one_of(st.text(max_size=20), st.lists(st.builds(lambda text: {"type": "text", "text": text},
                                                                        st.text(max_size=10)), max_size=3))},
        optional={"name": st.text(max_size=5)}), min_size=1, max_size=3)},
    {"max_completion_tokens": st.integers(min_value=1), "logprobs": st.just(False), "top_logprobs": st.just(0),
     "response_format": st.just({"type": "text"}), "tools": st.just([]), "functions": st.just([]),
     "tool_choice": st.just("none"), "function_call": st.just("none"), "parallel_tool_calls": st.booleans()},
).map(lambda body: {**body, "max_tokens": body["max_completion_tokens"]}  # both given: the same
       if {"max_tokens", "max_completion_tokens"} <= set(body) else body)

ADAPTER_FOLDERS = {"lora": '{"peft_type": "LORA"}', "prefix": '{"peft_type": "PREFIX_TUNING"}', "broken": "{",
                   "empty": None}
ADAPTER_NAMES = ["fuzz-a", "fuzz-b/c"]


def adapter_bodies(root: Path, load: bool) -> st.SearchStrategy[dict[str, Any]]:
    """``/v1/load_lora_adapter`` (``load``) or ``/v1/unload_lora_adapter`` bodies: a few names that load, unload
    and load again, folders in ``root`` (an adapter's, others') and paths out of it, or that no file system
    takes."""
    inside = [str(root / name) for name in [*ADAPTER_FOLDERS, "notes.txt", "missing", "a\udcffb", "lora/../lora"]]
    paths = st.one_of(st.sampled_from([*inside, str(root / ".."), f"{root}/../{root.name}/lora", "/etc", "", "\x00",
                                       "\ud800"]), st.text(max_size=10))
    names = st.one_of(st.sampled_from(ADAPTER_NAMES), st.sampled_from(ADAPTER_NAMES),
                      st.sampled_from([MODEL, "a b", "x" * 257]), st.text(max_size=8))
    required = {"lora_name": maybe(names), **({"lora_path": maybe(paths)} if load else {})}
    return objects({"master_model": maybe(model_names)}, required=required)


vllm_bodies = objects({
    **vllm_fields,
    "best_of": maybe(numbers),
    **{name: maybe(st.booleans()) for name in ("include_stop_str_in_output", "skip_special_tokens", "use_beam_search")},
}, required={"prompt": maybe(texts)})
# vLLM's body, sometimes with TGI's fields too (`inputs` and `prompt` together are a conflict)
vllm_generate_bodies = st.one_of(vllm_bodies, vllm_bodies, st.tuples(vllm_bodies, tgi_bodies).map(
    lambda bodies: {**bodies[1], **bodies[0]}))
mindie_infer_bodies = objects({
    "inputs": maybe(texts),
    "input_id": maybe(token_ids),
    "stream": maybe(st.booleans()),
    "parameters": maybe(objects({**parameter_values, "priority": maybe(numbers), "timeout": maybe(numbers)})),
})
tokenizer_bodies = objects({}, required={"inputs": maybe(texts)})
valid_vllm_bodies = st.fixed_dictionaries({"prompt": prompt_texts}, optional={
    **{name: valid_openai_fields[name] for name in ("temperature", "top_p", "n", "repetition_penalty", "stop",
                                                    "presence_penalty", "frequency_penalty", "stop_token_ids",
                                                    "ignore_eos", "stream")},
    "max_tokens": st.integers(1, UINT32_MAX_PARAM),
    "top_k": st.one_of(st.just(-1), st.integers(1, UINT32_MAX_PARAM)),
    "seed": st.integers(0, UINT64_MAX),
    "include_stop_str_in_output": st.just(False),
    "skip_special_tokens": st.just(True),
    "best_of": st.just(1),
    "use_beam_search": st.just(False),
})


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder LoRA adapters may be loaded from: one adapter (the API pod reads only its config), and
    folders that are none."""
    root = tmp_path_factory.mktemp("fuzz-adapters")
    for folder, config in ADAPTER_FOLDERS.items():
        (root / folder).mkdir()
        if config is not None:
            (root / folder / "adapter_config.json").write_text(config)
    (root / "notes.txt").write_text("not a folder")
    return root


@pytest.fixture(scope="module")
def client(tiny_model_path: Path, adapter_root: Path) -> Iterator[TestClient]:
    """The app over fakeredis, with a stand-in worker answering one token to every accepted request. It serves
    two models, so that an OpenAI ``model`` it does not serve is a 404."""
    settings = Settings(model_path=tiny_model_path, model_name=MODEL, max_iter_times=512,
                        lora_adapter_roots=[adapter_root], models=[ModelEntry(name=SECOND_MODEL, path=tiny_model_path)])
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis())
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, one_token_submit)
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c


@pytest.fixture(scope="module")
def vlm_client(tiny_vlm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app serving the tiny VLM, with an allowed folder holding one image and one text named ``.png``."""
    media = tmp_path_factory.mktemp("fuzz-media")
    with (media / "test.png").open("wb") as image:
        PIL.Image.new("RGB", (8, 8), (200, 10, 10)).save(image, format="PNG")
    (media / "notes.png").write_text("not an image")
    settings = Settings(model_path=tiny_vlm_path, max_iter_times=512, multimodal_input_dir=media)
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis())
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, one_token_submit)
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c


def post(client: TestClient, path: str, content: bytes, content_type: str | None = "application/json"):
    headers = {"content-type": content_type} if content_type is not None else {}
    return client.post(path, content=content, headers=headers)


ERROR_KEYS = {"tgi": {"error", "error_type"}, "mindie": {"error", "error_type"}, "kserve": {"error"},
              "openai": {"error"}}
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def check(response: httpx.Response, protocol: str, sent: Any, statuses: Collection[int] | None = None) -> None:
    """Never a 5xx, and one of ``statuses`` when given; a 4xx in the route's error format (MindIE's is TGI's;
    OpenAI's error an object of message, type, param and code); MindIE's routes name every answer's request in
    a ``RequestUUID`` header."""
    status = response.status_code
    assert status < 500 and (statuses is None or status in statuses), (status, response.text, sent)
    if protocol == "mindie":
        assert response.headers.get(REQUEST_UUID), (response.headers, sent)
    if status >= 400:
        body = response.json()
        assert set(body) == ERROR_KEYS[protocol], (body, sent)
        if protocol == "openai":
            error = body["error"]
            assert set(error) == OPENAI_ERROR_KEYS and error["type"] == "invalid_request_error", (body, sent)
            assert isinstance(error["message"], str), (body, sent)
            assert all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")), (body, sent)


def is_stream(response: httpx.Response) -> bool:
    return response.headers["content-type"].startswith("text/event-stream")


def openai_text(response: httpx.Response, chat: bool) -> str:
    """The text of a 200 OpenAI answer, whole or streamed (its chunks, then ``[DONE]``), in the route's shape."""
    if not is_stream(response):
        body = response.json()
        assert body["object"] == ("chat.completion" if chat else "text_completion"), body
        (choice,) = body["choices"]
        return choice["message"]["content"] if chat else choice["text"]
    *chunks, done = sse_data(response.text)
    assert done == "[DONE]", response.text
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk" if chat else "text_completion"}, chunks
    return "".join(choice["delta"].get("content", "") if chat else choice["text"]
                   for chunk in chunks for choice in chunk["choices"])


def check_openai(response: httpx.Response, route: str, sent: Any) -> None:
    """An OpenAI generation route's answer: 400 or 404 (a model not served) in OpenAI's format, else the
    stand-in worker's text in the route's shape."""
    check(response, "openai", sent, {200, 400, 404})
    if response.status_code == 200:
        assert openai_text(response, route == CHAT) == STAND_IN_TEXT, (response.text, sent)


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes


@FUZZ
@given(body=tgi_bodies, route=st.sampled_from(["/", "/generate", "/generate_stream"]))
def test_tgi_routes_never_answer_5xx(client: TestClient, body: dict[str, Any], route: str) -> None:
    check(post(client, route, encode(body)), "tgi", body)


@FUZZ
@given(body=list_tgi_bodies, route=st.sampled_from(["/", "/generate", "/generate_stream"]))
def test_the_multimodal_list_form_never_gets_a_5xx(vlm_client: TestClient, body: dict[str, Any], route: str) -> None:
    check(post(vlm_client, route, encode(body)), "tgi", body)


@FUZZ
@given(body=infer_bodies)
def test_kserve_infer_never_answers_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check(post(client, f"/v2/models/{MODEL}/infer", encode(body)), "kserve", body)


@FUZZ
@given(body=generate_bodies, route=st.sampled_from(["generate", "generate_stream"]))
def test_kserve_generate_never_answers_5xx(client: TestClient, body: dict[str, Any], route: str) -> None:
    check(post(client, f"/v2/models/{MODEL}/{route}", encode(body)), "kserve", body)


@FUZZ
@given(body=stop_bodies)
def test_stop_infer_never_answers_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check(post(client, f"/v2/models/{MODEL}/stopInfer", encode(body)), "kserve", body)


ROUTES = [("tgi", "/"), ("mindie", "/generate"), ("tgi", "/generate_stream"), ("kserve", "infer"),
          ("kserve", "generate"), ("kserve", "generate_stream"), ("kserve", "stopInfer"), ("openai", COMPLETIONS),
          ("openai", CHAT), ("openai", LOAD_ADAPTER), ("openai", UNLOAD_ADAPTER),
          ("mindie", "/infer"), ("mindie", "/infer_token"), ("mindie", "/v1/tokenizer")]


@FUZZ
@given(
    raw=st.one_of(st.binary(max_size=300), json_values.map(encode), tgi_bodies.map(encode).map(lambda b: b[:-1])),
    route=st.sampled_from(ROUTES),
    content_type=st.sampled_from([None, "application/json", "text/plain", "application/octet-stream",
                                  "application/json; charset=latin-1", "multipart/form-data"]),
)
def test_random_bytes_never_get_a_5xx(client: TestClient, raw: bytes, route: tuple[str, str], content_type) -> None:
    protocol, path = route
    if protocol == "kserve":
        path = f"/v2/models/{MODEL}/{path}"
    check(post(client, path, raw, content_type), protocol, raw)


# -- OpenAI ----------------------------------------------------------------------------------------------------


BODIES = {COMPLETIONS: completion_bodies, CHAT: chat_bodies}
VALID_BODIES = {COMPLETIONS: valid_completion_bodies, CHAT: valid_chat_bodies}


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@FUZZ
@given(data=st.data())
def test_openai_generation_never_answers_5xx(client: TestClient, route: str, data: st.DataObject) -> None:
    body = data.draw(BODIES[route])
    check_openai(post(client, route, encode(body)), route, body)


@FUZZ
@given(body=media_chat_bodies)
def test_openai_chat_media_never_get_a_5xx(vlm_client: TestClient, body: dict[str, Any]) -> None:
    check_openai(post(vlm_client, CHAT, encode(body)), CHAT, body)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@FUZZ
@given(data=st.data())
def test_valid_openai_bodies_are_answered(client: TestClient, route: str, data: st.DataObject) -> None:
    body = data.draw(VALID_BODIES[route])
    response = post(client, route, encode(body))
    assert response.status_code == 200, (response.text, body)
    check_openai(response, route, body)


@FUZZ
@given(body=valid_completion_bodies, name=model_names)
def test_a_model_not_served_is_404(client: TestClient, body: dict[str, Any], name: str) -> None:
    """A served model's name is answered, any other is 404 ``model_not_found`` (400 if it is not even Unicode)."""
    response = post(client, COMPLETIONS, encode({**body, "model": name}))
    if name in (MODEL, SECOND_MODEL):
        assert response.status_code == 200, (response.text, name)
        return
    unicode = not any("\ud800" <= char <= "\udfff" for char in name)
    check(response, "openai", name, {404 if unicode else 400})
    assert response.json()["error"]["param"] == "model", response.text
    assert response.json()["error"]["code"] == ("model_not_found" if unicode else None), response.text


@FUZZ
@given(data=st.data(), route=st.sampled_from([LOAD_ADAPTER, UNLOAD_ADAPTER]))
def test_lora_adapter_routes_never_answer_5xx(client: TestClient, adapter_root: Path, data: st.DataObject,
                                              route: str) -> None:
    body = data.draw(adapter_bodies(adapter_root, route == LOAD_ADAPTER))
    response = post(client, route, encode(body))
    check(response, "openai", body, {200, 400, 404})
    if response.status_code == 200:
        assert response.text.startswith("Success: LoRA adapter"), (response.text, body)


# -- MindIE ----------------------------------------------------------------------------------------------------


def check_vllm_generate(response: httpx.Response, sent: dict[str, Any]) -> None:
    """``/generate`` with vLLM's body: 422 in TGI's format, else vLLM's answer, the prompt and the stand-in
    worker's text, or its stream of NUL-ended deltas."""
    check(response, "mindie", sent, {200, 422})
    if response.status_code != 200:
        return
    if response.headers["content-type"] == NUL_STREAM:
        *items, rest = response.content.split(NUL)
        assert rest == b"", response.content
        assert "".join(delta for item in items for delta in json.loads(item)["text"]) == STAND_IN_TEXT, sent
    else:
        assert response.json() == {"text": [sent["prompt"] + STAND_IN_TEXT]}, sent


@FUZZ
@given(body=vllm_generate_bodies)
def test_mindie_vllm_generate_never_answers_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check_vllm_generate(post(client, "/generate", encode(body)), body)


@FUZZ
@given(body=valid_vllm_bodies)
def test_valid_vllm_generate_bodies_are_answered(client: TestClient, body: dict[str, Any]) -> None:
    response = post(client, "/generate", encode(body))
    assert response.status_code == 200, (response.text, body)
    check_vllm_generate(response, body)


@FUZZ
@given(body=mindie_infer_bodies, route=st.sampled_from(["/infer", "/infer_token"]))
def test_mindie_infer_never_answers_5xx(client: TestClient, body: dict[str, Any], route: str) -> None:
    response = post(client, route, encode(body))
    check(response, "mindie", body, {200, 422})
    if response.status_code == 200:
        answer = sse_data(response.text)[-1] if is_stream(response) else response.json()
        assert answer["generated_text"].endswith(STAND_IN_TEXT), (answer, body)
        assert answer["details"]["generated_tokens"] == 1, (answer, body)


@FUZZ
@given(body=tokenizer_bodies)
def test_mindie_tokenizer_never_answers_5xx(client: TestClient, body: dict[str, Any]) -> None:
    response = post(client, "/v1/tokenizer", encode(body))
    check(response, "mindie", body, {200, 422})
    if response.status_code == 200:
        answer = response.json()
        assert answer["token_number"] == len(answer["tokens"]) > 0, (answer, body)
