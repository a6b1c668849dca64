"""Property tests: whatever body a client sends to a TGI or KServe route, the answer is never a 5xx.

Bodies are built from the request schemas' field names with values of random types (often plausible,
often not), plus raw random bytes under random content types. Requests go through FastAPI's TestClient
over fakeredis; a request that passes validation is answered by a stand-in for the queue and the workers
(tests/fakes.py), so no worker runs. Every 4xx must be in the route's own error format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import PIL.Image
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from common.settings import Settings
from tests.fakes import one_token_submit, patch_submit

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

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


def objects(fields: dict[str, st.SearchStrategy[Any]], extra: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any subset of ``fields`` and, sometimes, unknown keys."""
    base = st.fixed_dictionaries({}, optional=fields)
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


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[TestClient]:
    """The app over fakeredis, with a stand-in worker answering one token to every accepted request."""
    app = create_app(Settings(model_path=tiny_model_path, max_iter_times=512), redis=fakeredis.FakeAsyncRedis())
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


def model(client: TestClient) -> str:
    return client.app.state.ctx.model.model_id


def post(client: TestClient, path: str, content: bytes, content_type: str | None = "application/json"):
    headers = {"content-type": content_type} if content_type is not None else {}
    return client.post(path, content=content, headers=headers)


def check(response, protocol: str, sent: Any) -> None:
    """Never a 5xx; a 4xx in the route's error format."""
    assert response.status_code < 500, (response.status_code, response.text, sent)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == ({"error", "error_type"} if protocol == "tgi" else {"error"}), (body, sent)


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
    check(post(client, f"/v2/models/{model(client)}/infer", encode(body)), "kserve", body)


@FUZZ
@given(body=generate_bodies, route=st.sampled_from(["generate", "generate_stream"]))
def test_kserve_generate_never_answers_5xx(client: TestClient, body: dict[str, Any], route: str) -> None:
    check(post(client, f"/v2/models/{model(client)}/{route}", encode(body)), "kserve", body)


@FUZZ
@given(body=stop_bodies)
def test_stop_infer_never_answers_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check(post(client, f"/v2/models/{model(client)}/stopInfer", encode(body)), "kserve", body)


ROUTES = [("tgi", "/"), ("tgi", "/generate"), ("tgi", "/generate_stream"), ("kserve", "infer"),
          ("kserve", "generate"), ("kserve", "generate_stream"), ("kserve", "stopInfer")]


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
        path = f"/v2/models/{model(client)}/{path}"
    check(post(client, path, raw, content_type), protocol, raw)
