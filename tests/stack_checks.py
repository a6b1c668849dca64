"""What a served stack must do on any Redis it is given (TLS + ACL, a Redis Cluster): each check exercises every
path through Redis once — the job stream, the events channels, the control channel, the LoRA registry, the
workers' heartbeats and status — so a Redis that refuses a command or routes it wrongly fails one of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import Stack
from tests.sse import sse_data


def check_every_protocol(stack: Stack) -> None:
    base, model = stack.base_url, stack.model_name
    body = {"inputs": "def main(", "parameters": {"max_new_tokens": 6, "details": True}}
    answer = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 6, answer.text
    with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60) as stream:
        events = sse_data(stream.read().decode())
    assert "".join(event["token"]["text"] for event in events) == answer.json()["generated_text"]
    infer = httpx.post(f"{base}/v2/models/{model}/infer", timeout=60, json={
        "id": "checks-1", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 50, 60]}],
        "parameters": {"max_new_tokens": 4}})
    assert infer.status_code == 200 and infer.json()["outputs"][0]["shape"] == [1, 3 + 4], infer.text  # prompt too
    completion = httpx.post(f"{base}/v1/completions", timeout=60,
                            json={"model": model, "prompt": "def main(", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3, completion.text
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert "tgi_queue_size" in httpx.get(f"{base}/metrics", timeout=10).text


def check_stop_order_and_lora_registry(stack: Stack, model_path: Path, tmp_path: Path) -> None:
    from worker.tiny_model import make_tiny_lora

    base, model = stack.base_url, stack.model_name
    body = {"inputs": "def main(", "parameters": {"max_new_tokens": 400, "details": True}}
    with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60,
                      headers={"x-request-id": "checks-stop"}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        stopped = httpx.post(f"{base}/v2/models/{model}/stopInfer", json={"id": "checks-stop"}, timeout=10)
        assert stopped.status_code == 200, stopped.text
        events = sse_data("\n".join(lines))
    assert events[-1]["details"]["finish_reason"] == "stop_sequence" and len(events) < 400
    adapter = make_tiny_lora(model_path, tmp_path / "lora")
    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(adapter)}, timeout=10)
    assert loaded.status_code == 200, loaded.text
    answer = httpx.post(f"{base}/generate", timeout=60,
                        json={"inputs": "def main(", "parameters": {"max_new_tokens": 4, "adapter_id": "t"}})
    assert answer.status_code == 200, answer.text
    unloaded = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "t"}, timeout=10)
    assert unloaded.status_code == 200, unloaded.text
    gone = httpx.post(f"{base}/v1/completions", json={"model": "t", "prompt": "def main(", "max_tokens": 2}, timeout=30)
    assert gone.status_code == 404, gone.text  # not the base model's answer (the unloaded names' set)


def check_ferry_status(env: dict[str, str], model: str, workers: int) -> None:
    shown = subprocess.run([sys.executable, "-m", "common.status", "--json"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    models = {state["model"]: state for state in json.loads(shown.stdout)}
    assert len(models[model]["workers"]) == workers
