"""Unit tests of SPEC.md section 2's rules on the KServe v2 / Triton routes, and of their other answers.

Rejections go through HTTP (FastAPI TestClient, fakeredis; validation fails before anything is queued, so no
worker runs). Accepted edges and resolved values call :func:`api.kserve.routes.to_generation_request` (and its
generate counterpart) directly. An autouse guard replaces the queueing calls so a request that is wrongly
accepted fails loudly; ``stand_in_worker`` swaps in canned answers to test response shapes over HTTP.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer
from tritonclient.http import InferResult

from api.app import create_app
from api.context import ServerContext
from api.errors import PipelineError
from api.kserve.routes import (
    infer_response,
    parse_infer_body,
    text_to_generation_request,
    to_generation_request,
)
from api.kserve.schemas import KServeGenerateRequest, KServeInferRequest, SamplingParameters
from api.pipeline import GenerationResult
from api.request import QueuedRequest
from common import keys
from common.protocol import Finish, TokenEvent, TokenInfo
from common.settings import Settings
from tests import helpers
from tests.fakes import FakeSubmission, patch_submit
from tests.helpers import LIMITS, PROMPT_IDS, assert_kserve_error, infer_body, make_ctx
from tests.sse import sse_data

MODEL = "tiny-kserve"
INFER = f"/v2/models/{MODEL}/infer"
GENERATE = f"/v2/models/{MODEL}/generate"
GENERATE_STREAM = f"/v2/models/{MODEL}/generate_stream"
HEADER = "Inference-Header-Content-Length"
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
U64_MAX = 2**64 - 1
MAX_ITER_TIMES = 64
# tests.helpers' settings, under this module's model name and iteration cap
make_settings = partial(helpers.make_settings, model_name=MODEL, max_iter_times=MAX_ITER_TIMES)
PLACES = ["input", "request", "top"]


# --------------------------------------------------------------------------------------------- helpers




def binary_request(ids: list[int], **parameters: Any) -> tuple[bytes, str]:
    """A body as tritonclient sends it by default: JSON header, then the little-endian UINT32 tensor."""
    header = json.dumps({
        "inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32",
                    "parameters": {"binary_data_size": 4 * len(ids)}}],
        "outputs": [{"name": "output0", "parameters": {"binary_data": True}}],
        "parameters": parameters,
    }).encode()
    return header + np.asarray(ids, dtype="<u4").tobytes(), str(len(header))




def resolve(ctx: ServerContext, body: dict[str, Any]) -> QueuedRequest:
    return to_generation_request(ctx, KServeInferRequest.model_validate(body))


async def resolve_generate(ctx: ServerContext, body: dict[str, Any]) -> QueuedRequest:
    return await text_to_generation_request(ctx, KServeGenerateRequest.model_validate(body))


def result_for(request: QueuedRequest, ids: list[int]) -> GenerationResult:
    tokens = [TokenInfo(id=i, text=f"<{i}>", logprob=-0.5, special=False) for i in ids]
    finish = Finish(
        finish_reason="length", generated_tokens=len(ids), prompt_tokens=len(request.input_ids),
        seed=request.params.seed, generated_text="".join(t.text for t in tokens),
    )
    return GenerationResult(tokens=tokens, finish=finish)


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def settings(tiny_model_path: Path) -> Settings:
    return make_settings(tiny_model_path)


@pytest.fixture(scope="module")
def ctx(settings: Settings) -> ServerContext:
    return make_ctx(settings)


@pytest.fixture(scope="module")
def vocab_size(ctx: ServerContext) -> int:
    return ctx.model.vocab_size


@pytest.fixture(scope="module")
def redis_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture(scope="module")
def client(settings: Settings, redis_server: fakeredis.FakeServer) -> Iterator[TestClient]:
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=redis_server))) as c:
        yield c


@pytest.fixture(autouse=True)
def nothing_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that reaches the queue fails the test (without a worker it would hang)."""

    async def refuse(ctx, request):
        raise AssertionError(f"request was accepted and queued: {request!r}")

    patch_submit(monkeypatch, refuse)


def token_events(result: GenerationResult) -> list[TokenEvent]:
    last = len(result.tokens) - 1
    return [TokenEvent(index=i, token=t, finish=result.finish if i == last else None)
            for i, t in enumerate(result.tokens)]


@pytest.fixture
def stand_in_worker(monkeypatch: pytest.MonkeyPatch) -> list[QueuedRequest]:
    """Accepted requests are recorded and answered with the generated ids 7, 8, 9."""
    accepted: list[QueuedRequest] = []

    async def fake_submit(ctx, request):
        accepted.append(request)
        return FakeSubmission(ctx, token_events(result_for(request, [7, 8, 9])))

    patch_submit(monkeypatch, fake_submit)
    return accepted


# --------------------------------------------------------------------------------------------- infer: rejections


