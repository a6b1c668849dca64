"""Prometheus metrics of API pods (TGI's names, one registry per app) and workers, TGI's timing headers and
the per-model body of ``/health``."""

from __future__ import annotations

import time
from pathlib import Path

import fakeredis
import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from common import keys
from common.protocol import Job, SamplingParams, TokenEvent, WorkerStatus, decode_event
from common.settings import Settings
from tests.helpers import Stack, free_port, sample, scrape
from worker.main import WorkerLoop
from worker.transformers_engine import TransformersEngine

TGI_HEADERS = ("x-compute-time", "x-total-time", "x-queue-time", "x-inference-time", "x-time-per-token")






# --------------------------------------------------------------------------------------------- in-process


def test_each_app_has_its_own_registry(tiny_model_path: Path) -> None:
    settings = Settings(model_path=tiny_model_path, model_name="m")
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as one, \
            TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as two:
        one.app.state.ctx.metrics.request_refused("m", "overloaded")
        assert sample(one.get("/metrics").text, "tgi_request_count_total", model="m") == 1
        assert sample(two.get("/metrics").text, "tgi_request_count_total", model="m") is None


def test_a_refused_request_counts_as_a_failure(tiny_model_path: Path) -> None:
    settings = Settings(model_path=tiny_model_path, model_name="m", max_queue_size=1)
    server = fakeredis.FakeServer()
    fakeredis.FakeRedis(server=server).xadd(keys.job_stream("m", 1), {keys.JOB_FIELD: "{}"})  # full: any priority
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))) as client:
        assert client.post("/generate", json={"inputs": "hello"}).status_code == 429
        text = client.get("/metrics").text
    assert sample(text, "tgi_request_count_total", model="m") == 1
    assert sample(text, "tgi_request_failure_total", model="m", err="overloaded") == 1
    assert sample(text, "tgi_request_success_total", model="m") is None
    assert sample(text, "tgi_queue_size", model="m") == 1  # read from Redis at scrape time
    assert sample(text, "ferry_live_workers", model="m") == 0


def test_health_503_lists_the_models(tiny_model_path: Path) -> None:
    settings = Settings(model_path=tiny_model_path, model_name="m")
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as client:
        response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unhealthy", "error": "no live worker serves model m", "error_type": "unhealthy",
        "models": {"m": {"live_workers": 0, "pools": {}, "queue_depth": 0}},
    }


# --------------------------------------------------------------------------------------------- served stack


def test_tgi_headers_on_non_stream_responses(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/generate", headers={"x-request-id": "headers-1"},
                          json={"inputs": "def main(", "parameters": {"max_new_tokens": 5, "details": True}})
    assert response.status_code == 200
    details = response.json()["details"]
    assert response.headers["x-request-id"] == "headers-1"
    assert int(response.headers["x-prompt-tokens"]) == details["prompt_tokens"]
    assert int(response.headers["x-generated-tokens"]) == details["generated_tokens"] == 5
    millis = {name: int(response.headers[name]) for name in TGI_HEADERS}
    assert all(value >= 0 for value in millis.values())
    assert millis["x-total-time"] >= millis["x-inference-time"]
    compat = httpx.post(f"{stack.base_url}/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert int(compat.headers["x-generated-tokens"]) == 2 and "x-queue-time" in compat.headers


def test_every_protocol_is_counted_once(stack: Stack) -> None:
    model = stack.model_name
    before = scrape(stack.base_url)
    assert httpx.post(f"{stack.base_url}/generate",
                      json={"inputs": "hi", "parameters": {"max_new_tokens": 3}}).status_code == 200
    body = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2],
                        "parameters": {"max_new_tokens": 4}}], "outputs": [{"name": "output0"}]}
    assert httpx.post(f"{stack.base_url}/v2/models/{model}/infer", json=body).status_code == 200
    with httpx.stream("POST", f"{stack.base_url}/generate_stream",
                      json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}) as stream:
        assert len([line for line in stream.iter_lines() if line.startswith("data:")]) == 2
    time.sleep(0.2)  # the stream's close runs after its last byte
    after = scrape(stack.base_url)

    def delta(name: str, **labels: str) -> float:
        return (sample(after, name, model=model, **labels) or 0) - (sample(before, name, model=model, **labels) or 0)

    assert delta("tgi_request_count_total") == 3
    assert delta("tgi_request_success_total") == 3
    assert delta("tgi_request_duration_count") == 3
    assert delta("tgi_request_generated_tokens_sum") == 3 + 4 + 2
    assert delta("tgi_request_input_length_count") == 3
    assert delta("tgi_request_queue_duration_count") == 3
    assert delta("tgi_request_mean_time_per_token_duration_count") == 3
    assert delta("ferry_time_to_first_token_seconds_count") == 3  # one first token per request
    assert delta("ferry_inter_token_latency_seconds_count") == 2 + 3 + 1  # the gaps between the others
    assert 0 < delta("ferry_time_to_first_token_seconds_sum") <= delta("tgi_request_duration_sum")
    assert sample(after, "tgi_queue_size", model=model) == 0  # finished jobs are deleted from the stream
    assert sample(after, "tgi_batch_current_size", model=model) is not None
    assert sample(after, "ferry_live_workers", model=model) == 1


