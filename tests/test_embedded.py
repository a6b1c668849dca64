"""The one-command server: embedded Redis (fakeredis or a private redis-server), tiny model made on start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_healthy


def run_server(tmp_path: Path, tiny_model_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MODEL_PATH", "MODEL_NAME")}
    env["FERRY_HOME"] = str(tmp_path / "home")
    # The tiny model is made on first start when missing; reuse the session's copy to save time.
    (tmp_path / "home").mkdir()
    shutil.copytree(tiny_model_path, tmp_path / "home" / "tiny-llama")
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.embedded", "--port", str(port), *args], env=env, stdout=log, stderr=log
    )
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("ferry-server did not stop on SIGINT")


@pytest.mark.parametrize(
    "redis_kind",
    [
        "fake",
        pytest.param(
            "redis-server",
            marks=pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH"),
        ),
    ],
)
def test_embedded_server_answers(tmp_path: Path, tiny_model_path: Path, redis_kind: str) -> None:
    proc, base_url = run_server(tmp_path, tiny_model_path, "--embedded-redis", redis_kind)
    try:
        wait_healthy(base_url, [proc])
        body = {"inputs": "def main(", "parameters": {"max_new_tokens": 5, "details": True}}
        resp = httpx.post(f"{base_url}/", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()[0]["details"]["generated_tokens"] == 5
        assert httpx.get(f"{base_url}/info").json()["model_id"] == "tiny-llama"
    finally:
        stop(proc)


def test_tiny_model_is_reproducible_and_loads_with_from_pretrained(tmp_path: Path, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.tiny_model import make_tiny_model

    again = make_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_path / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(again)
    model = AutoModelForCausalLM.from_pretrained(again)
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer("你好").input_ids[0] == tokenizer.bos_token_id
    assert 1_000_000 < model.num_parameters() < 10_000_000