def mutate(path: str, value: Any) -> dict[str, Any]:
    """The spec body with the field at ``path`` (dotted, list indexes as numbers) set, or deleted for ...."""
    body = copy.deepcopy(infer_body())
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = body
    for part in parents:
        node = node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return body


BAD_STRUCTURE = [
    ("inputs", ..., "`inputs`"),
    ("inputs", [], "exactly one tensor"),
    ("inputs", [infer_body()["inputs"][0]] * 2, "exactly one tensor"),
    ("inputs", {"name": "input0"}, "`inputs`"),
    ("inputs.0.name", "input1", "`inputs[0].name` must be 'input0'"),
    ("inputs.0.name", ..., "`inputs.0.name`"),
    ("inputs.0.datatype", "INT32", "`inputs[0].datatype` must be 'UINT32'"),
    ("inputs.0.datatype", "FP32", "`inputs[0].datatype` must be 'UINT32'"),
    ("inputs.0.datatype", "uint32", "`inputs[0].datatype` must be 'UINT32'"),
    ("inputs.0.datatype", "BYTES", "`inputs[0].datatype` must be 'UINT32'"),
    ("inputs.0.shape", [5], "`inputs[0].shape` must be [1, n]"),
    ("inputs.0.shape", [2, 5], "`inputs[0].shape` must be [1, n]"),
    ("inputs.0.shape", [1, 5, 1], "`inputs[0].shape` must be [1, n]"),
    ("inputs.0.shape", [1, -1], "`inputs[0].shape` must be [1, n]"),
    ("inputs.0.shape", [1, 4], "does not match `inputs[0].data`, which holds 5 ids"),
    ("inputs.0.shape", [1, 6], "does not match `inputs[0].data`, which holds 5 ids"),
    ("inputs.0.shape", ..., "`inputs.0.shape`"),
    ("inputs.0.data", [], "does not match `inputs[0].data`, which holds 0 ids"),
    ("inputs.0.data", ..., "either in `data` or"),
    ("inputs.0.data", None, "either in `data` or"),
    ("inputs.0.data", [1, -2, 3, 4, 5], "`inputs[0].data` holds UINT32 token ids"),
    ("inputs.0.data", [1, U32_MAX + 1, 3, 4, 5], "`inputs[0].data` holds UINT32 token ids"),
    ("inputs.0.data", [1, 2.0, 3, 4, 5], "`inputs.0.data.1`"),
    ("inputs.0.data", [1, True, 3, 4, 5], "`inputs.0.data.1`"),
    ("inputs.0.data", [1, "2", 3, 4, 5], "`inputs.0.data.1`"),
    ("inputs.0.data", [PROMPT_IDS], "`inputs.0.data.0`"),
    ("inputs.0.parameters", {"binary_data_size": 20}, "either in `data` or"),
    ("outputs", [{"name": "output0"}, {"name": "output0"}], "`outputs` must name at most one output, 'output0'"),
    ("outputs", {"name": "output0"}, "`outputs`"),
    ("outputs.0.name", "output1", "`outputs[0].name` must be 'output0'"),
    ("outputs.0", {}, "`outputs.0.name`"),
    ("id", "", "`id` must be 1 to 256 characters"),
    ("id", "a b", "`id` must be 1 to 256 characters"),
    ("id", "x" * 257, "`id` must be 1 to 256 characters"),
    ("id", "ünïcode", "`id` must be 1 to 256 characters"),
    ("id", 42, "`id`"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_STRUCTURE)
def test_infer_structure_rules(client: TestClient, path: str, value: Any, fragment: str) -> None:
    assert_kserve_error(client.post(INFER, json=mutate(path, value)), 400, fragment)


def test_token_ids_must_be_below_the_vocabulary(client: TestClient, vocab_size: int) -> None:
    body = infer_body([1, vocab_size, 3])
    assert_kserve_error(client.post(INFER, json=body), 400, f"< the vocabulary size {vocab_size}. Given: {vocab_size}")


def test_prompt_longer_than_the_input_limit(tiny_model_path: Path) -> None:
    app = create_app(make_settings(tiny_model_path, max_input_token_len=4), redis=fakeredis.FakeAsyncRedis())
    with TestClient(app) as c:
        assert_kserve_error(c.post(INFER, json=infer_body([1, 2, 3, 4, 5])), 400, "at most 4 tokens. Given: 5")
        long_text = {"text_input": "a b c d e f g h i j"}
        assert_kserve_error(c.post(GENERATE, json=long_text), 400, "`text_input` must have at most 4 tokens")


BAD_PARAMETERS = [
    ("temperature", 0, "`temperature` must be strictly positive"),
    ("temperature", 0.0, "`temperature` must be strictly positive"),
    ("temperature", -0.5, "`temperature` must be strictly positive"),
    ("temperature", "0.5", "temperature"),
    ("temperature", True, "temperature"),
    ("top_k", -1, "`top_k` must be >= 0 and <= 2147483647"),
    ("top_k", I32_MAX + 1, "`top_k` must be >= 0 and <= 2147483647"),
    ("top_k", 1.5, "top_k"),
    ("top_k", True, "top_k"),
    ("top_p", 0, "`top_p` must be > 0.0 and <= 1.0"),
    ("top_p", -0.1, "`top_p` must be > 0.0 and <= 1.0"),
    ("top_p", 1.0000001, "`top_p` must be > 0.0 and <= 1.0"),
    ("top_p", "0.9", "top_p"),
    ("do_sample", "true", "do_sample"),
    ("do_sample", 1, "do_sample"),
    ("seed", 0, "`seed` must be > 0 and <= 18446744073709551615"),
    ("seed", -1, "`seed` must be > 0"),
    ("seed", U64_MAX + 1, "seed"),
    ("seed", 1.5, "seed"),
    ("seed", "7", "seed"),
    ("repetition_penalty", 0, "`repetition_penalty` must be strictly positive"),
    ("repetition_penalty", -1.0, "`repetition_penalty` must be strictly positive"),
    ("max_new_tokens", 0, "`max_new_tokens` must be strictly positive"),
    ("max_new_tokens", -5, "`max_new_tokens` must be strictly positive"),
    ("max_new_tokens", MAX_ITER_TIMES + 1, f"`max_new_tokens` must be <= {MAX_ITER_TIMES} (maxIterTimes). Given: 65"),
    ("max_new_tokens", I32_MAX, f"`max_new_tokens` must be <= {MAX_ITER_TIMES}"),
]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(("name", "value", "fragment"), BAD_PARAMETERS)
def test_infer_parameter_ranges(client: TestClient, place: str, name: str, value: Any, fragment: str) -> None:
    """Every range rule holds wherever the parameter is put: inputs[0].parameters, parameters, top level."""
    assert_kserve_error(client.post(INFER, json=infer_body(place=place, **{name: value})), 400, fragment)


@pytest.mark.parametrize("place", PLACES)
def test_top_k_must_be_below_the_vocabulary(client: TestClient, vocab_size: int, place: str) -> None:
    body = infer_body(place=place, top_k=vocab_size)
    assert_kserve_error(client.post(INFER, json=body), 400, f"`top_k` must be < the vocabulary size {vocab_size}")


def test_a_parameter_given_twice_must_agree(client: TestClient) -> None:
    body = infer_body(temperature=0.5)
    body["parameters"] = {"temperature": 0.7}
    assert_kserve_error(client.post(INFER, json=body), 400, "`temperature` is given twice with different values")
    body = infer_body(place="top", seed=5)
    body["inputs"][0]["parameters"] = {"seed": 6}
    assert_kserve_error(client.post(INFER, json=body), 400, "`seed` is given twice")


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [(b"", "not valid JSON"), (b"{", "not valid JSON"), (b"[1, 2]", "object"), (b"null", "object"),
     (b'"text"', "object")],
)
def test_infer_body_must_be_a_json_object(client: TestClient, raw: bytes, fragment: str) -> None:
    response = client.post(INFER, content=raw, headers={"content-type": "application/json"})
    assert_kserve_error(response, 400, fragment)


