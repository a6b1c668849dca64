"""Unit tests of SPEC.md section 1's request rules for the TGI routes (``POST /``, ``/generate``, ``/generate_stream``).

Rejections go through HTTP (FastAPI TestClient, fakeredis; validation fails before anything is queued, so no
worker runs). Accepted edges and resolved values call :func:`api.tgi.routes.to_generation_request` directly and look
at the :class:`QueuedRequest` it builds. An autouse guard replaces the queueing functions so a request that
is wrongly accepted fails loudly instead of waiting forever for a worker.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api.app import create_app
from api.context import MAX_INPUT_TOKENS_HARD_CAP, ServerContext
from api.request import QueuedRequest
from api.tgi.routes import to_generation_request
from api.tgi_format import TGIRequest
from common.protocol import Finish, Job, TokenEvent, TokenInfo
from common.settings import Settings
from tests.fakes import FakeSubmission, patch_submit
from tests.helpers import assert_tgi_error, make_ctx, make_settings

U32_MAX = 2147483647  # the spec's upper bound for max_new_tokens, top_k, truncate
U64_MAX = 2**64 - 1
MIB4 = 4 * 1024 * 1024
ROUTES = ["/", "/generate", "/generate_stream"]
TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。"
OPTIONAL_PARAMETERS = [
    "best_of", "decoder_input_details", "details", "do_sample", "max_new_tokens", "repetition_penalty",
    "return_full_text", "seed", "temperature", "top_k", "top_p", "truncate", "typical_p", "watermark",
    "stop", "adapter_id",
]


# --------------------------------------------------------------------------------------------- helpers


@contextmanager
def serve(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as client:
        yield client


async def resolve(ctx: ServerContext, body: dict[str, Any], stream: bool = False) -> QueuedRequest:
    return await to_generation_request(ctx, TGIRequest.model_validate(body), "rid", stream=stream)


def body_with(**parameters: Any) -> dict[str, Any]:
    return {"inputs": TEXT, "parameters": parameters}


def post_raw(client: TestClient, route: str, raw: bytes | str, **headers: str):
    return client.post(route, content=raw, headers={"content-type": "application/json", **headers})




def finish_for(request: QueuedRequest) -> Finish:
    return Finish(
        finish_reason="length",
        generated_tokens=1,
        prompt_tokens=len(request.input_ids),
        seed=request.params.seed,
        generated_text="x",
        prefill=[TokenInfo(id=i, text="p", logprob=None, special=False) for i in request.input_ids]
        if request.decoder_input_details
        else [],
    )


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def settings(tiny_model_path: Path) -> Settings:
    return make_settings(tiny_model_path)


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with serve(settings) as c:
        yield c


@pytest.fixture(scope="module")
def lenient_client(settings: Settings) -> Iterator[TestClient]:
    """Answers an unhandled server exception with 500 instead of raising it in the test (to see the status)."""
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis()), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def ctx(settings: Settings) -> ServerContext:
    return make_ctx(settings)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > 10
    return ids


@pytest.fixture(scope="module")
def model_variant(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Copies of the tiny model's tokenizer and configs (no weights: the API never loads them), edited."""

    def make(config: dict[str, Any] | None = None, generation_config: dict[str, Any] | None = None) -> Path:
        out = tmp_path_factory.mktemp("variant")
        for item in tiny_model_path.iterdir():
            if item.suffix != ".safetensors":
                shutil.copy(item, out / item.name)
        for name, updates in (("config.json", config), ("generation_config.json", generation_config)):
            if updates:
                data = json.loads((out / name).read_text())
                data.update(updates)
                (out / name).write_text(json.dumps(data))
        return out

    return make


@pytest.fixture(autouse=True)
def nothing_is_queued(monkeypatch: pytest.MonkeyPatch) -> list[QueuedRequest]:
    """Replace the queueing call: a request that reaches it records itself and fails the test, unless the
    test swaps in ``accept_requests``. Without a worker a queued request would otherwise hang."""
    queued: list[QueuedRequest] = []

    async def refuse(ctx, request):
        queued.append(request)
        raise AssertionError(f"request was accepted and queued: {request!r}")

    patch_submit(monkeypatch, refuse)
    return queued


@pytest.fixture
def accept_requests(monkeypatch: pytest.MonkeyPatch) -> list[QueuedRequest]:
    """A stand-in worker: accepted requests are recorded and answered with one token."""
    accepted: list[QueuedRequest] = []
    token = TokenInfo(id=5, text="x", logprob=-0.5, special=False)

    async def fake_submit(ctx, request):
        accepted.append(request)
        return FakeSubmission(ctx, [TokenEvent(index=0, token=token, finish=finish_for(request))])

    patch_submit(monkeypatch, fake_submit)
    return accepted


