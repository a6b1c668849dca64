"""End to end over a real Redis: the KServe v2 / Triton routes of separate API and worker processes, driven by
the official ``tritonclient.http`` client unchanged, and cross-checked against the TGI routes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from tests.helpers import Stack, start_stack, stop_stack
from tests.sse import sse_data

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

PROMPT = "def main("


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_path: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_model_path)(PROMPT).input_ids


@pytest.fixture(scope="module")
def client(stack: Stack) -> triton.InferenceServerClient:
    """The official client, given the URL without its scheme as it expects."""
    return triton.InferenceServerClient(url=stack.base_url.removeprefix("http://"), network_timeout=120)


def tgi_greedy(stack: Stack, max_new_tokens: int) -> dict:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "details": True, "do_sample": False}}
    resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def triton_infer(
    client: triton.InferenceServerClient, model: str, ids: list[int], binary: bool, **parameters: object
) -> np.ndarray:
    tensor = triton.InferInput("input0", [1, len(ids)], "UINT32")
    tensor.set_data_from_numpy(np.array([ids], dtype=np.uint32), binary_data=binary)
    result = client.infer(
        model, [tensor], outputs=[triton.InferRequestedOutput("output0", binary_data=binary)], parameters=parameters
    )
    return result.as_numpy("output0")



@pytest.mark.parametrize("binary", [True, False], ids=["binary-tensors", "json-tensors"])
def test_tritonclient_infer_equals_tgi_greedy(
    stack: Stack, client: triton.InferenceServerClient, prompt_ids: list[int], binary: bool
) -> None:
    """Prompt ids then the generated ids (the default KSERVE_OUTPUT_INCLUDES_PROMPT=true), the same as TGI's."""
    output = triton_infer(client, stack.model_name, prompt_ids, binary, max_new_tokens=16)
    expected = [t["id"] for t in tgi_greedy(stack, 16)["details"]["tokens"]]
    assert output.dtype == np.uint32
    assert output.shape == (1, len(prompt_ids) + 16)
    assert output[0].tolist() == prompt_ids + expected


def test_tritonclient_infer_without_outputs(
    stack: Stack, client: triton.InferenceServerClient, prompt_ids: list[int]
) -> None:
    """``outputs`` is optional (KServe v2): the client then asks for every output, as binary data."""
    tensor = triton.InferInput("input0", [1, len(prompt_ids)], "UINT32")
    tensor.set_data_from_numpy(np.array([prompt_ids], dtype=np.uint32))
    result = client.infer(stack.model_name, [tensor], parameters={"max_new_tokens": 6})
    expected = [t["id"] for t in tgi_greedy(stack, 6)["details"]["tokens"]]
    assert result.as_numpy("output0").tolist() == [prompt_ids + expected]


def test_tritonclient_config_repository_index_and_statistics(
    stack: Stack, client: triton.InferenceServerClient, prompt_ids: list[int]
) -> None:
    """Triton's model configuration, repository index and statistics extensions, through the client; the
    statistics count the requests this pod finished (the infers below), with their measured times."""
    config = client.get_model_config(stack.model_name)
    assert config["name"] == stack.model_name
    assert (config["platform"], config["max_batch_size"]) == ("pytorch_transformers", 0)
    assert config["input"] == [{"name": "input0", "data_type": "TYPE_UINT32", "dims": [1, -1]}]
    assert config["output"] == [{"name": "output0", "data_type": "TYPE_UINT32", "dims": [1, -1]}]
    assert client.get_model_repository_index() == [
        {"name": stack.model_name, "version": "", "state": "READY", "reason": ""}
    ]

    def statistics() -> dict:
        [stats] = client.get_inference_statistics(stack.model_name)["model_stats"]
        assert client.get_inference_statistics()["model_stats"] == [stats]
        return stats

    before, started = statistics(), time.time()
    for _ in range(2):
        triton_infer(client, stack.model_name, prompt_ids, True, max_new_tokens=4)
    after = statistics()
    assert after["name"] == stack.model_name
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["execution_count"] - before["execution_count"] == 2
    assert started * 1000 <= after["last_inference"] <= time.time() * 1000
    added = {kind: {key: after["inference_stats"][kind][key] - before["inference_stats"][kind][key]
                    for key in ("count", "ns")} for kind in ("success", "queue", "compute_infer", "fail")}
    assert [added[kind]["count"] for kind in ("success", "queue", "compute_infer", "fail")] == [2, 2, 2, 0]
    assert added["success"]["ns"] >= added["compute_infer"]["ns"] > 0 and added["queue"]["ns"] >= 0
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_config("nope")
    assert unknown.value.status() == "404" and unknown.value.message() == "Model nope not found."


