"""Start-up of the three commands: a model given as a Hugging Face id, models and devices that cannot load (one
line and a non-zero status, never a traceback), load logging, --help and --version, the metrics address; and a
worker's stop."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis
import torch
from transformers import AutoConfig

import api.main
import server.embedded
import worker.main
from common import keys
from common.model_files import ModelUnavailable, model_file
from common.settings import Settings
from tests.helpers import free_port, start_stack, stop_stack, wait_for
from worker.engine import EngineLoadError
from worker.metrics import WorkerMetrics
from worker.transformers_engine import TransformersEngine

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "ferry/tiny-llama"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
COMMANDS: dict[str, Callable[[list[str] | None], None]] = {
    "ferry-server": server.embedded.main, "ferry-api": api.main.main, "ferry-worker": worker.main.main,
}
MODULES = {"ferry-server": "server.embedded", "ferry-api": "api.main", "ferry-worker": "worker.main"}


def command_env(**extra: str) -> dict[str, str]:
    """This environment without the settings a developer may have set, plus ``extra``."""
    skip = ("FERRY_CONFIG", "MODEL_PATH", "MODEL_NAME", "MODEL_CONFIG", "REDIS_URL", "DEVICE", "HF_HUB_OFFLINE")
    return {**{k: v for k, v in os.environ.items() if k not in skip}, **extra}


def run_command(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", MODULES[name], *args], env=env, capture_output=True, text=True,
                          timeout=180, cwd=REPO)


def error_lines(name: str, output: str) -> list[str]:
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith(f"{name}: ")]


# ------------------------------------------------------------------------------------------ hub model ids


@pytest.fixture
def hub_home(tmp_path: Path, tiny_model_path: Path) -> Path:
    """An HF_HOME whose hub cache holds the tiny model as ``ferry/tiny-llama``, laid out as a download leaves it."""
    repo = tmp_path / "hf" / "hub" / "models--ferry--tiny-llama"
    shutil.copytree(tiny_model_path, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return tmp_path / "hf"


def test_a_hub_id_is_served_from_the_hub_cache(redis_url: str, hub_home: Path, tmp_path: Path) -> None:
    """API pod and worker both take the id (offline: from the cache alone) and answer a request."""
    offline = {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    stack = start_stack(redis_url, Path(HUB_ID), tmp_path, offline)
    try:
        body = {"inputs": "def main(", "parameters": {"max_new_tokens": 4, "details": True}}
        resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["details"]["generated_tokens"] == 4
        models = httpx.get(f"{stack.base_url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == stack.model_name, models.text
    finally:
        stop_stack(stack)


def test_a_stopped_worker_says_so_in_one_line(redis_url: str, tiny_model_path: Path, tmp_path: Path) -> None:
    """SIGTERM: the worker exits 0 with one line saying it stopped, and nothing else; in particular no
    extension module reports objects leaked at exit (the start-up heap it freezes is unfrozen at exit:
    :func:`common.process.freeze_startup_heap`)."""
    model = f"stop-{uuid.uuid4().hex[:8]}"
    env = command_env(REDIS_URL=redis_url, MODEL_PATH=str(tiny_model_path), MODEL_NAME=model)
    client = redis.Redis.from_url(redis_url)
    with open(tmp_path / "worker.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", MODULES["ferry-worker"]], env=env, stdout=log, stderr=log,
                                cwd=REPO)
        try:
            wait_for(lambda: proc.poll() is not None or client.zcard(keys.heartbeats(model)), 120,
                     "the worker's first heartbeat")
            serving = (tmp_path / "worker.log").read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if stale := list(client.scan_iter(match=f"ferry:{{{model}}}:*")):
                client.delete(*stale)
            client.close()
        at_stop = (tmp_path / "worker.log").read_text()[len(serving):]
    assert re.fullmatch(r"\S+ \S+ INFO ferry\.worker: worker \S+ stopped\n", at_stop), at_stop


@pytest.mark.integration  # runs the server's commands as processes
@pytest.mark.parametrize("name", COMMANDS)
def test_an_uncached_hub_id_offline_is_one_line(name: str, tmp_path: Path) -> None:
    env = command_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", MODEL_PATH="ferry/not-cached",
                      REDIS_URL="redis://127.0.0.1:1/0")
    args = ["--embedded-redis", "fake", "--model-path", "ferry/not-cached"] if name == "ferry-server" else []
    if name == "ferry-server":
        del env["REDIS_URL"]
    done = run_command(name, env, *args)
    assert done.returncode == 1
    cache = tmp_path / "hf" / "hub"
    assert error_lines(name, done.stderr) == [
        f"{name}: cannot load the model at ferry/not-cached: no such folder, and the Hugging Face cache ({cache}) "
        "does not hold that model id while HF_HUB_OFFLINE is set"
    ]


def test_model_files_say_why_they_cannot_be_had(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match="^cannot load the model at /no/such/model: no such folder$"):
        model_file(Path("/no/such/model"), "config.json")
    with pytest.raises(ModelUnavailable, match=f"^cannot load the model at {tmp_path}: the folder has no config.json$"):
        model_file(tmp_path, "config.json")


# ------------------------------------------------------------------------------- models and devices that fail


@pytest.mark.integration  # runs the server's commands as processes
def test_the_worker_alone_exits_with_one_line_for_a_model_without_weights(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model_path, path, ignore=shutil.ignore_patterns("*.safetensors"))
    done = run_command("ferry-worker", command_env(MODEL_PATH=str(path)))
    assert done.returncode == 1
    (line,) = error_lines("ferry-worker", done.stderr)
    assert line.startswith(f"ferry-worker: cannot load the model at {path}: ") and "model.safetensors" in line


@pytest.mark.integration  # runs the server's commands as processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_the_worker_alone_exits_with_one_line_for_cuda_without_cuda(tiny_model_path: Path) -> None:
    done = run_command("ferry-worker", command_env(MODEL_PATH=str(tiny_model_path), DEVICE="cuda"))
    assert done.returncode == 1
    expected = "no cuda device is visible" if torch.version.cuda else "torch was built without CUDA"
    assert error_lines("ferry-worker", done.stderr) == [f"ferry-worker: device cuda is not available: {expected}"]


@pytest.mark.parametrize(("device", "cuda_build", "message"), [
    ("cuda", None, "device cuda is not available: torch was built without CUDA"),
    ("cuda:1", "12.8", "device cuda:1 is not available: no cuda device is visible"),
    ("cuda:x", "12.8", "device cuda:x is not valid: "),
])
def test_a_missing_cuda_device_is_a_load_error(
    device: str, cuda_build: str | None, message: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(EngineLoadError) as caught:
        TransformersEngine.load(Settings(model_path=tiny_model_path, device=device))
    assert str(caught.value).startswith(message)


def test_a_cuda_index_past_the_visible_devices_is_a_load_error(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EngineLoadError, match="^device cuda:2 is not available: 2 cuda devices are visible$"):
        TransformersEngine.load(Settings(model_path=tiny_model_path, device="cuda:2"))


def test_npu_without_torch_npu_is_a_load_error(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # importing it raises ImportError
    with pytest.raises(EngineLoadError, match="^device npu:0 is not available: torch_npu is not installed$"):
        TransformersEngine.load(Settings(model_path=tiny_model_path, device="npu:0"))


# ------------------------------------------------------------------------------------------- load logging


def test_the_built_in_engine_logs_its_load(tiny_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ferry.engine"):
        TransformersEngine.load(Settings(model_path=tiny_model_path))
    lines = [record.getMessage() for record in caplog.records if record.name == "ferry.engine"]
    assert lines[0] == f"loading the model at {tiny_model_path} (dtype float32, device cpu)"
    assert re.fullmatch(rf"loaded the model at {re.escape(str(tiny_model_path))} in \d+\.\d s "
                        r"\(dtype float32, device cpu\)", lines[1]), lines


def test_the_vllm_engine_logs_its_load(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lines around vLLM's own load (its engine is replaced here by its configuration alone), and the KV
    cache it is given: maxBatchTotalTokens of the model's keys and values, unless vLLM's own sizing is asked
    for."""
    vllm_engine = pytest.importorskip("worker.vllm_engine", reason="vllm is not installed")
    model_config = SimpleNamespace(dtype=torch.bfloat16, max_model_len=64, get_vocab_size=lambda: 4096, hf_config=None)
    cache_config = SimpleNamespace(num_gpu_blocks=8, block_size=16)
    loaded = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config, cache_config=cache_config,
                                                         lora_config=None))
    given: list[Any] = []
    monkeypatch.setattr(vllm_engine.LLMEngine, "from_engine_args", lambda args: given.append(args) or loaded)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    settings = Settings(model_path=tiny_model_path, engine="vllm", dtype="auto", max_batch_total_tokens=1000)
    with caplog.at_level(logging.INFO, logger="ferry.engine.vllm"):
        vllm_engine.VllmEngine.load(settings)
    lines = [record.getMessage() for record in caplog.records if record.name == "ferry.engine.vllm"]
    assert lines[0] == f"loading the model at {tiny_model_path} (dtype auto, device cpu)"
    assert re.fullmatch(rf"loaded the model at {re.escape(str(tiny_model_path))} in \d+\.\d s "
                        r"\(dtype bfloat16, device cpu\); KV cache of 128 tokens", lines[1]), lines
    config = AutoConfig.from_pretrained(tiny_model_path)  # float32 weights: 4 bytes a value
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    assert given[0].kv_cache_memory_bytes == 1000 * per_token
    for own in ({"gpu_memory_utilization": 0.5}, {"kv_cache_memory_bytes": 10}):
        vllm_engine.VllmEngine.load(settings.model_copy(update={"vllm_engine_args": own}))
        assert given[-1].kv_cache_memory_bytes == own.get("kv_cache_memory_bytes")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm_engine.VllmEngine.load(settings)
    assert given[-1].kv_cache_memory_bytes is None