def test_binary_tensor_rules(client: TestClient) -> None:
    raw, length = binary_request([1, 2, 3])
    post = lambda content, header: client.post(INFER, content=content, headers={HEADER: header})  # noqa: E731
    assert_kserve_error(post(raw, "ten"), 400, f"`{HEADER}` header must be an integer")
    assert_kserve_error(post(raw, "0"), 400, f"`{HEADER}` header must be > 0")
    assert_kserve_error(post(raw, str(len(raw) + 1)), 400, f"<= the body size {len(raw)}")
    assert_kserve_error(post(raw[:-1], length), 400, "`inputs[0].parameters.binary_data_size` is 12 but 11 bytes")
    assert_kserve_error(post(raw + b"\0", length), 400, "is 12 but 13 bytes")
    # 16 declared and sent, but shape [1, 3] of UINT32 takes 12
    wrong = json.loads(raw[: int(length)])
    wrong["inputs"][0]["parameters"]["binary_data_size"] = 16
    header = json.dumps(wrong).encode()
    assert_kserve_error(post(header + bytes(16), str(len(header))), 400, "takes 12 bytes of binary data. Given: 16")
    plain = json.dumps(infer_body()).encode()
    assert_kserve_error(post(plain + b"\1\0\0\0", str(len(plain))), 400, "4 bytes after the JSON header")
    wrong["inputs"][0]["parameters"]["binary_data_size"] = -1
    header = json.dumps(wrong).encode()
    assert_kserve_error(post(header, str(len(header))), 400, "`inputs[0].parameters.binary_data_size` must be >= 0")
    assert_kserve_error(post(raw, length + "x"), 400, "must be an integer")


