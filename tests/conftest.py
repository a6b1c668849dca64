"""Shared fixtures: the tiny model, a real Redis, and a served stack of separate API and worker processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from worker.tiny_model import CHAT_TEMPLATE, ensure_tiny_model, make_tiny_vlm  # CHAT_TEMPLATE: for chat tests

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def pytest_configure(config: pytest.Config) -> None:
    """The tests' workers and engines run eagerly, as vLLM's CPU tests run without torch.compile: compiling
    takes 30 s or more per worker start. tests/test_llama_step.py tests the compiled passes, in-process and in a
    worker. (A hook, not an import-time setting: the benches import this module's helpers.)"""
    os.environ.setdefault("COMPILE_MODEL", "false")


@pytest.fixture(scope="session", autouse=True)
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' run dir (FERRY_RUN_DIR, common/run_files.py), inherited by every process they start: their
    servers' run files and their workers' core claims stay out of the user's, and another test session's."""
    path = tmp_path_factory.mktemp("run")
    os.environ["FERRY_RUN_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Llama model, made once per test session."""
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny LLaVA-style vision-language model (``ferry-tiny-model --kind vlm``), made once."""
    return make_tiny_vlm(tmp_path_factory.getbasetemp() / "tiny-vlm")


@pytest.fixture(scope="session")
def chat_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model whose tokenizer has :data:`CHAT_TEMPLATE`."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama-chat"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: $TEST_REDIS_URL or 127.0.0.1:6379, else a redis-server started for the session.

    Without any, the tests that need it fail under CI (CI=true) and are skipped on a developer machine.
    """
    url = os.environ.get("TEST_REDIS_URL", DEFAULT_REDIS_URL)
    if _reachable(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        message = f"no Redis at {url} and no redis-server on PATH"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _reachable(url):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the redis-server started for the tests did not answer")
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@dataclass
class Stack:
    """A running API process and worker process(es) sharing one Redis."""

    base_url: str
    model_name: str
    redis_url: str
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]]


def wait_healthy(base_url: str, processes: list[subprocess.Popen[bytes]], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} did not become healthy")


def start_stack(
    redis_url: str, model_path: Path, log_dir: Path, extra_env: dict[str, str] | None = None, workers: int = 1,
    health_timeout: float = 120.0,
) -> Stack:
    """Start ``ferry-api`` and ``ferry-worker`` as separate processes, under a model name of their own; healthy
    within ``health_timeout`` seconds (a worker that compiles its step is healthy only once it has)."""
    model_name = f"tiny-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MODEL_PATH": str(model_path),
        "MODEL_NAME": model_name,
        "PORT": str(port),
        **(extra_env or {}),
    }
    processes = []
    # each log is closed here once its child has its own copy of the descriptor
    for i in range(workers):
        with open(log_dir / f"worker{i}.log", "wb") as log:
            processes.append(subprocess.Popen([sys.executable, "-m", "worker.main"], env=env, stdout=log, stderr=log))
    with open(log_dir / "api.log", "wb") as log:
        processes.append(subprocess.Popen([sys.executable, "-m", "api.main"], env=env, stdout=log, stderr=log))
    base_url = f"http://127.0.0.1:{port}"
    stack = Stack(base_url, model_name, redis_url, env, processes)
    try:
        wait_healthy(base_url, processes, health_timeout)
    except Exception:
        stop_stack(stack)
        raise
    return stack


def stop_stack(stack: Stack) -> None:
    for proc in stack.processes:
        proc.terminate()
    for proc in stack.processes:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    cluster = stack.env.get("REDIS_CLUSTER") == "true"
    client = (redis.RedisCluster if cluster else redis.Redis).from_url(stack.redis_url)
    keys = list(client.scan_iter(match=f"ferry:{{{stack.model_name}}}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis Cluster of three masters for the session (:mod:`tests.redis_cluster`): Ferry's URL on it."""
    from tests.redis_cluster import three_masters  # (it imports this module)

    with three_masters(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster.url


@pytest.fixture(scope="session", params=["redis", "redis-cluster"])
def stack(request: pytest.FixtureRequest, tiny_model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default served stack (seed stream format on ``POST /``), on one Redis and on a Redis Cluster: every
    test that takes it runs on both."""
    if request.param == "redis":
        url, env = request.getfixturevalue("redis_url"), {}
    else:
        url, env = request.getfixturevalue("redis_cluster_url"), {"REDIS_CLUSTER": "true"}
    running = start_stack(url, tiny_model_path, tmp_path_factory.mktemp("stack"), env)
    yield running
    stop_stack(running)


@pytest.fixture(scope="session")
def tgi_int_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack with TGI_STREAM_FORMAT=int, as the official text-generation client needs on ``POST /``."""
    running = start_stack(
        redis_url, tiny_model_path, tmp_path_factory.mktemp("stack-int"), {"TGI_STREAM_FORMAT": "int"}
    )
    yield running
    stop_stack(running)