# --------------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "body, fragment",
    [
        pytest.param({}, "Field required", id="missing"),
        pytest.param({"parameters": {"max_new_tokens": 5}}, "Field required", id="missing-with-parameters"),
        pytest.param({"inputs": ""}, "cannot be empty", id="empty"),
        pytest.param({"inputs": None}, "", id="null"),
        pytest.param({"inputs": 5}, "", id="int"),
        pytest.param({"inputs": 1.5}, "", id="float"),
        pytest.param({"inputs": True}, "", id="bool"),
        pytest.param({"inputs": {"text": "hi"}}, "", id="object"),
        pytest.param({"inputs": ["hi"]}, "", id="list-of-str"),
    ],
)
def test_inputs_missing_empty_or_not_a_string(client, route, body, fragment):
    assert_tgi_error(client.post(route, json=body), "inputs", fragment)


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        pytest.param([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                      {"type": "text", "text": "what is in it?"}], "takes no image input", id="image+text"),
        pytest.param([{"type": "video_url", "video_url": {"url": "/data/multimodal_inputs/a.mp4"}}],
                     "takes no video input", id="video"),
        pytest.param([{"type": "audio_url", "audio_url": "/data/multimodal_inputs/a.wav"}], "takes no audio input",
                     id="audio"),
        pytest.param([], "should have at least 1 item", id="empty-list"),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
def test_media_items_are_refused_by_a_text_only_model(client, route, inputs, fragment):
    """The tiny model is text-only: its media items are refused naming the kind, before anything is read."""
    assert_tgi_error(client.post(route, json={"inputs": inputs}), "inputs", fragment)


def test_inputs_character_limit_is_4_mib_of_characters():
    """At most 4 MiB of *characters* (not bytes): exactly 4 Mi Chinese characters (12 MiB of UTF-8) pass the rule."""
    assert TGIRequest.model_validate({"inputs": "中" * MIB4}).inputs == "中" * MIB4
    assert TGIRequest.model_validate({"inputs": "a" * MIB4}).inputs == "a" * MIB4
    with pytest.raises(ValueError, match=r"`inputs` must have at most 4194304 characters\. Given: 4194305"):
        TGIRequest.model_validate({"inputs": "中" * (MIB4 + 1)})


@pytest.mark.parametrize("route", ROUTES)
def test_inputs_over_4_mib_of_characters_rejected(client, route):
    response = client.post(route, json={"inputs": "a" * (MIB4 + 1)})
    assert_tgi_error(response, "inputs", "at most 4194304 characters", "Given: 4194305")


async def test_inputs_are_tokenized_with_the_model_tokenizer(ctx, tokenizer, text_ids):
    request = await resolve(ctx, {"inputs": TEXT})
    assert request.input_ids == text_ids
    assert request.input_ids[0] == tokenizer.bos_token_id  # the prompt as the model sees it, BOS included
    assert request.request_id == "rid"


# ----------------------------------------------------------------------------------- token-count limit


@pytest.mark.parametrize(
    "limit_by, offset",
    [("maxInputTokenLen", 0), ("maxInputTokenLen", -1), ("maxSeqLen", +1), ("maxSeqLen", 0),
     ("max_position_embeddings", 0), ("max_position_embeddings", -1)],
)
async def test_token_count_limit_edge(limit_by, offset, tiny_model_path, model_variant, text_ids):
    """Token count (BOS included) <= min(maxInputTokenLen, maxSeqLen-1, max_position_embeddings of config.json):
    a prompt exactly at the limit passes, one token over is a 422 worded like TGI's."""
    n = len(text_ids)
    value = n + offset
    model_path, overrides = tiny_model_path, {}
    if limit_by == "maxInputTokenLen":
        overrides, limit = {"max_input_token_len": value}, value
    elif limit_by == "maxSeqLen":
        overrides, limit = {"max_seq_len": value, "max_input_token_len": 10_000}, value - 1
    else:
        model_path, limit = model_variant(config={"max_position_embeddings": value}), value
    settings = make_settings(model_path, **overrides)
    ctx = make_ctx(settings)
    assert ctx.max_input_tokens == limit
    if limit >= n:
        assert (await resolve(ctx, {"inputs": TEXT})).input_ids == text_ids
    else:
        with serve(settings) as client:
            for route in ROUTES:
                assert_tgi_error(
                    client.post(route, json={"inputs": TEXT}),
                    "inputs",
                    f"`inputs` must have less than {n - 1} tokens. Given: {n}",
                )


async def test_truncate_is_applied_before_the_token_limit(tiny_model_path, text_ids):
    n = len(text_ids)
    settings = make_settings(tiny_model_path, max_input_token_len=n - 3)
    request = await resolve(make_ctx(settings), body_with(truncate=n - 3))
    assert request.input_ids == text_ids[-(n - 3):]
    with serve(settings) as client:
        assert_tgi_error(
            client.post("/", json=body_with(truncate=n - 2)), "inputs", f"less than {n - 3} tokens. Given: {n - 2}"
        )
        assert_tgi_error(client.post("/", json={"inputs": TEXT}), "inputs", f"Given: {n}")