def test_binary_tensor_ids_are_checked_against_the_vocabulary(client: TestClient, vocab_size: int) -> None:
    raw, length = binary_request([1, vocab_size])
    response = client.post(INFER, content=raw, headers={HEADER: length})
    assert_kserve_error(response, 400, f"< the vocabulary size {vocab_size}")


# --------------------------------------------------------------------------------------------- infer: acceptance


def test_spec_example_is_accepted(ctx: ServerContext) -> None:
    body = infer_body(temperature=0.5, top_k=10, top_p=0.95, do_sample=True, seed=None, repetition_penalty=1.03,
                      max_new_tokens=MAX_ITER_TIMES)
    request = resolve(ctx, body)
    assert request.request_id == "42"
    assert request.input_ids == PROMPT_IDS
    params = request.params
    assert (params.temperature, params.top_k, params.top_p, params.do_sample) == (0.5, 10, 0.95, True)
    assert params.repetition_penalty == 1.03 and params.max_new_tokens == MAX_ITER_TIMES
    assert 0 < params.seed <= U64_MAX and params.stop == []


def test_defaults(ctx: ServerContext) -> None:
    params = resolve(ctx, infer_body()).params
    assert params.do_sample is False  # SPEC.md: do_sample defaults to false (greedy) on this route
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    assert params.max_new_tokens == 20
    assert 0 < params.seed <= U64_MAX
    assert resolve(ctx, infer_body()).params.seed != params.seed  # a fresh random seed per request


def test_default_max_new_tokens_never_exceeds_max_iter_times(tiny_model_path: Path) -> None:
    small = make_ctx(make_settings(tiny_model_path, max_iter_times=8))
    assert resolve(small, infer_body()).params.max_new_tokens == 8


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    ("name", "value", "resolved"),
    [
        ("temperature", 1e-9, 1e-9), ("temperature", 5, 5.0), ("temperature", 1.0, 1.0),
        ("top_k", 0, 0), ("top_k", 1, 1), ("top_k", 10.0, 10),  # 10.0: an integer in JSON Schema's sense
        ("top_p", 1.0, 1.0), ("top_p", 1e-9, 1e-9), ("top_p", 1, 1.0),
        ("do_sample", True, True), ("do_sample", False, False),
        ("seed", 1, 1), ("seed", U64_MAX, U64_MAX),
        ("repetition_penalty", 1e-3, 1e-3), ("repetition_penalty", 2, 2.0),
        ("max_new_tokens", 1, 1), ("max_new_tokens", MAX_ITER_TIMES, MAX_ITER_TIMES), ("max_new_tokens", 2.0, 2),
    ],
)
def test_parameter_edges_accepted(ctx: ServerContext, place: str, name: str, value: Any, resolved: Any) -> None:
    assert getattr(resolve(ctx, infer_body(place=place, **{name: value})).params, name) == resolved


def test_top_k_edge_below_the_vocabulary(ctx: ServerContext, vocab_size: int) -> None:
    assert resolve(ctx, infer_body(top_k=vocab_size - 1)).params.top_k == vocab_size - 1


def test_token_id_edges(ctx: ServerContext, vocab_size: int) -> None:
    assert resolve(ctx, infer_body([0, vocab_size - 1])).input_ids == [0, vocab_size - 1]
    assert resolve(ctx, infer_body([7])).input_ids == [7]


def test_null_means_unset_everywhere(ctx: ServerContext) -> None:
    nulls = dict.fromkeys(SamplingParameters.model_fields)
    for place in PLACES:
        params = resolve(ctx, infer_body(place=place, **nulls)).params
        assert params.max_new_tokens == 20 and params.do_sample is False and params.temperature == 1.0
    body = infer_body()
    body["inputs"][0]["parameters"] = None
    body["parameters"] = None
    body["outputs"][0]["parameters"] = None
    body["id"] = None
    request = resolve(ctx, body)
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,256}", request.request_id)


def test_parameters_combine_across_places(ctx: ServerContext) -> None:
    body = infer_body(temperature=0.5, seed=None)
    body["parameters"] = {"seed": 9, "temperature": 0.5}
    body["max_new_tokens"] = 3
    params = resolve(ctx, body).params
    assert (params.temperature, params.seed, params.max_new_tokens) == (0.5, 9, 3)


def test_unknown_fields_are_ignored(ctx: ServerContext) -> None:
    """Triton clients add their own request parameters (priority, timeout, binary_data_output...)."""
    body = infer_body(typical_p=0.5, watermark=True)
    body["parameters"] = {"priority": 1, "timeout": 1000, "binary_data_output": False, "sequence_id": 0}
    body["outputs"][0]["parameters"] = {"classification": 0}
    body["model_version"] = ""
    assert resolve(ctx, body).input_ids == PROMPT_IDS


def test_ids_edges(ctx: ServerContext) -> None:
    for rid in ("a", "A-z_0", "x" * 256):
        body = infer_body()
        body["id"] = rid
        assert resolve(ctx, body).request_id == rid