def test_health_lists_live_workers_per_pool(stack: Stack) -> None:
    response = httpx.get(f"{stack.base_url}/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and list(body["models"]) == [stack.model_name]
    model = body["models"][stack.model_name]
    assert (model["live_workers"], model["pools"]) == (1, {"cpu": 1}) and model["queue_depth"] >= 0


# --------------------------------------------------------------------------------------------- worker


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> TransformersEngine:
    return TransformersEngine.load(Settings(model_path=tiny_model_path, max_seq_len=64))


def test_worker_metrics_status_and_timings(engine: TransformersEngine, tiny_model_path: Path) -> None:
    loop = WorkerLoop(Settings(model_path=tiny_model_path, model_name="wm"), fakeredis.FakeRedis(), engine)
    loop.connect()
    listener = loop.redis.pubsub()
    listener.subscribe("reply:w1")
    listener.get_message(timeout=1)
    job = Job(request_id="w1", model="wm", reply_channel="reply:w1", input_ids=[1, 396, 319],
              params=SamplingParams(seed=1, max_new_tokens=4), enqueued_at=time.time() - 0.25)
    loop.redis.xadd(keys.job_stream(loop.model), {keys.JOB_FIELD: job.model_dump_json()})
    loop.run_once()  # heartbeat (with the status as it was), take the job, prefill it
    reported = WorkerStatus.model_validate_json(loop.redis.get(keys.worker_status("wm", loop.consumer)))
    assert reported.kv_budget_tokens == loop.settings.max_batch_total_tokens and reported.device == "cpu"
    status = loop.status()  # what the next heartbeat reports
    assert status.batch_size == 1 and status.kv_reserved_tokens == 3 + 4  # prompt + max_new_tokens held
    while not loop.engine.idle:
        loop.run_once()
    events = []
    while (message := listener.get_message(timeout=0.1)) is not None:
        if message["type"] == "message":
            events.append(decode_event(message["data"]))
    last = events[-1]
    assert isinstance(last, TokenEvent) and last.finish is not None
    assert last.finish.queue_time >= 0.25 and last.finish.inference_time > 0

    port = free_port()
    server = loop.metrics.serve(port, loop.settings.worker_metrics_host)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.shutdown()
    assert sample(text, "ferry_worker_generated_tokens_total", model="wm") == 4
    assert sample(text, "ferry_worker_requests_total", model="wm", reason="length") == 1
    assert sample(text, "ferry_worker_queue_wait_seconds_count", model="wm") == 1
    assert sample(text, "ferry_worker_queue_wait_seconds_sum", model="wm") >= 0.25
    assert sample(text, "ferry_worker_step_seconds_count", model="wm") >= 4
    assert sample(text, "ferry_worker_batch_size", model="wm") == 0
    assert sample(text, "ferry_worker_kv_budget_tokens", model="wm") == loop.settings.max_batch_total_tokens
    assert loop.status().batch_size == 0
