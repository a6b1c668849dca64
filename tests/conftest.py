"""Shared fixtures: the tiny model (as served too), a real Redis, and served stacks of API and worker processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.helpers import PROMPTS, Stack, free_port, start_stack, stop_stack
from worker.attention import PADDED_SDPA, use_padded_attention
from worker.cpu_linear import use_packed_linear
from worker.tiny_model import CHAT_TEMPLATE, ensure_tiny_model, make_tiny_vlm

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def pytest_configure(config: pytest.Config) -> None:
    """The tests' workers and engines run eagerly, as vLLM's CPU tests run without torch.compile: compiling
    takes 30 s or more per worker start. tests/test_llama_step.py tests the compiled passes, in-process and in a
    worker. (A hook, not an import-time setting: only a test session sets it.)"""
    os.environ.setdefault("COMPILE_MODEL", "false")


# The fixtures that start processes: a real Redis (started when none answers) and the served stacks on it
PROCESS_FIXTURES = frozenset({"redis_url", "redis_cluster_url", "stack", "tgi_int_stack"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``integration`` every test that takes a process-starting fixture, directly or through another: the
    modules mark the tests that start processes themselves (``pytestmark``), and this catches the rest, so that
    ``make test-fast`` (``-m "not integration"``) never waits on a served stack."""
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


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
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """:data:`tests.helpers.PROMPTS`, tokenized."""
    return [tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> PreTrainedModel:
    """The model as ``Engine.load`` prepares it (padded-batch SDPA attention, oneDNN-packed linear layers)."""
    served = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    use_padded_attention(served)
    assert served.config._attn_implementation == PADDED_SDPA
    assert use_packed_linear(served) > 0
    return served


@pytest.fixture(scope="session")
def chat_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model whose tokenizer has :data:`CHAT_TEMPLATE`."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama-chat"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


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
