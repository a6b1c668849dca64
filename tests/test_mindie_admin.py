"""MindIE's administration routes (:mod:`api.admin`): ``GET /v1/config``, ``GET /stopService[?mode=Force]``, and
the management and metrics ports (``managementPort``, ``metricsPort``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from common import keys
from common.config_file import flatten_config
from common.settings import ConfigError, Settings, load_settings
from tests.helpers import free_port, start_stack, stop_stack
from tests.sse import sse_data

TGI_ERROR_KEYS = {"error", "error_type"}


def _app(settings: Settings) -> tuple[Any, list[bool]]:
    """The app over fakeredis with a live worker, and the list its stop hook appends ``force`` to."""
    server = fakeredis.FakeServer()
    model = settings.served_models[0].name
    fakeredis.FakeRedis(server=server).zadd(keys.heartbeats(model), {"cpu:admin:1": time.time() + 3600})
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))
    stops: list[bool] = []
    app.state.stop_server = lambda force=False: stops.append(force)
    return app, stops


@pytest.fixture
def client(tiny_model_path: Path) -> Iterator[tuple[TestClient, list[bool]]]:
    app, stops = _app(Settings(model_path=tiny_model_path, model_name="m", api_keys=["sekret-key"],
                               redis_url="redis://ferry:hunter2@127.0.0.1:6379/0"))
    with TestClient(app) as test_client:
        yield test_client, stops


def _wait(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------ /v1/config


def test_config_answers_the_effective_settings_in_mindies_layout_without_secrets(
    client: tuple[TestClient, list[bool]], tiny_model_path: Path
) -> None:
    response = client[0].get("/v1/config")
    assert response.status_code == 200, response.text
    config = response.json()
    assert set(config) == {"ServerConfig", "LogConfig", "BackendConfig"}
    assert config["ServerConfig"]["port"] == 8080 and config["ServerConfig"]["maxLinkNum"] == 1000
    schedule = config["BackendConfig"]["ScheduleConfig"]
    assert schedule["maxIterTimes"] == 512 and schedule["maxBatchSize"] == 32
    deploy = config["BackendConfig"]["ModelDeployConfig"]
    assert deploy["maxSeqLen"] == 2048
    assert deploy["ModelConfig"] == [{"modelName": "m", "modelWeightPath": str(tiny_model_path), "loraModules": {}}]
    assert config["BackendConfig"]["redisUrl"] == "redis://ferry:***@127.0.0.1:6379/0"
    assert "sekret-key" not in response.text and "hunter2" not in response.text and "apiKeys" not in response.text
    flatten_config(config, Settings)  # every key is a key of the config file, in its section


def test_v2_model_config_answers_triton_and_mindie_clients(
    client: tuple[TestClient, list[bool]], tiny_model_path: Path
) -> None:
    """One object: Triton's model configuration, and MindIE's fields with the served model's values."""
    response = client[0].get("/v2/models/m/config")
    assert response.status_code == 200
    config = response.json()
    assert config["platform"] and config["input"][0]["name"] == "input0"
    assert (config["model_name"], config["model_weight_path"], config["max_seq_len"]) == ("m", str(tiny_model_path),
                                                                                         2048)
    assert (config["input_datatype"], config["output_datatype"], config["model_instance_type"]) == (
        "UINT32", "UINT32", "Standard")


# ------------------------------------------------------------------------------------------ /stopService


