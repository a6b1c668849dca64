"""MindIE's native routes (api/mindie/routes.py): ``POST /generate`` in vLLM 0.2.6's dialect beside TGI's, ``/infer``,
``/infer_token``, ``/v1/tokenizer`` and the ``RequestUUID`` header.

Shapes, validation and headers run in-process over fakeredis with a stand-in worker (tests/fakes.py); generation
runs end to end through the ``stack`` fixture (separate API and worker processes over a real Redis).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api.app import create_app
from api.context import ServerContext
from api.request import QueuedRequest
from common import keys
from common.protocol import decode_event
from common.settings import Settings
from tests.fakes import FakeSubmission, one_token_submit, patch_submit
from tests.helpers import HEX_ID, Stack, assert_mindie_error, start_stack, stop_stack
from tests.sse import sse_data

PROMPT = "def main("
MAX_ITER_TIMES = 64


# --------------------------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def queued() -> list[QueuedRequest]:
    return []


@pytest.fixture(scope="module")
def client(tiny_model_path: Path, queued: list[QueuedRequest]) -> Iterator[TestClient]:
    """The app over fakeredis; every queued request is answered with one token "x" by a stand-in worker."""

    async def submit(ctx: ServerContext, request: QueuedRequest) -> FakeSubmission:
        queued.append(request)
        return await one_token_submit(ctx, request)

    settings = Settings(model_path=tiny_model_path, max_iter_times=MAX_ITER_TIMES)
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, submit)
        with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as c:
            yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(tiny_model_path)




def test_vllm_generate_shape_and_resolved_fields(client: TestClient, queued: list[QueuedRequest]) -> None:
    response = client.post("/generate", json={"prompt": "hello", "temperature": 0, "top_k": -1, "stop": "\n"})
    assert response.status_code == 200, response.text
    assert response.json() == {"text": ["hellox"]}
    request = queued[-1]
    assert response.headers["RequestUUID"] == request.request_id
    params = request.params
    assert not params.do_sample and params.top_k == 0 and params.stop == ["\n"]
    assert params.max_new_tokens == MAX_ITER_TIMES  # unset max_tokens: maxIterTimes
    named = client.post("/generate", json={"prompt": "hello"}, headers={"x-request-id": "vllm-1"})
    assert named.headers["RequestUUID"] == queued[-1].request_id == "vllm-1"
    assert_mindie_error(client.post("/generate", json={"prompt": "hello"}, headers={"x-request-id": "a b"}),
                            "`x-request-id` must be")


def test_vllm_generate_samples_by_default_as_vllm(client: TestClient, queued: list[QueuedRequest]) -> None:
    body = {"prompt": "hello", "max_tokens": 5, "top_k": 7, "top_p": 0.5, "seed": 0, "repetition_penalty": 1.2,
            "presence_penalty": 0, "frequency_penalty": 0.0, "stop_token_ids": [2], "ignore_eos": True,
            "include_stop_str_in_output": False, "skip_special_tokens": True, "n": 1, "stream": None}
    assert client.post("/generate", json=body).status_code == 200
    params = queued[-1].params
    assert params.do_sample and params.temperature == 1.0 and params.top_k == 7 and params.top_p == 0.5
    assert params.seed == 0 and params.repetition_penalty == 1.2 and params.max_new_tokens == 5
    assert params.stop_token_ids == [2] and params.ignore_eos


def test_tgi_generate_still_tgi(client: TestClient, queued: list[QueuedRequest]) -> None:
    response = client.post("/generate", json={"inputs": "hello", "parameters": {"details": True}})
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == "x" and response.json()["details"]["generated_tokens"] == 1
    assert response.headers["RequestUUID"] == response.headers["x-request-id"] == queued[-1].request_id
    named = client.post("/generate", json={"inputs": "hello"}, headers={"x-request-id": "mine-1"})
    assert named.headers["RequestUUID"] == named.headers["x-request-id"] == "mine-1"
    assert_mindie_error(client.post("/generate", json={"inputs": "hello", "parameters": {"top_p": 1.0}}),
                            "`top_p` must be > 1e-06 and < 1.0")


def test_vllm_stream_is_nul_delimited_deltas(client: TestClient) -> None:
    with client.stream("POST", "/generate", json={"prompt": "hello", "stream": True}) as response:
        assert response.status_code == 200
        assert HEX_ID.match(response.headers["RequestUUID"])
        raw = response.read()
    assert raw.endswith(b"\0")
    assert [json.loads(part) for part in raw.split(b"\0") if part] == [{"text": ["x"]}]


@pytest.mark.parametrize(("body", "fragments"), [
    ({"inputs": "a", "prompt": "b"}, ["`inputs` (TGI) and `prompt` (vLLM) cannot both be given"]),
    ({}, ["`inputs`: Field required"]),  # neither: TGI's body, as before
    ({"max_tokens": 3}, ["`inputs`: Field required"]),
    ({"prompt": ""}, ["`prompt` cannot be empty"]),
    ({"prompt": 3}, ["prompt"]),
    ({"prompt": "a", "temperature": -0.5}, ["`temperature` must be >= 0"]),
    ({"prompt": "a", "top_k": 0}, ["`top_k` must be -1 (off) or in [1,"]),
    ({"prompt": "a", "top_p": 0}, ["`top_p` must be > 0 and <= 1"]),
    ({"prompt": "a", "top_p": 1.5}, ["`top_p` must be > 0 and <= 1"]),
    ({"prompt": "a", "max_tokens": 0}, ["`max_tokens` must be strictly positive"]),
    ({"prompt": "a", "seed": -1}, ["`seed` must be >= 0"]),
    ({"prompt": "a", "repetition_penalty": 0}, ["`repetition_penalty` must be strictly positive"]),
    ({"prompt": "a", "presence_penalty": 0.5}, ["`presence_penalty` is not supported, only 0"]),
    ({"prompt": "a", "frequency_penalty": -1}, ["`frequency_penalty` is not supported, only 0"]),
    ({"prompt": "a", "include_stop_str_in_output": True}, ["`include_stop_str_in_output` is only supported as false"]),
    ({"prompt": "a", "skip_special_tokens": False}, ["`skip_special_tokens` is only supported as true"]),
    ({"prompt": "a", "n": 2}, ["`n` is only supported as 1"]),
    ({"prompt": "a", "stop": [""]}, ["`stop` sequence must have 1 to"]),
    ({"prompt": "a", "stop_token_ids": [-1]}, ["`stop_token_ids` must be token ids"]),
    ({"prompt": "a", "stop_token_ids": [10**9]}, ["`stop_token_ids` must be < the vocabulary size"]),
    ({"prompt": "a", "min_p": 0.1}, ["`min_p` is not a supported parameter"]),
    ({"prompt": "a", "stream": "yes"}, ["stream"]),
])
def test_vllm_generate_validation(client: TestClient, body: dict[str, Any], fragments: list[str]) -> None:
    assert_mindie_error(client.post("/generate", json=body), *fragments)


def test_infer_text_and_token_shapes(client: TestClient, queued: list[QueuedRequest], tokenizer) -> None:
    for route in ("/infer", "/infer_token"):
        response = client.post(route, json={"inputs": PROMPT, "parameters": {"priority": 1, "timeout": 30}})
        assert response.status_code == 200, response.text
        assert response.json() == {"generated_text": "x", "details": {
            "finish_reason": "length", "generated_tokens": 1, "generated_token_ids": [5],
            "seed": queued[-1].params.seed}}
        assert queued[-1].input_ids == tokenizer(PROMPT).input_ids
        assert response.headers["RequestUUID"] == queued[-1].request_id
        ids = client.post(route, json={"input_id": [1, 396, 319], "parameters": {"seed": 9}})
        assert ids.status_code == 200, ids.text
        assert ids.json()["details"]["seed"] == 9 and queued[-1].input_ids == [1, 396, 319]


def test_infer_full_text_and_prefill(client: TestClient) -> None:
    body = {"inputs": "ab", "parameters": {"return_full_text": True, "decoder_input_details": True}}
    payload = client.post("/infer", json=body).json()
    assert payload["generated_text"] == "abx"
    assert "prefill" in payload["details"]


def test_infer_stream_sse(client: TestClient) -> None:
    with client.stream("POST", "/infer", json={"input_id": [1, 2, 3], "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert HEX_ID.match(response.headers["RequestUUID"])
        response.read()
    (event,) = sse_data(response.text)
    assert event["token"] == {"id": 5, "text": "x"}
    assert isinstance(event["prefill_time"], float) and event["decode_time"] is None
    assert event["generated_text"] == "x"
    assert event["details"]["finish_reason"] == "length" and event["details"]["generated_tokens"] == 1


@pytest.mark.parametrize(("body", "fragments"), [
    ({"inputs": "a", "input_id": [1]}, ["Input conflict."]),
    ({}, ["either `inputs` (text) or `input_id` (token ids) is required"]),
    ({"inputs": None}, ["inputs"]),
    ({"inputs": ""}, ["`inputs` cannot be empty"]),
    ({"input_id": []}, ["`input_id` cannot be empty"]),
    ({"input_id": [-1]}, ["`input_id` must be token ids, >= 0"]),
    ({"input_id": [10**9]}, ["`input_id` token ids must be < the vocabulary size"]),
    ({"inputs": "a", "parameters": {"priority": 0}}, ["`priority` must be in [1, 5]"]),
    ({"inputs": "a", "parameters": {"priority": 6}}, ["`priority` must be in [1, 5]"]),
    ({"inputs": "a", "parameters": {"timeout": 0}}, ["`timeout` must be in [1, 65535]"]),
    ({"inputs": "a", "parameters": {"timeout": 65536}}, ["`timeout` must be in [1, 65535]"]),
    ({"inputs": "a", "parameters": {"temperature": 0}}, ["`temperature` must be strictly positive"]),
    ({"inputs": "a", "parameters": {"top_k": 0}}, ["`top_k` must be strictly positive"]),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, ["`max_new_tokens` must be strictly positive"]),
    ({"inputs": "a", "stream": True, "parameters": {"decoder_input_details": True}},
     ["`decoder_input_details` == true is not supported when streaming"]),
    ({"input_id": [1], "parameters": {"return_full_text": True}}, ["`return_full_text` needs a text prompt"]),
])
@pytest.mark.parametrize("route", ["/infer", "/infer_token"])
def test_infer_validation(client: TestClient, route: str, body: dict[str, Any], fragments: list[str]) -> None:
    assert_mindie_error(client.post(route, json=body), *fragments)


def test_tokenizer(client: TestClient, tokenizer) -> None:
    text = "The quick brown fox 敏捷的棕色狐狸"
    response = client.post("/v1/tokenizer", json={"inputs": text})
    assert response.status_code == 200, response.text
    expected = tokenizer(text).input_ids
    assert response.json() == {"token_number": len(expected), "tokens": expected}
    assert HEX_ID.match(response.headers["RequestUUID"])
    assert_mindie_error(client.post("/v1/tokenizer", json={"inputs": ""}), "`inputs` cannot be empty")
    assert_mindie_error(client.post("/v1/tokenizer", json={}), "inputs")
    assert_mindie_error(client.post("/v1/tokenizer", content=b"{", headers={"content-type": "application/json"}),
                            "not valid JSON")


def test_request_uuid_is_new_per_request(client: TestClient) -> None:
    ids = {client.post("/v1/tokenizer", json={"inputs": "a"}).headers["RequestUUID"] for _ in range(3)}
    assert len(ids) == 3


def test_infer_timeout_is_the_requests_deadline(tiny_model_path: Path) -> None:
    """A worker that never answers: the request's `timeout` ends it (500 incomplete_generation, TGI's status),
    well before tokenTimeout and e2eTimeout."""

    class Silent(FakeSubmission):
        async def events(self):
            import asyncio
            await asyncio.sleep(3600)
            yield  # pragma: no cover

    async def submit(ctx: ServerContext, request: QueuedRequest) -> FakeSubmission:
        return Silent(ctx, [])

    settings = Settings(model_path=tiny_model_path, token_timeout=600, e2e_timeout=600)
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, submit)
        with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as c:
            response = c.post("/infer", json={"inputs": "a", "parameters": {"timeout": 1}})
            assert response.status_code == 500, response.text
            assert response.json() == {"error": "request timed out: its `timeout` of 1 s passed",
                                       "error_type": "incomplete_generation"}
            assert HEX_ID.match(response.headers["RequestUUID"])
            with c.stream("POST", "/infer", json={"inputs": "a", "stream": True,
                                                  "parameters": {"timeout": 1}}) as stream:
                assert stream.status_code == 200
                stream.read()
            assert sse_data(stream.text) == [{"error": "request timed out: its `timeout` of 1 s passed",
                                              "error_type": "incomplete_generation"}]


# --------------------------------------------------------------------------------------------- end to end


def test_e2e_vllm_greedy_equals_tgi_generate(stack: Stack) -> None:
    tgi = httpx.post(f"{stack.base_url}/generate", timeout=60,
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "do_sample": False}})
    vllm = httpx.post(f"{stack.base_url}/generate", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert tgi.status_code == vllm.status_code == 200, (tgi.text, vllm.text)
    assert vllm.json() == {"text": [PROMPT + tgi.json()["generated_text"]]}
    assert HEX_ID.match(vllm.headers["RequestUUID"])


def test_e2e_vllm_stream_parsed_as_a_client_does(stack: Stack) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60).json()["text"][0]
    with httpx.stream("POST", f"{stack.base_url}/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        raw = response.read()
    chunks = [json.loads(part) for part in raw.split(b"\0") if part]
    assert len(chunks) == 8
    assert PROMPT + "".join(chunk["text"][0] for chunk in chunks) == whole


def test_e2e_infer_text_and_infer_token_ids(stack: Stack, tokenizer) -> None:
    params = {"max_new_tokens": 6, "do_sample": False}
    text = httpx.post(f"{stack.base_url}/infer", json={"inputs": PROMPT, "parameters": params}, timeout=60)
    ids = httpx.post(f"{stack.base_url}/infer_token", timeout=60,
                     json={"input_id": tokenizer(PROMPT).input_ids, "parameters": params})
    assert text.status_code == ids.status_code == 200, (text.text, ids.text)
    assert text.json()["generated_text"] == ids.json()["generated_text"]
    details = ids.json()["details"]
    assert details["generated_token_ids"] == text.json()["details"]["generated_token_ids"]
    assert details["generated_tokens"] == 6 and details["finish_reason"] == "length"
    assert tokenizer.decode(details["generated_token_ids"], skip_special_tokens=True) == ids.json()["generated_text"]
    assert HEX_ID.match(ids.headers["RequestUUID"])


def test_e2e_infer_stream(stack: Stack) -> None:
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 5, "do_sample": False}}
    with httpx.stream("POST", f"{stack.base_url}/infer", json=body, timeout=60) as response:
        assert response.status_code == 200
        response.read()
    events = sse_data(response.text)
    assert len(events) == 5
    assert events[0]["prefill_time"] >= 0 and events[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in events[1:])
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["generated_tokens"] == 5


@pytest.fixture(scope="module")
def one_slot_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose one worker runs one request at a time (maxBatchSize 1): the others wait in the queue."""
    running = start_stack(redis_url, tiny_model_path, tmp_path_factory.mktemp("one-slot"),
                          {"MAX_BATCH_SIZE": "1", "MAX_ITER_TIMES": "2000"})
    yield running
    stop_stack(running)