def test_token_limit_never_exceeds_1_mi(tiny_model_path, model_variant):
    big = 8 * MAX_INPUT_TOKENS_HARD_CAP
    settings = make_settings(
        model_variant(config={"max_position_embeddings": big}), max_seq_len=big, max_input_token_len=big - 1
    )
    assert make_ctx(settings).max_input_tokens == MAX_INPUT_TOKENS_HARD_CAP == 1024 * 1024


# --------------------------------------------------------------------------------------- rule table


RULE_REJECTIONS = [
    # (field, value, fragment of the message); TGI's validation.rs wording where the rule is the same
    ("grammar", {"type": "regex", "value": "[0-9+"}, "does not compile"),
    ("grammar", {"type": "regex", "value": 5}, "of type 'regex' takes a string value"),
    ("grammar", {"type": "json", "value": {"type": 7}}, "does not compile"),
    ("grammar", {"type": "json", "value": "{nope"}, "must be a JSON schema"),
    ("grammar", {"type": "json_schema", "value": {"name": "x"}}, "takes a value with a `schema` object"),
    ("max_new_tokens", 0, "must be strictly positive"),
    ("max_new_tokens", -1, "must be strictly positive"),
    ("max_new_tokens", U32_MAX + 1, "Given: 2147483648"),
    ("repetition_penalty", 0.0, "must be strictly positive"),
    ("repetition_penalty", 0, "must be strictly positive"),
    ("repetition_penalty", -1.5, "must be strictly positive"),
    ("seed", 0, "Given: 0"),
    ("seed", -1, "Given: -1"),
    ("seed", U64_MAX + 1, f"Given: {U64_MAX + 1}"),
    ("temperature", 0.0, "strictly positive"),
    ("temperature", 0, "strictly positive"),
    ("temperature", 1e-6, "strictly positive"),
    ("temperature", 5e-7, "strictly positive"),
    ("temperature", -1.0, "strictly positive"),
    ("top_k", 0, "must be strictly positive"),
    ("top_k", -1, "must be strictly positive"),
    ("top_k", U32_MAX + 1, "Given: 2147483648"),
    ("top_p", 1.0, "< 1.0"),
    ("top_p", 1, "< 1.0"),
    ("top_p", 1e-6, "< 1.0"),
    ("top_p", 0.0, "< 1.0"),
    ("top_p", 1.5, "< 1.0"),
    ("top_p", -0.5, "< 1.0"),
    ("truncate", 0, "must be strictly positive"),
    ("truncate", -1, "must be strictly positive"),
    ("truncate", U32_MAX + 1, "Given: 2147483648"),
    ("typical_p", 0.0, "Given: 0"),
    ("typical_p", 0, "Given: 0"),
    ("typical_p", 1.01, "Given: 1.01"),
    ("typical_p", 2, "Given: 2"),
    ("typical_p", -0.5, "Given: -0.5"),
    ("best_of", 2, "Given: 2"),
    ("best_of", 0, "Given: 0"),
    ("best_of", -1, "Given: -1"),
    ("stop", "", "1 to 1024 characters"),
    ("stop", [""], "1 to 1024 characters"),
    ("stop", ["ok", ""], "1 to 1024 characters"),
    ("stop", "x" * 1025, "Given: 1025"),
    ("stop", ["x" * 1025], "Given: 1025"),
    ("stop", ["s"] * 1025, "supports up to 1024 stop sequences. Given: 1025"),
    ("stop", ["x" * 1024] * 32 + ["y"], "Given: 32769"),
    ("adapter_id", "", "letters, digits"),
    ("adapter_id", "x" * 257, "letters, digits"),
    ("adapter_id", "bad id", "letters, digits"),
    ("adapter_id", "a:b", "letters, digits"),
    ("adapter_id", "lora@1", "letters, digits"),
    ("adapter_id", "é", "letters, digits"),
]


def _rule_id(case: tuple[str, Any, str]) -> str:
    field, value, _ = case
    shown = repr(value)
    return f"{field}={shown if len(shown) <= 24 else shown[:12] + f'..(len {len(value)})'}"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", RULE_REJECTIONS, ids=_rule_id)
def test_parameter_out_of_range_rejected(client, route, case):
    field, value, fragment = case
    assert_tgi_error(client.post(route, json=body_with(**{field: value})), field, fragment)


@pytest.mark.parametrize("route", ROUTES)
def test_stream_rejection_is_plain_json_before_the_stream(client, route):
    """A stream request's validation error is a 422 JSON answer, not an SSE event."""
    response = client.post(route, json={**body_with(top_p=1.0), "stream": True})
    assert_tgi_error(response, "top_p")
    assert "text/event-stream" not in response.headers["content-type"]


# ------------------------------------------------------------------------------- accepted edges (resolved)