def test_stop_service_refuses_new_requests_in_each_format_then_stops_the_server(
    client: tuple[TestClient, list[bool]],
) -> None:
    test_client, stops = client
    auth = {"Authorization": "Bearer sekret-key"}
    assert test_client.get("/stopService").status_code == 401  # API keys configured: one is needed
    assert test_client.get("/stopService?mode=force", headers=auth).status_code == 422
    assert stops == []
    response = test_client.get("/stopService", headers=auth)
    assert response.status_code == 200 and response.json() == {"status": "stopping"}
    assert "RequestUUID" in response.headers
    _wait(lambda: stops == [False])  # nothing in flight: stopped at once, not forced
    assert test_client.get("/stopService?mode=Force", headers=auth).json() == {"status": "stopping"}
    time.sleep(0.3)
    assert stops == [False]  # one drain, one stop

    tgi = test_client.post("/generate", json={"inputs": "hi"}, headers=auth)
    assert tgi.status_code == 503 and set(tgi.json()) == TGI_ERROR_KEYS and tgi.json()["error_type"] == "stopping"
    mindie = test_client.post("/infer", json={"inputs": "hi"}, headers=auth)
    assert mindie.status_code == 503 and set(mindie.json()) == TGI_ERROR_KEYS and "RequestUUID" in mindie.headers
    openai = test_client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=auth)
    assert openai.status_code == 503 and openai.json()["error"]["code"] == "stopping"
    kserve = test_client.post("/v2/models/m/infer", headers=auth, json={
        "inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2]}]})
    assert kserve.status_code == 503 and set(kserve.json()) == {"error"}
    assert test_client.get("/v1/config").status_code == 200  # not an inference request


def test_stop_service_is_refused_where_nothing_guards_it_and_to_web_pages(tiny_model_path: Path) -> None:
    """With no API key and no management port anyone, a web page's ``<img>`` included, could stop the pod with a
    GET: refused unless allowOpenStopService; a browser's cross-site request is refused even then."""
    app, stops = _app(Settings(model_path=tiny_model_path, model_name="m"))
    with TestClient(app) as test_client:
        refused = test_client.get("/stopService")
        assert refused.status_code == 403 and set(refused.json()) == TGI_ERROR_KEYS
        assert "allowOpenStopService" in refused.json()["error"] and not app.state.ctx.drain.stopping
    app, stops = _app(Settings(model_path=tiny_model_path, model_name="m", allow_open_stop_service=True))
    with TestClient(app) as test_client:
        for site in ("cross-site", "same-site"):
            page = test_client.get("/stopService", headers={"Sec-Fetch-Site": site, "Sec-Fetch-Dest": "image"})
            assert page.status_code == 403 and "web page" in page.json()["error"]
        assert not app.state.ctx.drain.stopping
        assert test_client.get("/stopService", headers={"Sec-Fetch-Site": "none"}).json() == {"status": "stopping"}
        _wait(lambda: stops == [False])


def test_config_refuses_a_management_address_without_a_port_of_its_own() -> None:
    with pytest.raises(ConfigError, match="managementIpAddress needs"):
        load_settings(management_host="127.0.0.2")
    with pytest.raises(ConfigError, match="managementPort"):
        load_settings(management_port=70000)
    settings = load_settings(management_port=8080, metrics_port=8080)
    assert list(settings.listeners) == [("127.0.0.1", 8080)]


# ------------------------------------------------------------------------------------------ planes


def test_each_port_serves_its_planes(tiny_model_path: Path) -> None:
    settings = Settings(model_path=tiny_model_path, model_name="m", port=8080, management_port=9001,
                        metrics_port=9002, management_host="127.0.0.2")
    assert settings.listeners == {("127.0.0.1", 8080): {"business"}, ("127.0.0.2", 9001): {"management"},
                                  ("127.0.0.2", 9002): {"metrics"}}
    app, stops = _app(settings)
    with TestClient(app, base_url="http://testserver:8080") as business:
        management = TestClient(app, base_url="http://testserver:9001")
        metrics = TestClient(app, base_url="http://testserver:9002")
        for path in ("/health", "/v1/status", "/metrics", "/v1/config"):
            assert business.get(path).status_code == 200, path
            assert management.get(path).status_code == 200, path
        assert metrics.get("/metrics").status_code == 200 and metrics.get("/metrics-json").status_code == 200
        missing = business.get("/stopService")
        assert missing.status_code == 404 and set(missing.json()) == TGI_ERROR_KEYS
        assert management.post("/generate", json={"inputs": "hi"}).status_code == 404
        assert management.get("/v1/models").json()["error"]["code"] == "not_found"  # OpenAI's format under /v1
        assert metrics.get("/health").status_code == 404
        assert business.post("/v1/tokenizer", json={"inputs": "hi"}).status_code == 200
        assert management.get("/stopService").json() == {"status": "stopping"}
        _wait(lambda: stops == [False])


# ------------------------------------------------------------------------------------------ real processes


def test_stop_service_drains_a_real_pod(redis_url: str, tiny_model_path: Path, tmp_path: Path) -> None:
    """A stream in flight when stopService comes runs to its end, a new request is a 503, then the API process
    exits by itself (0: stopped as SIGTERM stops it, without the signal)."""
    stack = start_stack(redis_url, tiny_model_path, tmp_path, {"ALLOW_OPEN_STOP_SERVICE": "true"})
    api = stack.processes[-1]
    try:
        body = {"model": stack.model_name, "prompt": "def main(", "max_tokens": 300, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as streamer, streamer.stream(
                "POST", f"{stack.base_url}/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            stopped = httpx.get(f"{stack.base_url}/stopService", timeout=10)
            assert stopped.status_code == 200 and stopped.json() == {"status": "stopping"}
            refused = httpx.post(f"{stack.base_url}/generate", json={"inputs": "hi"}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error_type"] == "stopping"
            health = httpx.get(f"{stack.base_url}/health", timeout=10)  # a load balancer stops sending here
            assert health.status_code == 503 and "stopService" in health.json()["error"], health.text
            assert api.poll() is None
            rest = "\n".join(lines)
        events = sse_data(first + "\n" + rest)
        assert events[-1] == "[DONE]"
        chunks = [event for event in events[:-1] if event["choices"]]
        assert sum(1 for chunk in chunks if chunk["choices"][0]["text"]) >= 250  # every token came
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert api.wait(30) == 0
        assert "Application shutdown complete" in (tmp_path / "api.log").read_text()
    finally:
        stop_stack(stack)


def test_force_stop_and_the_management_port_of_a_real_pod(
    redis_url: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """With a management port the business port has no stopService; there, mode=Force stops the pod within
    5 s although a request is still in flight (its worker is paused)."""
    management, metrics = free_port(), free_port()
    stack = start_stack(redis_url, tiny_model_path, tmp_path,
                        {"MANAGEMENT_PORT": str(management), "METRICS_PORT": str(metrics)})
    worker, api = stack.processes[0], stack.processes[-1]
    management_url = f"http://127.0.0.1:{management}"
    try:
        assert httpx.get(f"{stack.base_url}/stopService", timeout=10).status_code == 404
        assert httpx.get(f"{management_url}/health", timeout=10).status_code == 200
        assert httpx.post(f"{management_url}/generate", json={"inputs": "hi"}, timeout=10).status_code == 404
        assert "ferry_" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        assert httpx.get(f"http://127.0.0.1:{metrics}/health", timeout=10).status_code == 404
        assert httpx.post(f"{stack.base_url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                          timeout=30).status_code == 200

        os.kill(worker.pid, signal.SIGSTOP)  # the next request stays in flight
        with httpx.Client(timeout=30) as streamer, streamer.stream(
                "POST", f"{stack.base_url}/generate_stream", json={"inputs": "hi"}) as stream:
            assert stream.status_code == 200
            time.sleep(0.5)
            started = time.monotonic()
            stopped = httpx.get(f"{management_url}/stopService", params={"mode": "Force"}, timeout=10)
            assert stopped.status_code == 200 and stopped.json() == {"status": "stopping"}
            assert api.wait(15) == 0
            assert 4 < time.monotonic() - started < 10
            with pytest.raises(httpx.HTTPError):
                stream.read()
                raise httpx.RemoteProtocolError("the stream ended")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        stop_stack(stack)