def test_e2e_priority_orders_the_queue_behind_a_full_batch(one_slot_stack: Stack) -> None:
    """`priority` under a full batch: while one long request holds the only slot, six /infer requests of mixed
    priorities queue up in a known order; once the slot frees, they start the lowest priority number first,
    first come first served within one (read from the worker's events on Redis, in the order it published)."""
    stack, client = one_slot_stack, redis.Redis.from_url(one_slot_stack.redis_url)
    events = client.pubsub()
    events.psubscribe(keys.events_pattern("*", "*"))
    events.get_message(timeout=1)

    def queue_depth() -> int:
        return sum(client.xlen(stream) for stream in keys.job_streams(stack.model_name))

    def wait_for_depth(depth: int) -> None:
        deadline = time.monotonic() + 30
        while queue_depth() < depth:
            assert time.monotonic() < deadline, f"the queue did not reach {depth} jobs"
            time.sleep(0.01)

    request_ids: dict[str, str] = {}  # RequestUUID -> name

    def infer(name: str, priority: int) -> None:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "do_sample": False, "priority": priority}}
        response = httpx.post(f"{stack.base_url}/infer", json=body, timeout=120)
        assert response.status_code == 200, response.text
        request_ids[response.headers["RequestUUID"]] = name

    blocker = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2000, "do_sample": False}}
    with httpx.Client(timeout=60) as streamer, streamer.stream("POST", f"{stack.base_url}/infer", json=blocker) as long:
        assert long.status_code == 200
        lines = long.iter_lines()  # kept: a dropped iterator closes the stream
        next(line for line in lines if line.startswith("data:"))  # it runs: the batch is full
        threads = []
        for name, priority in (("a", 5), ("b", 3), ("c", 5), ("d", 1), ("e", 3), ("f", 1)):
            threads.append(threading.Thread(target=infer, args=(name, priority)))
            threads[-1].start()
            wait_for_depth(1 + len(threads))  # its job is queued before the next one is sent
    for thread in threads:  # the blocker's client left: the worker dropped it and took the queued ones
        thread.join(timeout=120)
    assert len(request_ids) == 6
    started = []
    while (message := events.get_message(timeout=0.5)) is not None:
        if message["type"] == "pmessage" and decode_event(message["data"]).index == 0:
            client_id = keys.request_id_of(message["channel"].decode()).rsplit(".", 1)[0]
            if client_id in request_ids:
                started.append(request_ids[client_id])
    events.close()
    client.close()
    assert started == ["d", "f", "b", "e", "a", "c"]