GRAMMARS = [  # TGI's grammar parameter and the constraint the job carries
    ({"type": "json", "value": {"type": "object"}}, "json_schema", {"type": "object"}),
    ({"type": "json", "value": '{"type": "integer"}'}, "json_schema", {"type": "integer"}),
    ({"type": "json_schema", "value": {"name": "n", "schema": {"type": "boolean"}}}, "json_schema",
     {"type": "boolean"}),
    ({"type": "regex", "value": "[a-z]{2}"}, "regex", "[a-z]{2}"),
]


@pytest.mark.parametrize(("grammar", "kind", "value"), GRAMMARS)
async def test_a_grammar_reaches_the_job(ctx, grammar, kind, value):
    constraint = (await resolve(ctx, body_with(grammar=grammar))).constraint
    assert constraint is not None and constraint.format == kind
    if kind == "regex":
        assert constraint.value == value
    else:  # compact JSON unless the schema says otherwise
        assert json.loads(constraint.value) == {"x-guidance": {"whitespace_flexible": False}, **value}
    assert (await resolve(ctx, body_with())).constraint is None



async def test_defaults_are_resolved(ctx, text_ids):
    request = await resolve(ctx, {"inputs": TEXT})
    params = request.params
    assert request.input_ids == text_ids
    assert request.decoder_input_details is False
    assert params.model_dump(exclude={"seed"}) == {
        "do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "typical_p": 1.0,
        "repetition_penalty": 1.0, "max_new_tokens": 20, "stop": [], "stop_token_ids": [], "ignore_eos": False,
    }
    assert 0 < params.seed <= U64_MAX


@pytest.mark.parametrize(
    "value, effective",
    [(1, 1), (20, 20), (511, 511), (512, 512), (513, 512), (U32_MAX, 512)],
)
async def test_max_new_tokens_effective_is_min_of_max_iter_times(ctx, value, effective):
    assert (await resolve(ctx, body_with(max_new_tokens=value))).params.max_new_tokens == effective


@pytest.mark.parametrize(
    "parameters, effective",
    [({}, 10), ({"max_new_tokens": None}, 10), ({"max_new_tokens": 5}, 5), ({"max_new_tokens": 10}, 10),
     ({"max_new_tokens": 11}, 10)],
    ids=["default-20-capped", "null-capped", "below", "equal", "above"],
)
async def test_max_new_tokens_capped_by_small_max_iter_times(tiny_model_path, parameters, effective):
    ctx = make_ctx(make_settings(tiny_model_path, max_iter_times=10))
    assert (await resolve(ctx, body_with(**parameters))).params.max_new_tokens == effective


@pytest.mark.parametrize("value", [1e-9, 0.5, 1, 1.0, 2.5, 1e6])
async def test_repetition_penalty_accepted_when_positive(ctx, value):
    params = (await resolve(ctx, body_with(repetition_penalty=value))).params
    assert params.repetition_penalty == value
    assert params.do_sample is False  # not a warper: does not switch sampling on


@pytest.mark.parametrize("value", [1, 2, 123456789, 2**63, U64_MAX])
async def test_seed_accepted_in_range(ctx, value):
    params = (await resolve(ctx, body_with(seed=value))).params
    assert params.seed == value
    assert params.do_sample is False  # a seed alone does not switch sampling on


@pytest.mark.parametrize("parameters", [{}, {"seed": None}], ids=["unset", "null"])
async def test_missing_seed_is_random_and_in_range(ctx, parameters):
    seeds = [(await resolve(ctx, body_with(**parameters))).params.seed for _ in range(4)]
    assert all(0 < seed <= U64_MAX for seed in seeds)
    assert len(set(seeds)) == len(seeds)  # two requests get different seeds


@pytest.mark.parametrize("value", [1.1e-6, 1e-5, 0.7, 1, 2, 100.0])
async def test_temperature_accepted_above_1e_6(ctx, value):
    params = (await resolve(ctx, body_with(temperature=value))).params
    assert params.temperature == value
    assert isinstance(params.temperature, float)


@pytest.mark.parametrize("value", [1, 2, 50, 4095, 4096, 4097, 100_000, U32_MAX])
async def test_top_k_accepted_and_clamped_to_vocab_size(ctx, value):
    vocab = ctx.model.vocab_size
    assert vocab == 4096
    params = (await resolve(ctx, body_with(top_k=value))).params
    assert params.top_k == min(value, vocab)
    assert params.do_sample is True


@pytest.mark.parametrize(
    "generation_config, config, expected",
    [({"top_k": 40}, None, 40), (None, {"top_k": 30}, 30), ({"top_k": 40}, {"top_k": 30}, 40)],
    ids=["generation_config", "config", "generation_config-wins"],
)
async def test_unset_top_k_is_the_model_default(tiny_model_path, model_variant, generation_config, config, expected):
    ctx = make_ctx(make_settings(model_variant(config=config, generation_config=generation_config)))
    assert (await resolve(ctx, body_with(do_sample=True))).params.top_k == expected
    assert (await resolve(ctx, body_with(do_sample=True, top_k=7))).params.top_k == 7  # explicit wins