def test_binary_tensor_request_is_decoded(ctx: ServerContext, vocab_size: int) -> None:
    ids = [0, 1, 258, 65537 % vocab_size, vocab_size - 1]
    raw, length = binary_request(ids, max_new_tokens=4)
    body, binary = parse_infer_body(raw, length)
    request = to_generation_request(ctx, body, binary)
    assert request.input_ids == ids and request.params.max_new_tokens == 4
    assert body.binary_output


# --------------------------------------------------------------------------------------------- infer: responses


def test_infer_json_response(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    response = client.post(INFER, json=infer_body(max_new_tokens=3))
    assert response.status_code == 200, response.text
    assert response.json() == {
        "id": "42",
        "model_name": MODEL,
        "outputs": [{"name": "output0", "datatype": "UINT32", "shape": [1, 8], "data": PROMPT_IDS + [7, 8, 9]}],
    }
    assert stand_in_worker[0].request_id == "42"


def test_infer_response_without_request_id_names_the_generated_one(
    client: TestClient, stand_in_worker: list[QueuedRequest]
) -> None:
    body = infer_body()
    del body["id"]
    payload = client.post(INFER, json=body).json()
    assert payload["id"] == stand_in_worker[0].request_id
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,256}", payload["id"])


def test_infer_binary_response_parses_in_tritonclient(
    client: TestClient, stand_in_worker: list[QueuedRequest]
) -> None:
    raw, length = binary_request(PROMPT_IDS)
    response = client.post(INFER, content=raw, headers={HEADER: length})
    assert response.status_code == 200, response.text
    header_length = int(response.headers[HEADER])
    header = json.loads(response.content[:header_length])
    assert header["outputs"] == [
        {"name": "output0", "datatype": "UINT32", "shape": [1, 8], "parameters": {"binary_data_size": 32}}
    ]
    result = InferResult.from_response_body(response.content, header_length=header_length)
    assert result.as_numpy("output0").tolist() == [PROMPT_IDS + [7, 8, 9]]


@pytest.mark.parametrize("outputs", [..., None, []], ids=["absent", "null", "empty"])
def test_infer_without_outputs_answers_output0(
    client: TestClient, stand_in_worker: list[QueuedRequest], outputs: Any
) -> None:
    """``outputs`` is optional in KServe v2 (all the model's outputs: output0); tritonclient leaves it out and
    asks for binary data with the request's ``binary_data_output`` instead."""
    body = mutate("outputs", outputs)
    response = client.post(INFER, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"] == [
        {"name": "output0", "datatype": "UINT32", "shape": [1, 8], "data": PROMPT_IDS + [7, 8, 9]}
    ]
    body["parameters"] = {"binary_data_output": True}
    response = client.post(INFER, json=body)
    result = InferResult.from_response_body(response.content, header_length=int(response.headers[HEADER]))
    assert result.as_numpy("output0").tolist() == [PROMPT_IDS + [7, 8, 9]]


def test_request_level_binary_data_output_and_output_override(
    client: TestClient, stand_in_worker: list[QueuedRequest]
) -> None:
    body = infer_body(place="request", binary_data_output=True)
    assert HEADER in client.post(INFER, json=body).headers
    body["outputs"][0]["parameters"] = {"binary_data": False}
    response = client.post(INFER, json=body)
    assert HEADER not in response.headers and response.json()["outputs"][0]["data"] == PROMPT_IDS + [7, 8, 9]


@pytest.mark.parametrize(("includes_prompt", "expected"), [(True, PROMPT_IDS + [7, 8, 9]), (False, [7, 8, 9])])
def test_output_includes_prompt_setting(tiny_model_path: Path, includes_prompt: bool, expected: list[int]) -> None:
    ctx = make_ctx(make_settings(tiny_model_path, kserve_output_includes_prompt=includes_prompt))
    body = KServeInferRequest.model_validate(infer_body())
    request = to_generation_request(ctx, body)
    payload = json.loads(infer_response(ctx, body, request, result_for(request, [7, 8, 9])).body)
    assert payload["outputs"][0]["data"] == expected
    assert payload["outputs"][0]["shape"] == [1, len(expected)]


def test_setting_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSERVE_OUTPUT_INCLUDES_PROMPT", "false")
    assert Settings().kserve_output_includes_prompt is False


