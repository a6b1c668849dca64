"""MindIE's status, health and metrics routes (:mod:`api.mindie.routes`): ``/v2/models/{m}/getSlotCount``,
``/v1/status`` and ``/v2/status``, ``/health/timed[-N]``, ``/metrics-json``; MindIE's Prometheus names on
``/metrics`` and its ``models`` field of ``/info``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fakeredis
import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.context import ServerContext
from api.request import QueuedRequest
from common import keys
from common.protocol import Finish, WorkerStatus
from common.settings import ModelEntry, Settings
from tests.fakes import FakeSubmission, one_token_submit, patch_submit
from tests.helpers import Stack, sample, scrape

TGI_ERROR_KEYS = {"error", "error_type"}


def _with_workers(server: fakeredis.FakeServer, model: str, reports: dict[str, WorkerStatus | None],
                  queued: int = 0) -> None:
    """Live heartbeats (and reports) of workers of ``model``, and ``queued`` jobs in its stream."""
    redis = fakeredis.FakeRedis(server=server)
    redis.zadd(keys.heartbeats(model), {consumer: time.time() + 3600 for consumer in reports})
    for consumer, report in reports.items():
        if report is not None:
            redis.set(keys.worker_status(model, consumer), report.model_dump_json())
    for _ in range(queued):
        redis.xadd(keys.job_stream(model), {keys.JOB_FIELD: "{}"})


@pytest.fixture
def two_models(tiny_model_path: Path) -> Iterator[tuple[TestClient, fakeredis.FakeServer]]:
    """An app serving ``first`` (the default) and ``second`` over fakeredis, with no worker yet."""
    settings = Settings(model_name="first", max_batch_size=8, max_link_num=5,
                        models=[ModelEntry(name="first", path=tiny_model_path),
                                ModelEntry(name="second", path=tiny_model_path)])
    server = fakeredis.FakeServer()
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))) as client:
        yield client, server


# --------------------------------------------------------------------------------------------- in-process


def test_slots_status_and_metrics_json_from_the_workers_reports(
    two_models: tuple[TestClient, fakeredis.FakeServer]
) -> None:
    client, server = two_models
    busy = WorkerStatus(device="cpu", batch_size=3, waiting=1, kv_reserved_tokens=900, kv_budget_tokens=4096,
                        max_batch_size=4)
    old = {"device": "cpu", "batch_size": 1, "waiting": 0, "kv_reserved_tokens": 100, "kv_budget_tokens": 1000}
    _with_workers(server, "first", {"cpu:a:1": busy, "cpu:b:2": WorkerStatus.model_validate(old),
                                    "cpu:c:3": None}, queued=6)  # c has not reported yet
    _with_workers(server, "second", {"cpu:d:4": WorkerStatus(device="cpu", batch_size=0, waiting=0,
                                                             kv_reserved_tokens=0, kv_budget_tokens=512)})
    assert WorkerStatus.model_validate(old).max_batch_size == 0  # a report without the field still parses

    slots = client.get("/v2/models/first/getSlotCount")
    assert slots.status_code == 200 and slots.headers["RequestUUID"]
    # b reports no max_batch_size: the pod's maxBatchSize (8) stands in for it
    assert slots.json() == {"total_slots": 4 + 8, "free_slots": 1 + 7, "available_tokens_length": 3196 + 900}
    assert client.get("/v2/models/second/getSlotCount").json() == {
        "total_slots": 8, "free_slots": 8, "available_tokens_length": 512}

    first = {"live_workers": 3, "waiting_requests": 6 - 4, "running_requests": 4, "free_kv_tokens": 4096,
             "total_kv_tokens": 5096}
    second = {"live_workers": 1, "waiting_requests": 0, "running_requests": 0, "free_kv_tokens": 512,
              "total_kv_tokens": 512}
    for path in ("/v1/status", "/v2/status"):
        response = client.get(path)
        assert response.status_code == 200
        assert response.json() == {**first, "model": "first", "models": {"first": first, "second": second}}

    metrics = client.app.state.ctx.metrics
    for seconds, first_token in ((0.2, True), (0.01, False), (0.03, False), (0.4, True)):
        metrics.token_received("first", seconds, first=first_token)
    body = client.get("/metrics-json").json()
    assert body["model"] == "first"
    assert body["avg_ttft_ms"] == pytest.approx(300) and body["avg_tbt_ms"] == pytest.approx(20)
    assert (body["waiting_requests"], body["processing_requests"]) == (2, 4)
    assert body["models"]["second"] == {"avg_ttft_ms": None, "avg_tbt_ms": None, "waiting_requests": 0,
                                        "processing_requests": 0}

    text = client.get("/metrics").text
    assert sample(text, "num_requests_running", model_name="first") == 4
    assert sample(text, "num_requests_waiting", model_name="first") == 2
    assert sample(text, "num_requests_running", model_name="second") == 0

    info = client.get("/info").json()
    assert info["model_id"] == "first" and [m["model_id"] for m in info["models"]] == ["first", "second"]
    assert info["models"][0]["max_total_tokens"] == info["max_total_tokens"]
    # maxLinkNum, the pod's bound on concurrent requests, not maxBatchSize
    assert (info["max_concurrent_requests"], info["max_best_of"]) == (5, 1) and info["max_batch_total_tokens"] > 0


def test_an_unknown_model_has_no_slots(two_models: tuple[TestClient, fakeredis.FakeServer]) -> None:
    client, _ = two_models
    response = client.get("/v2/models/third/getSlotCount")
    assert response.status_code == 404 and response.headers["RequestUUID"]
    assert response.json() == {"error": "Model third not found.", "error_type": "NotFoundError"}


@pytest.mark.parametrize("path", ["/health/timed-0", "/health/timed--3", "/health/timed-abc", "/health/timed-1.5",
                                  "/health/timed-3601"])
def test_a_bad_timed_health_limit_is_422(two_models: tuple[TestClient, fakeredis.FakeServer], path: str) -> None:
    client, _ = two_models
    response = client.get(path)
    assert response.status_code == 422 and response.headers["RequestUUID"]
    body = response.json()
    assert body.keys() == TGI_ERROR_KEYS and body["error_type"] == "validation" and "seconds" in body["error"]


def test_timed_health_without_a_live_worker_fails_at_once(
    two_models: tuple[TestClient, fakeredis.FakeServer]
) -> None:
    client, _ = two_models
    started = time.monotonic()
    response = client.get("/health/timed-5")
    assert time.monotonic() - started < 2
    assert response.status_code == 500
    assert response.json() == {"status": "unhealthy", "error": "no live worker serves model first"}


def test_timed_health_fails_when_no_token_comes_in_time(
    two_models: tuple[TestClient, fakeredis.FakeServer]
) -> None:
    """A worker whose heartbeat is alive but that takes no job (hung): 500 after N seconds, not a hang."""
    client, server = two_models
    _with_workers(server, "first", {"cpu:hung:1": None})
    started = time.monotonic()
    response = client.get("/health/timed-1")
    elapsed = time.monotonic() - started
    assert response.status_code == 500
    assert response.json() == {"status": "unhealthy", "error": "no token within 1 s"}
    assert 0.9 <= elapsed < 4
    # the probe was a request like any other: queued, then counted as failed
    text = client.get("/metrics").text
    assert sample(text, "request_received_total", model_name="first") == 1
    assert sample(text, "request_failed_total", model_name="first") == 1


def test_timed_health_runs_one_probe_at_a_time(two_models: tuple[TestClient, fakeredis.FakeServer]) -> None:
    """Callers at once (kubelets send no API key: anyone may call it) wait for one probe generation, not one each."""
    client, server = two_models
    _with_workers(server, "first", {"cpu:hung:1": None})  # takes no job: the probe runs until the callers give up
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: client.get("/health/timed-1"), range(20)))
    assert {(answer.status_code, answer.json()["error"]) for answer in answers} == {(500, "no token within 1 s")}
    text = client.get("/metrics").text
    assert sample(text, "request_received_total", model_name="first") == 1
    assert sample(text, "request_failed_total", model_name="first") == 1  # cancelled with its last caller


def test_timed_health_answers_from_the_last_probe_for_a_while(
    two_models: tuple[TestClient, fakeredis.FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, server = two_models
    _with_workers(server, "first", {"cpu:a:1": None})
    probes: list[QueuedRequest] = []

    async def answer(ctx: ServerContext, request: QueuedRequest) -> FakeSubmission:
        probes.append(request)
        return await one_token_submit(ctx, request)

    patch_submit(monkeypatch, answer)
    for path in ("/health/timed", "/health/timed-3", "/health/timed"):
        assert client.get(path).json() == {"status": "healthy"}
    assert len(probes) == 1  # within timedHealthCacheSeconds (5 s) of the first
    probe = client.app.state.ctx.health_probe
    probe.last = dataclasses.replace(probe.last, at=probe.last.at - 5)
    assert client.get("/health/timed").json() == {"status": "healthy"} and len(probes) == 2


def test_both_metric_families_are_updated_by_the_same_calls(
    two_models: tuple[TestClient, fakeredis.FakeServer]
) -> None:
    client, _ = two_models
    metrics = client.app.state.ctx.metrics
    metrics.request_queued("first", 7, 16)
    metrics.request_refused("first", "overloaded")
    metrics.request_finished("first", Finish(finish_reason="length", generated_tokens=5, prompt_tokens=7, seed=1,
                                             generated_text="x"), 0.5)
    text = client.get("/metrics").text
    pairs = [("request_received_total", "tgi_request_count_total", 2),
             ("request_success_total", "tgi_request_success_total", 1),
             ("request_failed_total", "tgi_request_failure_total", 1),
             ("prompt_tokens_total", "tgi_request_input_length_sum", 7),
             ("generation_tokens_total", "tgi_request_generated_tokens_sum", 5)]
    for mindie, tgi, value in pairs:
        assert sample(text, mindie, model_name="first") == sample(text, tgi, model="first") == value, mindie


# --------------------------------------------------------------------------------------------- served stack


def test_mindie_metrics_count_the_requests_sent(stack: Stack) -> None:
    model, base = stack.model_name, stack.base_url
    before = scrape(base)
    infer = httpx.post(f"{base}/infer", json={"inputs": "def main(", "parameters": {"max_new_tokens": 3}})
    vllm = httpx.post(f"{base}/generate", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert infer.status_code == 200 and vllm.status_code == 200
    after = scrape(base)

    def delta(name: str) -> float:
        return (sample(after, name, model_name=model) or 0) - (sample(before, name, model_name=model) or 0)

    assert delta("request_received_total") == 2
    assert delta("request_success_total") == 2
    assert delta("request_failed_total") == 0
    assert delta("generation_tokens_total") == 3 + 2
    prompt = (sample(after, "tgi_request_input_length_sum", model=model)
              - (sample(before, "tgi_request_input_length_sum", model=model) or 0))
    assert delta("prompt_tokens_total") == prompt > 0
    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("time_per_output_token_seconds_count") == 2 + 1
    assert delta("time_to_first_token_seconds_sum") > 0
    assert sample(after, "num_requests_running", model_name=model) is not None
    assert sample(after, "num_requests_waiting", model_name=model) == 0

    body = httpx.get(f"{base}/metrics-json").json()
    assert body["model"] == model and list(body["models"]) == [model]
    ttft = sample(after, "ferry_time_to_first_token_seconds_sum", model=model) / sample(
        after, "ferry_time_to_first_token_seconds_count", model=model)
    tbt = sample(after, "ferry_inter_token_latency_seconds_sum", model=model) / sample(
        after, "ferry_inter_token_latency_seconds_count", model=model)
    assert body["avg_ttft_ms"] == pytest.approx(ttft * 1000) and body["avg_tbt_ms"] == pytest.approx(tbt * 1000)
    assert body["avg_ttft_ms"] > 0 and body["avg_tbt_ms"] > 0
    assert body["waiting_requests"] == 0 and body["processing_requests"] >= 0


def _idle(base: str, path: str, done: object) -> dict[str, object]:
    """The answer of ``path`` once ``done(answer)`` (the worker's report is up to a heartbeat old)."""
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{base}{path}")
        assert response.status_code == 200 and response.headers["RequestUUID"]
        body = response.json()
        if done(body) or time.monotonic() > deadline:  # type: ignore[operator]
            return body
        time.sleep(0.2)


def test_slots_and_status_of_the_stack(stack: Stack) -> None:
    base, model = stack.base_url, stack.model_name
    info = httpx.get(f"{base}/info").json()
    kv = info["max_batch_total_tokens"]
    assert info["models"] == [{"model_id": model, "model_sha": None, "model_dtype": info["model_dtype"],
                               "model_device_type": "cpu", "model_pipeline_tag": "text-generation",
                               "max_total_tokens": info["max_total_tokens"]}]
    slots = _idle(base, f"/v2/models/{model}/getSlotCount", lambda b: b["free_slots"] == b["total_slots"])
    # the worker reports its maxBatchSize (the default)
    batch = Settings.model_fields["max_batch_size"].default
    assert slots == {"total_slots": batch, "free_slots": batch, "available_tokens_length": kv}
    load = {"live_workers": 1, "waiting_requests": 0, "running_requests": 0, "free_kv_tokens": kv,
            "total_kv_tokens": kv}
    for path in ("/v1/status", "/v2/status"):
        body = _idle(base, path, lambda b: b["running_requests"] == 0)
        assert body == {**load, "model": model, "models": {model: load}}
    missing = httpx.get(f"{base}/v2/models/nobody/getSlotCount")
    assert missing.status_code == 404 and missing.json()["error"] == "Model nobody not found."


def test_timed_health_of_the_stack(stack: Stack) -> None:
    for path in ("/health/timed", "/health/timed-30"):
        response = httpx.get(f"{stack.base_url}{path}", timeout=60)
        assert response.status_code == 200 and response.headers["RequestUUID"]
        assert response.json() == {"status": "healthy"}