@pytest.mark.parametrize("value", [1.1e-6, 0.001, 0.5, 0.95, 0.999, 0.999999])
async def test_top_p_accepted_in_open_interval(ctx, value):
    params = (await resolve(ctx, body_with(top_p=value))).params
    assert params.top_p == value
    assert params.do_sample is True


@pytest.mark.parametrize("value", [1e-9, 0.2, 0.5, 0.999, 1, 1.0])
async def test_typical_p_accepted_up_to_1(ctx, value):
    assert (await resolve(ctx, body_with(typical_p=value))).params.typical_p == value


@pytest.mark.parametrize("truncate", [1, 2, 5, "n-1", "n", "n+1", U32_MAX])
async def test_truncate_keeps_the_last_n_tokens(ctx, text_ids, truncate):
    n = len(text_ids)
    keep = {"n-1": n - 1, "n": n, "n+1": n + 1}.get(truncate, truncate)
    request = await resolve(ctx, body_with(truncate=keep))
    assert request.input_ids == text_ids[-keep:]
    assert len(request.input_ids) == min(keep, n)
    if keep < n:
        assert request.input_ids[-1] == text_ids[-1] and request.input_ids[0] == text_ids[n - keep]


@pytest.mark.parametrize(
    "stop, expected",
    [
        ([], []),
        ("###", ["###"]),
        ("x" * 1024, ["x" * 1024]),
        (["\n\n", "User:"], ["\n\n", "User:"]),
        (["a"], ["a"]),
        (["x" * 1024], ["x" * 1024]),
        (["s"] * 1024, ["s"] * 1024),
        (["y" * 32] * 1024, ["y" * 32] * 1024),  # 1024 items, 32768 characters: every limit at once
        (["x" * 1024] * 32, ["x" * 1024] * 32),  # total exactly 32768
        (["停止"], ["停止"]),
    ],
    ids=["empty-list", "str", "str-1024", "two", "one-char", "item-1024", "1024-items", "1024x32",
         "total-32768", "chinese"],
)
async def test_stop_accepted_forms_and_edges(ctx, stop, expected):
    assert (await resolve(ctx, body_with(stop=stop))).params.stop == expected


@pytest.mark.parametrize("value", ["None", None])
async def test_adapter_id_none_accepted(ctx, value):
    assert (await resolve(ctx, body_with(adapter_id=value))).adapter is None  # the base model


@pytest.mark.parametrize("value", [None, 1])
async def test_best_of_null_or_1_accepted(ctx, value):
    """One sequence is what every request gets: best_of null or 1 is the request without it (the same seed, as
    an unseeded request draws its own)."""
    assert await resolve(ctx, body_with(best_of=value, seed=1)) == await resolve(ctx, body_with(seed=1))


@pytest.mark.parametrize("field", ["details", "return_full_text", "watermark", "decoder_input_details"])
@pytest.mark.parametrize("value", [True, False])
async def test_bool_flags_accepted(ctx, field, value):
    request = await resolve(ctx, body_with(**{field: value}))
    assert request.decoder_input_details is (value if field == "decoder_input_details" else False)
    assert request.params.do_sample is False


# ------------------------------------------------------------------------------------------- do_sample


@pytest.mark.parametrize(
    "parameters, sampling",
    [
        ({}, False),
        ({"do_sample": None}, False),
        ({"temperature": 0.7}, True),
        ({"temperature": 1.0}, False),  # 1.0 is no warper
        ({"temperature": 1}, False),
        ({"top_k": 5}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.9}, True),  # TGI counts typical_p < 1 as a warper
        ({"typical_p": 1.0}, False),
        ({"repetition_penalty": 1.3}, False),
        ({"seed": 42, "watermark": True, "max_new_tokens": 3}, False),
        ({"do_sample": True}, True),
        ({"do_sample": True, "temperature": 1.0}, True),
        ({"do_sample": False, "temperature": 0.7}, False),
        ({"do_sample": False, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "typical_p": 0.5}, False),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v),
)
async def test_do_sample_resolution(ctx, parameters, sampling):
    params = (await resolve(ctx, body_with(**parameters))).params
    assert params.do_sample is sampling
    if "temperature" in parameters:
        assert params.temperature == parameters["temperature"]


# ------------------------------------------------------------------------------- decoder_input_details


def test_decoder_input_details_with_stream_rejected_on_post_root(client):
    response = client.post("/", json={**body_with(decoder_input_details=True), "stream": True})
    assert_tgi_error(response, "decoder_input_details", "not supported when streaming tokens")
    assert "text/event-stream" not in response.headers["content-type"]


@pytest.mark.parametrize("stream_field", [None, True, False, "absent"])
def test_decoder_input_details_rejected_on_generate_stream(client, stream_field):
    body = body_with(decoder_input_details=True, details=True)
    if stream_field != "absent":
        body["stream"] = stream_field
    response = client.post("/generate_stream", json=body)
    assert_tgi_error(response, "decoder_input_details", "not supported when streaming tokens")


