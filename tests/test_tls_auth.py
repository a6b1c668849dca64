"""HTTPS, mutual TLS and API keys, and the JSON logs of an API pod.

The auth rules run in-process for every protocol; TLS runs real ``ferry-api`` processes over the session
stack's Redis and model name, so they share its worker and generate for real.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fakeredis
import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from common.settings import Settings
from tests.helpers import Pem, Stack, free_port, make_cert

KEY = "sk-test-9f2c41"
MODEL = "tiny-auth"
INFER_BODY = {"inputs": [{"name": "input0", "shape": [1, 1], "datatype": "UINT32", "data": [1]}],
              "outputs": [{"name": "output0"}]}
PROTECTED = [  # (path, body, protocol)
    ("/", {"inputs": "x"}, "tgi"),
    ("/generate", {"inputs": "x"}, "tgi"),
    ("/generate_stream", {"inputs": "x"}, "tgi"),
    (f"/v2/models/{MODEL}/infer", INFER_BODY, "kserve"),
    (f"/v2/models/{MODEL}/generate", {"text_input": "x"}, "kserve"),
    (f"/v2/models/{MODEL}/generate_stream", {"text_input": "x"}, "kserve"),
    (f"/v2/models/{MODEL}/stopInfer", {"id": "a1"}, "kserve"),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, "openai"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "openai"),
]
OPEN = ["/health", "/info", "/metrics", "/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}", "/v2",
        "/v1/models"]


# --------------------------------------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[TestClient]:
    settings = Settings(model_path=tiny_model_path, model_name=MODEL, api_keys=["other-key", KEY])
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis())) as served:
        yield served


def assert_unauthorized(response: httpx.Response, protocol: str) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    if protocol == "tgi":
        assert body["error_type"] == "invalid_api_key" and "API key" in body["error"]
    elif protocol == "kserve":
        assert list(body) == ["error"] and "API key" in body["error"]
    else:
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "protocol"), PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"])
def test_inference_routes_need_a_key(
    client: TestClient, path: str, body: dict, protocol: str, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    assert_unauthorized(client.post(path, json=body, headers=headers), protocol)


@pytest.mark.parametrize(("path", "body", "protocol"), PROTECTED)
def test_a_valid_key_passes(client: TestClient, path: str, body: dict, protocol: str) -> None:
    """Any configured key works; the request then fails validation (an empty body), not auth."""
    for key in ("other-key", KEY):
        response = client.post(path, content=b"{", headers={"authorization": f"bearer {key}",
                                                             "content-type": "application/json"})
        assert response.status_code in (400, 422), (path, response.text)


@pytest.mark.parametrize("path", OPEN)
def test_health_metrics_and_info_stay_open(client: TestClient, path: str) -> None:
    assert client.get(path).status_code != 401


# --------------------------------------------------------------------------------------------- certificates








@dataclass
class Certs:
    server: Pem  # self-signed
    ca: Pem
    client: Pem  # signed by ca
    rogue: Pem  # self-signed client certificate


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    ca = make_cert(directory, "ferry-test-ca", ca=True)
    return Certs(
        server=make_cert(directory, "server", server=True),
        ca=ca,
        client=make_cert(directory, "client", issuer=ca),
        rogue=make_cert(directory, "rogue"),
    )


def tls_context(certs: Certs, client_cert: Pem | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.server.cert))
    if client_cert is not None:
        context.load_cert_chain(str(client_cert.cert), str(client_cert.key))
    return context


# --------------------------------------------------------------------------------------------- TLS servers


@dataclass
class Served:
    base_url: str
    log: Path
    process: subprocess.Popen[bytes]


def serve_api(stack: Stack, log: Path, env: dict[str, str], context: ssl.SSLContext) -> Served:
    """A ``ferry-api`` process for the stack's model, served over TLS; waits until it answers."""
    port = free_port()
    full_env = {**stack.env, "PORT": str(port), "HTTPS_ENABLED": "true", **env}  # the stack's Redis and model
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "api.main"], env=full_env, stdout=out, stderr=out)
    served = Served(f"https://127.0.0.1:{port}", log, process)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ferry-api exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{served.base_url}/v2/health/live", verify=context, timeout=2).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop(served)
    raise TimeoutError("the TLS API did not start")


def stop(served: Served) -> None:
    served.process.terminate()
    try:
        served.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        served.process.kill()


@pytest.fixture(scope="module")
def https_api(stack: Stack, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """HTTPS with a self-signed certificate, API keys and JSON logs."""
    env = {"TLS_CERT": str(certs.server.cert), "TLS_PK": str(certs.server.key), "API_KEYS": f"{KEY},k2",
           "LOG_FORMAT": "json"}
    served = serve_api(stack, tmp_path_factory.mktemp("https") / "api.log", env, tls_context(certs))
    yield served
    stop(served)


@pytest.fixture(scope="module")
def mtls_api(stack: Stack, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """HTTPS that requires a client certificate signed by the test CA."""
    env = {"TLS_CERT": str(certs.server.cert), "TLS_PK": str(certs.server.key), "TLS_CA_CERTS": str(certs.ca.cert)}
    served = serve_api(stack, tmp_path_factory.mktemp("mtls") / "api.log", env, tls_context(certs, certs.client))
    yield served
    stop(served)


def test_https_generation_with_a_key(https_api: Served, certs: Certs) -> None:
    context = tls_context(certs)
    url = f"{https_api.base_url}/generate"
    body = {"inputs": "def main(", "parameters": {"max_new_tokens": 3}}
    assert httpx.post(url, json=body, verify=context).status_code == 401
    response = httpx.post(url, json=body, verify=context,
                          headers={"authorization": f"Bearer {KEY}", "x-request-id": "tls-req-1"})
    assert response.status_code == 200 and response.headers["x-generated-tokens"] == "3"
    assert httpx.get(f"{https_api.base_url}/health", verify=context).status_code == 200
    with pytest.raises(httpx.ConnectError):  # the server's certificate is not trusted by default
        httpx.get(f"{https_api.base_url}/health")
    with pytest.raises(httpx.TransportError):  # and it speaks TLS only
        httpx.get(https_api.base_url.replace("https", "http") + "/health")


def test_logs_are_json_lines_with_request_ids_and_no_keys(https_api: Served, certs: Certs) -> None:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": "tls-log-1"}
    assert httpx.post(f"{https_api.base_url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                      headers=headers, verify=tls_context(certs)).status_code == 200
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "ann"}  # OpenAI's end user
    response = httpx.post(f"{https_api.base_url}/v1/completions", json=completion, verify=tls_context(certs),
                          headers=headers)
    assert response.status_code == 200
    time.sleep(0.3)
    text = https_api.log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    finished = [line for line in lines if line.get("request_id") == "tls-log-1"]
    assert any(line["message"].startswith("request finished (length)") for line in finished)
    assert all("user" not in line for line in finished)
    [named] = [line for line in lines if "user" in line]
    assert named["user"] == "ann" and named["request_id"] == response.json()["id"]
    assert named["message"].startswith("request finished (length)")
    assert KEY not in text


def test_mutual_tls_needs_a_certificate_of_the_ca(mtls_api: Served, certs: Certs) -> None:
    url = f"{mtls_api.base_url}/health"
    assert httpx.get(url, verify=tls_context(certs, certs.client)).status_code == 200
    for refused in (tls_context(certs), tls_context(certs, certs.rogue)):
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=refused)