def test_generation_failure_and_duplicate_id(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(ctx, request):
        return FakeSubmission(ctx, [], PipelineError("the worker ran out of memory", "generation"))

    patch_submit(monkeypatch, failing)
    assert_kserve_error(client.post(INFER, json=infer_body()), 500, "the worker ran out of memory")

    async def duplicate(ctx, request):
        raise PipelineError(f"a request with id '{request.request_id}' is already in flight", "validation")

    patch_submit(monkeypatch, duplicate)
    assert_kserve_error(client.post(INFER, json=infer_body()), 400, "a request with id '42' is already in flight")


# --------------------------------------------------------------------------------------------- models, versions


@pytest.mark.parametrize(
    ("method", "route"),
    [("post", "/v2/models/{m}/infer"), ("post", "/v2/models/{m}/generate"), ("post", "/v2/models/{m}/generate_stream"),
     ("get", "/v2/models/{m}"), ("get", "/v2/models/{m}/ready"), ("get", "/v2/models/{m}/config"),
     ("get", "/v2/models/{m}/stats")],
)
def test_unknown_model_is_404(client: TestClient, method: str, route: str) -> None:
    response = client.request(method, route.format(m="nope"), json=infer_body())
    assert assert_kserve_error(response, 404) == "Model nope not found."


@pytest.mark.parametrize(
    ("method", "route"),
    [("post", "infer"), ("get", "ready"), ("get", ""), ("post", "generate"), ("post", "generate_stream"),
     ("get", "config"), ("get", "stats")],
)
def test_versioned_routes_are_not_supported(client: TestClient, method: str, route: str) -> None:
    url = f"/v2/models/{MODEL}/versions/1" + (f"/{route}" if route else "")
    assert_kserve_error(client.request(method, url, json=infer_body()), 400, "model versions are not supported")


# --------------------------------------------------------------------------------------------- health, metadata


def test_live_and_ready_follow_worker_heartbeats(client: TestClient, redis_server: fakeredis.FakeServer) -> None:
    assert client.get("/v2/health/live").status_code == 200
    assert_kserve_error(client.get("/v2/health/ready"), 503, f"no live worker serves model {MODEL}")
    assert_kserve_error(client.get(f"/v2/models/{MODEL}/ready"), 503, "no live worker")
    beats = fakeredis.FakeRedis(server=redis_server)
    beats.zadd(keys.heartbeats(MODEL), {"cpu:test:1": time.time() - 1})  # expired: still not ready
    assert client.get("/v2/health/ready").status_code == 503
    beats.zadd(keys.heartbeats(MODEL), {"cpu:test:1": time.time() + 60})
    try:
        assert client.get("/v2/health/ready").status_code == 200
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
    finally:
        beats.delete(keys.heartbeats(MODEL))


def test_metadata(client: TestClient) -> None:
    server = client.get("/v2").json()
    assert server["name"] == "ferry" and isinstance(server["version"], str)
    assert set(server["extensions"]) >= {"binary_tensor_data", "parameters", "generate", "model_configuration",
                                         "statistics"}
    model = client.get(f"/v2/models/{MODEL}").json()
    assert model == {
        "name": MODEL,
        "versions": [],
        "platform": "pytorch_transformers",
        "inputs": [{"name": "input0", "datatype": "UINT32", "shape": [1, -1]}],
        "outputs": [{"name": "output0", "datatype": "UINT32", "shape": [1, -1]}],
    }


# --------------------------------------------------------------------------------------------- generate extension


@pytest.mark.parametrize("route", [GENERATE, GENERATE_STREAM])
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "`text_input`"),
        ({"text_input": ""}, "`text_input` cannot be empty"),
        ({"text_input": None}, "`text_input`"),
        ({"text_input": ["a"]}, "`text_input`"),
        ({"text_input": "x" * (4 * 1024 * 1024 + 1)}, "`text_input` must have at most 4194304 characters"),
        ({"text_input": "a\ud800b"}, "`text_input` must be valid Unicode text"),
        ({"text_input": "x", "stop": ["\udfff"]}, "`stop` must be valid Unicode text"),
        ({"text_input": "x", "temperature": 0}, "`temperature` must be strictly positive"),
        ({"text_input": "x", "parameters": {"top_p": 1.5}}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"text_input": "x", "parameters": {"seed": 0}}, "`seed` must be > 0"),
        ({"text_input": "x", "parameters": {"top_k": -1}}, "`top_k` must be >= 0"),
        ({"text_input": "x", "parameters": {"repetition_penalty": 0}}, "`repetition_penalty` must be strictly"),
        ({"text_input": "x", "parameters": {"do_sample": "yes"}}, "do_sample"),
        ({"text_input": "x", "parameters": {"max_tokens": 0}}, "`max_tokens` must be strictly positive"),
        ({"text_input": "x", "max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"text_input": "x", "parameters": {"max_tokens": MAX_ITER_TIMES + 1}}, f"must be <= {MAX_ITER_TIMES}"),
        ({"text_input": "x", "max_tokens": 4, "parameters": {"max_new_tokens": 5}}, "given twice"),
        ({"text_input": "x", "max_tokens": 4, "max_new_tokens": 5}, "given twice"),
        ({"text_input": "x", "parameters": {"stop": [""]}}, "each `stop` sequence must have 1 to 1024"),
        ({"text_input": "x", "parameters": {"stop": ["s"] * 1025}}, "`stop` supports up to 1024"),
        ({"text_input": "x", "stop": ["a" * 1025]}, "each `stop` sequence must have 1 to 1024"),
        ({"text_input": "x", "parameters": {"stop": [1]}}, "stop"),
        ({"text_input": "x", "parameters": []}, "parameters"),
    ],
)
def test_generate_rules(client: TestClient, route: str, body: dict[str, Any], fragment: str) -> None:
    raw = json.dumps(body)  # ASCII-escaped, so lone surrogates travel as JSON escapes, as a client may send them
    assert_kserve_error(client.post(route, content=raw, headers={"content-type": "application/json"}), 400, fragment)