async def test_decoder_input_details_with_stream_rejected_by_to_generation_request(ctx):
    with pytest.raises(Exception, match="decoder_input_details") as info:
        await resolve(ctx, body_with(decoder_input_details=True), stream=True)
    assert getattr(info.value, "status", None) == 422


@pytest.mark.parametrize("did", [False, None])
async def test_stream_without_decoder_input_details_accepted(ctx, did):
    request = await resolve(ctx, body_with(decoder_input_details=did, details=True), stream=True)
    assert request.decoder_input_details is False


@pytest.mark.parametrize("route", ["/", "/generate"])
def test_decoder_input_details_without_stream_returns_prefill(client, accept_requests, route, text_ids):
    response = client.post(route, json=body_with(decoder_input_details=True, max_new_tokens=1))
    assert response.status_code == 200, response.text
    answer = response.json()[0] if route == "/" else response.json()
    assert accept_requests[0].decoder_input_details is True
    assert [t["id"] for t in answer["details"]["prefill"]] == text_ids


@pytest.mark.parametrize("route, body_stream", [("/", True), ("/generate_stream", None)])
def test_stream_with_details_only_is_an_sse_stream(client, accept_requests, route, body_stream):
    response = client.post(route, json={**body_with(details=True), "stream": body_stream})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert accept_requests[0].decoder_input_details is False


# ------------------------------------------------------------------------------------------ JSON types


WRONG_TYPES = {
    "bool": ["true", "false", 1, 0, 1.0, [True], {"v": True}],
    "int": ["20", 20.5, 1.5, True, [20], {"v": 20}],
    "float": ["0.5", "1e-3", True, [0.5], {"v": 0.5}],
}
FIELD_KINDS = {
    "decoder_input_details": "bool", "details": "bool", "do_sample": "bool", "return_full_text": "bool",
    "watermark": "bool", "max_new_tokens": "int", "seed": "int", "top_k": "int", "truncate": "int",
    "best_of": "int", "repetition_penalty": "float", "temperature": "float", "top_p": "float",
    "typical_p": "float",
}
WRONG_TYPE_CASES = [
    *[(field, value) for field, kind in FIELD_KINDS.items() for value in WRONG_TYPES[kind]],
    *[("adapter_id", value) for value in [5, 1.5, True, ["None"], {"id": "None"}]],
    *[("stop", value) for value in [5, 1.5, True, {"a": "b"}, [1], ["a", None], [["a"]], ["a", True]]],
]


@pytest.mark.parametrize("field, value", WRONG_TYPE_CASES, ids=lambda v: json.dumps(v))
def test_wrong_json_type_rejected_naming_the_field(client, field, value):
    assert_tgi_error(client.post("/", json=body_with(**{field: value})), field)