# ----------------------------------------------------------------------------------------- the commands


@pytest.mark.parametrize("name", COMMANDS)
def test_help_names_the_configuration_and_version_the_distribution(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        COMMANDS[name](["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: {name} ")
    assert "every setting has an environment variable" in text and "FERRY_CONFIG" in text
    assert 'README.md, section "Configuration"' in text
    with pytest.raises(SystemExit) as done:
        COMMANDS[name](["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"{name} {version('ferry-llm')}\n"


# ------------------------------------------------------------------------------------ worker metrics address


def test_worker_metrics_listen_on_loopback_by_default() -> None:
    settings = Settings()
    assert settings.worker_metrics_host == "127.0.0.1"
    server = WorkerMetrics("m", 1).serve(free_port(), settings.worker_metrics_host)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()


def test_compose_workers_open_their_metrics_to_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """docker compose's workers read deploy/ferry.json: Prometheus and the healthcheck reach them there."""
    for name in ("WORKER_METRICS_HOST", "WORKER_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FERRY_CONFIG", str(REPO / "deploy" / "ferry.json"))
    settings = Settings()
    assert (settings.worker_metrics_host, settings.worker_metrics_port) == ("0.0.0.0", 9400)


@pytest.mark.integration  # runs the server's commands as processes
def test_a_metrics_address_that_cannot_be_served_is_one_line(tiny_model_path: Path) -> None:
    port = free_port()
    done = run_command("ferry-worker", command_env(MODEL_PATH=str(tiny_model_path), WORKER_METRICS_PORT=str(port),
                                                   WORKER_METRICS_HOST="192.0.2.1"))  # TEST-NET: not this host's
    assert done.returncode == 1
    assert error_lines("ferry-worker", done.stderr) == [
        f"ferry-worker: cannot serve metrics on 192.0.2.1:{port}: Cannot assign requested address"
    ]