def test_infer_spec_body_shape(stack: Stack, prompt_ids: list[int]) -> None:
    """SPEC.md's request form: parameters in inputs[0].parameters (seed null), id echoed, shape [1, len(data)]."""
    body = {
        "id": "42",
        "inputs": [{"name": "input0", "shape": [1, len(prompt_ids)], "datatype": "UINT32", "data": prompt_ids,
                    "parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "do_sample": True,
                                   "seed": None, "repetition_penalty": 1.03, "max_new_tokens": 12}}],
        "outputs": [{"name": "output0"}],
    }
    resp = httpx.post(f"{stack.base_url}/v2/models/{stack.model_name}/infer", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    payload = resp.json()
    assert payload["id"] == "42" and payload["model_name"] == stack.model_name
    (output,) = payload["outputs"]
    assert output["name"] == "output0" and output["datatype"] == "UINT32"
    assert output["shape"] == [1, len(output["data"])]
    assert output["data"][: len(prompt_ids)] == prompt_ids
    assert len(prompt_ids) < len(output["data"]) <= len(prompt_ids) + 12


def test_infer_without_id_gets_one_and_top_level_parameters_apply(stack: Stack, prompt_ids: list[int]) -> None:
    body = {
        "inputs": [{"name": "input0", "shape": [1, len(prompt_ids)], "datatype": "UINT32", "data": prompt_ids}],
        "outputs": [{"name": "output0"}],
        "max_new_tokens": 3,
    }
    payload = httpx.post(f"{stack.base_url}/v2/models/{stack.model_name}/infer", json=body, timeout=60).json()
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,256}", payload["id"])
    assert payload["outputs"][0]["shape"] == [1, len(prompt_ids) + 3]


def test_infer_seed_reproducibility(
    stack: Stack, client: triton.InferenceServerClient, prompt_ids: list[int]
) -> None:
    def sample(seed: int) -> list[int]:
        params = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "seed": seed}
        return triton_infer(client, stack.model_name, prompt_ids, True, **params)[0].tolist()

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(99)


def test_tritonclient_errors_are_kserve_errors(
    stack: Stack, client: triton.InferenceServerClient, prompt_ids: list[int]
) -> None:
    tensor = triton.InferInput("input0", [1, len(prompt_ids)], "INT32")
    tensor.set_data_from_numpy(np.array([prompt_ids], dtype=np.int32))
    with pytest.raises(InferenceServerException) as bad:
        client.infer(stack.model_name, [tensor], outputs=[triton.InferRequestedOutput("output0")])
    assert bad.value.status() == "400" and "UINT32" in bad.value.message()
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("nope", [tensor], outputs=[triton.InferRequestedOutput("output0")])
    assert unknown.value.status() == "404" and unknown.value.message() == "Model nope not found."
    with pytest.raises(InferenceServerException) as versioned:
        client.infer(stack.model_name, [tensor], model_version="1")
    assert versioned.value.status() == "400" and "versions are not supported" in versioned.value.message()


def test_tritonclient_health_and_metadata(stack: Stack, client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(stack.model_name)
    assert not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server["name"] == "ferry" and "binary_tensor_data" in server["extensions"]
    model = client.get_model_metadata(stack.model_name)
    assert model["name"] == stack.model_name
    assert model["inputs"] == [{"name": "input0", "datatype": "UINT32", "shape": [1, -1]}]
    assert model["outputs"] == [{"name": "output0", "datatype": "UINT32", "shape": [1, -1]}]
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("nope")
    assert unknown.value.status() == "404"


def test_generate_and_generate_stream(stack: Stack) -> None:
    tgi = tgi_greedy(stack, 10)
    url = f"{stack.base_url}/v2/models/{stack.model_name}"
    one = httpx.post(f"{url}/generate", json={"text_input": PROMPT, "parameters": {"max_tokens": 10}}, timeout=60)
    assert one.status_code == 200, one.text
    assert one.json() == {"model_name": stack.model_name, "model_version": "", "text_output": tgi["generated_text"]}
    stream_body = {"text_input": PROMPT, "max_new_tokens": 10}
    with httpx.stream("POST", f"{url}/generate_stream", json=stream_body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        resp.read()
    events = sse_data(resp.text)
    assert len(events) == 10
    assert all(e["model_name"] == stack.model_name for e in events)
    assert "".join(e["text_output"] for e in events) == tgi["generated_text"]


def test_generate_stop_is_excluded(stack: Stack) -> None:
    full = tgi_greedy(stack, 20)["generated_text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 20, "stop": [stop]}}
    result = httpx.post(f"{stack.base_url}/v2/models/{stack.model_name}/generate", json=body, timeout=60).json()
    assert result["text_output"] == full[: full.index(stop)]


def test_generate_stream_validation_error_before_stream(stack: Stack) -> None:
    body = {"text_input": PROMPT, "parameters": {"top_p": 0}}
    resp = httpx.post(f"{stack.base_url}/v2/models/{stack.model_name}/generate_stream", json=body, timeout=60)
    assert resp.status_code == 400 and "top_p" in resp.json()["error"]


def test_ready_goes_false_without_live_workers(
    redis_url: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A stack of its own whose worker is stopped: live stays 200, ready and model ready turn 503."""
    served = start_stack(redis_url, tiny_model_path, tmp_path)
    try:
        client = triton.InferenceServerClient(url=served.base_url.removeprefix("http://"))
        assert client.is_server_ready() and client.is_model_ready(served.model_name)
        worker = served.processes[0]
        worker.terminate()
        worker.wait(timeout=30)
        deadline = time.monotonic() + 15  # a killed worker's heartbeat expires; a stopped one removes it
        while client.is_server_ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_server_ready()
        assert not client.is_model_ready(served.model_name)
        assert client.is_server_live()
        resp = httpx.get(f"{served.base_url}/v2/health/ready")
        assert resp.status_code == 503 and "no live worker" in resp.json()["error"]
    finally:
        stop_stack(served)
