"""Ferry over a Redis that wants TLS (a client certificate too) and an ACL user with only :data:`common.keys.
ACL_RULES`: a ``redis-server`` started here on a free loopback port, the API and a worker given
``rediss://ferry:PASSWORD@...`` and the certificates from the config's ``redisTls*`` settings.

Every protocol's requests, streams, a stop order (the control channel), the LoRA registry and ``ferry-status``
run there; a command outside the ACL would fail them with NOPERM.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from common import keys
from tests.helpers import Pem, Stack, free_port, make_cert, start_stack
from tests.stack_checks import check_every_protocol, check_ferry_status, check_stop_order_and_lora_registry

pytestmark = pytest.mark.integration  # the servers and Redis here run as processes

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
    with open(directory / "redis.log", "wb") as log:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
             "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
             "--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "yes",
             "--save", "", "--appendonly", "no", "--dir", str(directory),
             "--user", "default", "off", "--user", "admin", "on", f">{PASSWORD}", "~*", "&*", "+@all",
             "--user", "ferry", "on", f">{PASSWORD}", *keys.ACL_RULES.split()],
            stdout=log, stderr=subprocess.STDOUT,
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
    env = {**secure_redis.env, "LORA_ADAPTER_ROOTS": str(tmp_path_factory.getbasetemp())}  # the tests' adapters
    running = start_stack(secure_redis.url, tiny_model_path, tmp_path_factory.mktemp("secure-stack"), env)
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
    check_every_protocol(secure_stack)


def test_a_stop_order_and_the_lora_registry_over_tls(secure_stack: Stack, tiny_model_path: Path,
                                                     tmp_path: Path) -> None:
    check_stop_order_and_lora_registry(secure_stack, tiny_model_path, tmp_path)


def test_ferry_status_over_tls(secure_stack: Stack, secure_redis: SecureRedis) -> None:
    check_ferry_status({**secure_stack.env, **secure_redis.env}, secure_stack.model_name, workers=1)
