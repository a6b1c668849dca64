"""Ferry over a Redis that wants TLS (a client certificate too) and an ACL user with only :data:`common.keys.
ACL_RULES`: a ``redis-server`` started here on a free loopback port, the API and a worker given
``rediss://ferry:PASSWORD@...`` and the certificates from the config's ``redisTls*`` settings.

Every protocol's requests, streams, a stop order (the control channel), the LoRA registry and ``ferry-status``
run there; a command outside the ACL would fail them with NOPERM.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from common import keys
from tests.conftest import Stack, free_port, start_stack
from tests.sse import sse_data
from tests.test_tls_auth import Pem, make_cert

PASSWORD = "s3cret-for-tests"
README = Path(__file__).resolve().parent.parent / "README.md"


@dataclass
class SecureRedis:
    url: str
    ca: Pem
    client: Pem

    @property
    def env(self) -> dict[str, str]:
        return {"REDIS_URL": self.url, "REDIS_TLS_CA_CERTS": str(self.ca.cert), "REDIS_TLS_CERT": str(self.client.cert),
                "REDIS_TLS_KEY": str(self.client.key)}

    def client_for(self, user: str = "ferry", password: str = PASSWORD) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1].split("/")[0]), username=user,
                           password=password, ssl=True, ssl_ca_certs=str(self.ca.cert),
                           ssl_certfile=str(self.client.cert), ssl_keyfile=str(self.client.key))


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed")
    directory = tmp_path_factory.mktemp("secure-redis")
    ca = make_cert(directory, "redis-ca", ca=True)
    server = make_cert(directory, "redis-server", issuer=ca, server=True)
    client = make_cert(directory, "redis-client", issuer=ca)
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(server.cert),
         "--tls-key-file", str(server.key), "--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "yes",
         "--save", "", "--appendonly", "no", "--dir", str(directory),
         "--user", "default", "off", "--user", "admin", "on", f">{PASSWORD}", "~*", "&*", "+@all",
         "--user", "ferry", "on", f">{PASSWORD}", *keys.ACL_RULES.split()],
        stdout=open(directory / "redis.log", "wb"), stderr=subprocess.STDOUT,
    )
    secure = SecureRedis(f"rediss://ferry:{PASSWORD}@127.0.0.1:{port}/0", ca, client)
    deadline = time.monotonic() + 10
    while True:
        try:
            if secure.client_for().ping():
                break
        except redis.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"the TLS redis-server did not start: {(directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.1)
    yield secure
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def secure_stack(secure_redis: SecureRedis, tiny_model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(secure_redis.url, tiny_model_path, tmp_path_factory.mktemp("secure-stack"), secure_redis.env)
    yield running
    for proc in running.processes:  # (stop_stack's clean-up needs a plain client: the keys go with the server)
        proc.terminate()
    for proc in running.processes:
        proc.wait(timeout=30)


def test_the_acl_is_the_documented_one() -> None:
    assert keys.ACL_RULES in README.read_text().replace("\n", " ")


def test_a_plain_or_unauthenticated_client_is_refused(secure_redis: SecureRedis) -> None:
    with pytest.raises(redis.AuthenticationError):
        secure_redis.client_for(password="wrong").ping()
    plain = redis.Redis.from_url(secure_redis.url.replace("rediss://", "redis://"), socket_timeout=2)
    with pytest.raises(redis.RedisError):
        plain.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL: no key outside ferry:*
        secure_redis.client_for().set("other:key", "1")


def test_every_protocol_over_tls_and_the_acl(secure_stack: Stack) -> None:
    base, model = secure_stack.base_url, secure_stack.model_name
    body = {"inputs": "def main(", "parameters": {"max_new_tokens": 6, "details": True}}
    answer = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 6, answer.text
    with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60) as stream:
        events = sse_data(stream.read().decode())
    assert "".join(event["token"]["text"] for event in events) == answer.json()["generated_text"]
    infer = httpx.post(f"{base}/v2/models/{model}/infer", timeout=60, json={
        "id": "tls-1", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 50, 60]}],
        "parameters": {"max_new_tokens": 4}})
    assert infer.status_code == 200 and infer.json()["outputs"][0]["shape"] == [1, 3 + 4], infer.text  # prompt too
    completion = httpx.post(f"{base}/v1/completions", timeout=60,
                            json={"model": model, "prompt": "def main(", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3, completion.text
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert "tgi_queue_size" in httpx.get(f"{base}/metrics", timeout=10).text


def test_a_stop_order_and_the_lora_registry_over_tls(secure_stack: Stack, tiny_model_path: Path,
                                                     tmp_path: Path) -> None:
    base, model = secure_stack.base_url, secure_stack.model_name
    body = {"inputs": "def main(", "parameters": {"max_new_tokens": 400, "details": True}}
    with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60,
                      headers={"x-request-id": "tls-stop"}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        stopped = httpx.post(f"{base}/v2/models/{model}/stopInfer", json={"id": "tls-stop"}, timeout=10)
        assert stopped.status_code == 200, stopped.text
        events = sse_data("\n".join(lines))
    assert events[-1]["details"]["finish_reason"] == "stop_sequence" and len(events) < 400
    from worker.tiny_model import make_tiny_lora

    adapter = make_tiny_lora(tiny_model_path, tmp_path / "lora")
    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(adapter)}, timeout=10)
    assert loaded.status_code == 200, loaded.text
    answer = httpx.post(f"{base}/generate", timeout=60,
                        json={"inputs": "def main(", "parameters": {"max_new_tokens": 4, "adapter_id": "t"}})
    assert answer.status_code == 200, answer.text


def test_ferry_status_over_tls(secure_stack: Stack, secure_redis: SecureRedis) -> None:
    env = {**secure_stack.env, **secure_redis.env}
    shown = subprocess.run([sys.executable, "-m", "common.status", "--json"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    models = {state["model"]: state for state in json.loads(shown.stdout)}
    assert len(models[secure_stack.model_name]["workers"]) == 1