@pytest.mark.parametrize("field", ["repetition_penalty", "temperature", "top_p", "typical_p"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_rejected(client, field, literal):
    raw = f'{{"inputs": "hi", "parameters": {{"{field}": {literal}}}}}'
    assert_tgi_error(post_raw(client, "/", raw), field)


@pytest.mark.parametrize(
    "field, value",
    [("stream", "true"), ("stream", 1), ("stream", 0), ("stream", [True]),
     ("parameters", "max_new_tokens=5"), ("parameters", []), ("parameters", 5), ("parameters", True)],
    ids=lambda v: json.dumps(v),
)
def test_wrong_type_of_top_level_field_rejected(client, field, value):
    assert_tgi_error(client.post("/", json={"inputs": "hi", field: value}), field)


@pytest.mark.parametrize("value", [1, 2, 100, 1.0, 0.25])
async def test_json_integers_are_valid_floats(ctx, value):
    """JSON does not tell 2 from 2.0: an integer is a fine value for a float field (as in TGI's serde)."""
    params = (await resolve(ctx, body_with(repetition_penalty=value, temperature=value * 0.5))).params
    assert params.repetition_penalty == value and params.temperature == value * 0.5


def test_whole_floats_are_valid_integers(client, accept_requests):
    """JSON Schema's "integer" (what /openapi.json declares) admits 590.0: the integer fields take it."""
    parameters = {"truncate": 590.0, "max_new_tokens": 7.0, "seed": 42.0, "top_k": 3.0, "best_of": 1.0}
    response = client.post("/generate", json=body_with(**parameters))
    assert response.status_code == 200, response.text
    request = accept_requests[0]
    assert (request.params.max_new_tokens, request.params.seed, request.params.top_k) == (7, 42, 3)
    assert all(type(value) is int for value in (request.params.seed, request.params.top_k))


@pytest.mark.parametrize("value", [-1, 6, 2**40])
def test_top_n_tokens_out_of_range_rejected(client, value):
    """TGI 1.x's rule (its default --max-top-n-tokens 5); the value has no effect here (README)."""
    assert_tgi_error(client.post("/", json=body_with(top_n_tokens=value)), "top_n_tokens",
                            f"`top_n_tokens` must be >= 0 and <= 5. Given: {value}")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "raw, fragment",
    [
        ('{"inputs": "hi"', "not valid JSON"),
        ('{"inputs": "hi",}', "not valid JSON"),
        ("{'inputs': 'hi'}", "not valid JSON"),
        ('{"inputs": "hi", "parameters": {"seed": 01}}', "not valid JSON"),
        ("inputs=hi", "not valid JSON"),
        ("", "body is required"),
        ("[]", "valid dictionary"),
        ('"hi"', "valid dictionary"),
        ("null", "Input should be a valid dictionary"),
    ],
    ids=["unclosed", "trailing-comma", "single-quotes", "leading-zero", "form", "empty", "array", "string", "null"],
)
def test_malformed_or_non_object_body_rejected(client, route, raw, fragment):
    assert_tgi_error(post_raw(client, route, raw), None, fragment)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_body_without_json_content_type_gets_a_tgi_error(client, content_type):
    """A JSON body sent without ``Content-Type: application/json`` (e.g. ``curl -d``) is refused in TGI's
    error format (TGI itself answers 415)."""
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/", content=json.dumps({"inputs": "hi"}), headers=headers)
    assert response.status_code in (415, 422), response.text
    assert set(response.json()) == {"error", "error_type"}


def test_invalid_utf8_body_is_a_tgi_validation_error(lenient_client):
    response = post_raw(lenient_client, "/", b'{"inputs": "\xff\xfe hi"}')
    assert_tgi_error(response, None)


def test_too_deeply_nested_body_gets_a_tgi_error(lenient_client):
    raw = '{"inputs": "hi", "parameters": {"an_unknown_field": ' + "[" * 5000 + "]" * 5000 + "}}"
    response = post_raw(lenient_client, "/", raw)
    assert response.status_code in (400, 413, 422), response.text
    assert set(response.json()) == {"error", "error_type"}, response.text


def test_moderately_nested_unknown_field_is_ignored(client, accept_requests):
    raw = '{"inputs": "hi", "parameters": {"an_unknown_field": ' + "[" * 100 + "]" * 100 + "}}"
    assert post_raw(client, "/", raw).status_code == 200
    assert len(accept_requests) == 1


def test_lone_surrogate_in_inputs_is_a_validation_error(lenient_client):
    response = post_raw(lenient_client, "/", '{"inputs": "hi \\ud800 there"}')
    assert_tgi_error(response, "inputs")


def test_lone_surrogate_in_stop_is_a_validation_error(lenient_client, monkeypatch):
    async def serialize_job_as_the_pipeline_does(ctx, request):
        Job(request_id=request.request_id, model="m", reply_channel="c", input_ids=request.input_ids,
            params=request.params, enqueued_at=0.0).model_dump_json()  # raises PydanticSerializationError
        raise AssertionError("accepted and queued")

    patch_submit(monkeypatch, serialize_job_as_the_pipeline_does)
    response = post_raw(lenient_client, "/", '{"inputs": "hi", "parameters": {"stop": ["\\udc00"]}}')
    assert_tgi_error(response, "stop")


# ----------------------------------------------------------------------------- nulls and unknown fields


def _resolved(request: QueuedRequest) -> dict[str, Any]:
    return {"input_ids": request.input_ids, "decoder_input_details": request.decoder_input_details,
            **request.params.model_dump(exclude={"seed"})}


@pytest.mark.parametrize("field", OPTIONAL_PARAMETERS)
async def test_explicit_null_parameter_means_unset(ctx, field):
    assert _resolved(await resolve(ctx, body_with(**{field: None}))) == _resolved(await resolve(ctx, body_with()))


@pytest.mark.parametrize(
    "body",
    [
        {"inputs": TEXT, "parameters": None},
        {"inputs": TEXT, "parameters": None, "stream": None},
        {"inputs": TEXT, "stream": None},
        {"inputs": TEXT, "parameters": dict.fromkeys(OPTIONAL_PARAMETERS), "stream": None},
    ],
    ids=["parameters", "parameters+stream", "stream", "all-parameters"],
)
async def test_null_parameters_object_and_stream_mean_unset(ctx, body):
    request = await resolve(ctx, body)
    assert _resolved(request) == _resolved(await resolve(ctx, {"inputs": TEXT}))
    assert TGIRequest.model_validate(body).stream is False


# What `text-generation` 0.7's Client.generate posts for client.generate(prompt) (every field, nulls included).
TEXT_GENERATION_07_BODY = {
    "inputs": TEXT,
    "parameters": {
        "best_of": None, "decoder_input_details": False, "details": True, "do_sample": False,
        "frequency_penalty": None, "grammar": None, "max_new_tokens": 20, "repetition_penalty": None,
        "return_full_text": False, "seed": None, "stop": [], "temperature": None, "top_k": None,
        "top_n_tokens": None, "top_p": None, "truncate": None, "typical_p": None, "watermark": False,
    },
    "stream": False,
}


@pytest.mark.parametrize(
    "extra_parameters, extra_top_level",
    [
        ({"top_n_tokens": 5}, {}),
        ({"grammar": {"type": "json", "value": {"type": "object"}}}, {}),
        ({"frequency_penalty": 0.5}, {}),
        ({"top_n_tokens": 5, "grammar": {"type": "regex", "value": "a+"}, "frequency_penalty": -1.0,
          "presence_penalty": 1.0, "logit_bias": {"1": 2}}, {}),
        ({}, {"model": "tiny", "options": {"wait_for_model": True}, "unknown": [1, 2]}),
    ],
    ids=["top_n_tokens", "grammar", "frequency_penalty", "several", "top-level"],
)
async def test_unknown_fields_are_ignored(ctx, extra_parameters, extra_top_level):
    body = {"inputs": TEXT, "parameters": {"max_new_tokens": 7, **extra_parameters}, **extra_top_level}
    expected = await resolve(ctx, {"inputs": TEXT, "parameters": {"max_new_tokens": 7}})
    assert _resolved(await resolve(ctx, body)) == _resolved(expected)


async def test_text_generation_client_body_resolves_to_greedy_defaults(ctx, text_ids):
    request = await resolve(ctx, TEXT_GENERATION_07_BODY)
    assert _resolved(request) == _resolved(await resolve(ctx, {"inputs": TEXT}))
    assert request.input_ids == text_ids and request.params.do_sample is False


@pytest.mark.parametrize("route", ["/", "/generate"])
def test_text_generation_client_body_accepted_over_http(client, accept_requests, route, text_ids):
    response = client.post(route, json=TEXT_GENERATION_07_BODY)
    assert response.status_code == 200, response.text
    answer = response.json()[0] if route == "/" else response.json()
    assert answer["generated_text"] == "x"
    assert answer["details"]["seed"] == accept_requests[0].params.seed
    assert accept_requests[0].input_ids == text_ids
    assert accept_requests[0].params.max_new_tokens == 20


@pytest.mark.parametrize(
    "parameters, has_details, prefill",
    [({}, False, None), ({"details": True}, True, False), ({"decoder_input_details": True}, True, True),
     ({"details": False, "decoder_input_details": False}, False, None)],
    ids=["none", "details", "decoder_input_details", "both-false"],
)
def test_details_returned_when_either_flag_is_true(client, accept_requests, parameters, has_details, prefill):
    answer = client.post("/generate", json=body_with(**parameters)).json()
    assert ("details" in answer) is has_details
    if has_details:
        assert (answer["details"]["prefill"] != []) is prefill


@pytest.mark.parametrize("value, expected", [(True, TEXT + "x"), (False, "x"), (None, "x")])
def test_return_full_text_prefixes_the_prompt(client, accept_requests, value, expected):
    assert client.post("/generate", json=body_with(return_full_text=value)).json()["generated_text"] == expected


def test_null_parameters_accepted_over_http(client, accept_requests):
    body = {"inputs": TEXT, "parameters": None, "stream": None}
    response = client.post("/", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == [{"generated_text": "x"}]  # no details unless asked for
    assert accept_requests[0].params.max_new_tokens == 20


# ------------------------------------------------------------------------------------------ x-request-id


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "header",
    ["bad id", "a.b", "a/b", "a:b", "a+b", "{x}", "id@host", "x" * 257],
    ids=["space", "dot", "slash", "colon", "plus", "braces", "at", "257-chars"],
)
def test_bad_x_request_id_rejected(client, route, header):
    response = client.post(route, json={"inputs": "hi"}, headers={"x-request-id": header})
    assert_tgi_error(response, "x-request-id", "letters, digits")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("header", ["a", "abc-DEF_123", "0" * 256], ids=["one-char", "charset", "256-chars"])
def test_good_x_request_id_is_used(client, accept_requests, route, header):
    response = client.post(route, json={"inputs": "hi"}, headers={"x-request-id": header})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == header
    assert accept_requests[0].request_id == header


def test_missing_x_request_id_gets_a_fresh_one(client, accept_requests):
    first = client.post("/", json={"inputs": "hi"}).headers["x-request-id"]
    second = client.post("/", json={"inputs": "hi"}).headers["x-request-id"]
    assert first != second
    assert [r.request_id for r in accept_requests] == [first, second]


def test_rejections_queue_nothing(client, nothing_is_queued):
    """Sanity check of the guard: the rule violations above never reached the queue."""
    for body in (body_with(top_p=1.0), {"inputs": ""}, {**body_with(decoder_input_details=True), "stream": True}):
        assert client.post("/", json=body).status_code == 422
    assert nothing_is_queued == []