def test_generate_top_k_below_the_vocabulary(client: TestClient, vocab_size: int) -> None:
    body = {"text_input": "x", "parameters": {"top_k": vocab_size}}
    assert_kserve_error(client.post(GENERATE, json=body), 400, f"< the vocabulary size {vocab_size}")


async def test_generate_acceptance(ctx: ServerContext, tiny_model_path: Path) -> None:
    request = await resolve_generate(ctx, {"text_input": "def main(", "parameters": {"stop": "\n", "max_tokens": 5}})
    assert request.input_ids == AutoTokenizer.from_pretrained(tiny_model_path)("def main(")["input_ids"]
    assert request.params.stop == ["\n"] and request.params.max_new_tokens == 5
    assert request.params.do_sample is False and request.params.max_new_tokens == 5
    request = await resolve_generate(ctx, {"text_input": "x", "max_new_tokens": MAX_ITER_TIMES, "stop": [],
                                           "temperature": 0.7, "do_sample": True, "seed": 3, "parameters": None})
    assert request.params.max_new_tokens == MAX_ITER_TIMES and request.params.stop == []
    assert (request.params.temperature, request.params.do_sample, request.params.seed) == (0.7, True, 3)
    request = await resolve_generate(ctx, {"text_input": "x", "max_tokens": 6, "parameters": {"max_new_tokens": 6,
                                                                                               "stream": True}})
    assert request.params.max_new_tokens == 6
    assert (await resolve_generate(ctx, {"text_input": "x"})).params.max_new_tokens == 20


def test_generate_response(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    response = client.post(GENERATE, json={"text_input": "def main(", "parameters": {"max_tokens": 3}})
    assert response.status_code == 200, response.text
    assert response.json() == {"model_name": MODEL, "model_version": "", "text_output": "<7><8><9>"}



def test_generate_stream_events(client: TestClient, stand_in_worker: list[QueuedRequest]) -> None:
    response = client.post(GENERATE_STREAM, json={"text_input": "def main("})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_data(response.text) == [
        {"model_name": MODEL, "model_version": "", "text_output": piece} for piece in ("<7>", "<8>", "<9>")
    ]


def test_generate_stream_failure_after_start_is_a_last_error_event(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing_stream(ctx, request):
        first = TokenEvent(index=0, token=TokenInfo(id=7, text="<7>", logprob=-0.1, special=False))
        return FakeSubmission(ctx, [first], PipelineError("the worker died", "generation"))

    patch_submit(monkeypatch, failing_stream)
    response = client.post(GENERATE_STREAM, json={"text_input": "def main("})
    assert response.status_code == 200
    events = sse_data(response.text)
    assert events[0]["text_output"] == "<7>"
    assert events[-1] == {"error": "the worker died"}


def test_generate_generation_failure_is_500(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(ctx, request):
        return FakeSubmission(ctx, [], PipelineError("boom", "generation"))

    patch_submit(monkeypatch, failing)
    assert_kserve_error(client.post(GENERATE, json={"text_input": "x"}), 500, "boom")


# --------------------------------------------------------------------------------------------- Triton's extensions


def test_model_config(client: TestClient, tiny_model_path: Path) -> None:
    """Triton's model configuration (max_batch_size 0, so the explicit batch dimension is part of ``dims``) and
    MindIE's, in one object: the deployment's settings (the built-in engine: one device per worker), MindIE's
    -1 for a KV cache the engine sizes, no KV cache swapped to host memory."""
    assert client.get(f"/v2/models/{MODEL}/config").json() == {
        "name": MODEL,
        "platform": "pytorch_transformers",
        "max_batch_size": 0,
        "input": [{"name": "input0", "data_type": "TYPE_UINT32", "dims": [1, -1]}],
        "output": [{"name": "output0", "data_type": "TYPE_UINT32", "dims": [1, -1]}],
        "model_name": MODEL,
        "input_datatype": "UINT32",
        "output_datatype": "UINT32",
        "max_seq_len": LIMITS["max_seq_len"],
        "npu_mem_size": -1,
        "cpu_mem_size": 0,
        "world_size": 1,
        "model_weight_path": str(tiny_model_path),
        "model_instance_type": "Standard",
    }


@pytest.mark.parametrize(("vllm_args", "world_size"), [
    ({}, 1), ({"tensor_parallel_size": 2}, 2), ({"tensor_parallel_size": 2, "pipeline_parallel_size": 3}, 6),
])
def test_model_config_world_size_is_vllms_devices_per_worker(
    tiny_model_path: Path, vllm_args: dict[str, int], world_size: int
) -> None:
    settings = make_settings(tiny_model_path, engine="vllm", vllm_engine_args=vllm_args, max_seq_len=512)
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as fresh:
        config = fresh.get(f"/v2/models/{MODEL}/config").json()
    assert (config["world_size"], config["max_seq_len"]) == (world_size, 512)


def test_repository_index_follows_worker_heartbeats(client: TestClient, redis_server: fakeredis.FakeServer) -> None:
    """Every served model, READY while a worker of it is alive; ``{"ready": true}`` lists only those."""
    index = client.post("/v2/repository/index")
    assert index.status_code == 200, index.text
    assert index.json() == [{"name": MODEL, "version": "", "state": "UNAVAILABLE",
                             "reason": f"no live worker serves model {MODEL}"}]
    assert client.post("/v2/repository/index", json={"ready": True}).json() == []
    beats = fakeredis.FakeRedis(server=redis_server)
    beats.zadd(keys.heartbeats(MODEL), {"cpu:test:1": time.time() + 60})
    try:
        ready = [{"name": MODEL, "version": "", "state": "READY", "reason": ""}]
        assert client.post("/v2/repository/index", json={"ready": False}).json() == ready
        assert client.post("/v2/repository/index", json={"ready": True}).json() == ready
    finally:
        beats.delete(keys.heartbeats(MODEL))
    assert_kserve_error(client.post("/v2/repository/index", json={"ready": "yes"}), 400, "`ready`")


def test_statistics_count_what_the_pipeline_recorded(settings: Settings) -> None:
    """This pod's counts and times: successes (their total, queue and inference times) and failures, as the
    pipeline records every request's end in the pod's metrics."""
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as fresh:
        empty = fresh.get(f"/v2/models/{MODEL}/stats").json()["model_stats"][0]
        assert (empty["name"], empty["version"], empty["last_inference"], empty["inference_count"]) == (MODEL, "", 0, 0)
        metrics = fresh.app.state.ctx.metrics
        before = time.time()
        for queue_time, inference_time, duration in ((0.25, 1.0, 1.5), (0.5, 2.0, 3.0)):
            finish = Finish(finish_reason="length", generated_tokens=3, prompt_tokens=5, seed=1, generated_text="x",
                            queue_time=queue_time, inference_time=inference_time)
            metrics.request_finished(MODEL, finish, duration)
        metrics.request_failed(MODEL, "generation", 0.75)
        metrics.request_refused(MODEL, "overloaded")
        every = fresh.get("/v2/models/stats").json()
        one = fresh.get(f"/v2/models/{MODEL}/stats").json()
    assert every == one and len(one["model_stats"]) == 1
    stats = one["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (2, 2)
    assert before * 1000 - 1 <= stats["last_inference"] <= time.time() * 1000 + 1
    durations = stats["inference_stats"]
    assert durations["success"] == {"count": 2, "ns": 4_500_000_000}
    assert durations["fail"] == {"count": 2, "ns": 750_000_000}
    assert durations["queue"] == {"count": 2, "ns": 750_000_000}
    assert durations["compute_infer"] == {"count": 2, "ns": 3_000_000_000}
    assert {durations[k]["count"] for k in ("compute_input", "compute_output", "cache_hit", "cache_miss")} == {0}
    assert stats["batch_stats"] == []


# --------------------------------------------------------------------------------------------- unknown routes


@pytest.mark.parametrize(("method", "path", "status"), [
    ("get", "/v2/nope", 404),
    ("post", "/v2/models/nope/unknown", 404),
    ("post", "/v2/repository/models/m/load", 404),
    ("delete", f"/v2/models/{MODEL}", 405),
    ("get", f"/v2/models/{MODEL}/infer", 405),
    ("get", "/v2/repository/index", 405),
])
def test_unknown_routes_answer_in_kserve_format(client: TestClient, method: str, path: str, status: int) -> None:
    """Not FastAPI's ``{"detail": ...}``, which tritonclient cannot decode."""
    message = assert_kserve_error(client.request(method, path), status)
    assert path in message
    if status == 405:
        assert "is not allowed" in message and client.request(method, path).headers["allow"]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("get", "/nope", 404), ("get", "/v2x", 404), ("get", "/generate", 405), ("put", "/", 405),
])
def test_other_unknown_routes_answer_in_tgi_format(client: TestClient, method: str, path: str, status: int) -> None:
    """Outside ``/v1`` (OpenAI) and ``/v2`` (KServe) a path is TGI's: ``{"error", "error_type"}``."""
    response = client.request(method, path)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error", "error_type"} and path in body["error"]
    assert body["error_type"] == ("not_found" if status == 404 else "method_not_allowed")
