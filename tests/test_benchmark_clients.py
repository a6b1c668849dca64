"""The tools people measure servers with, run unchanged against a served tiny model: guidellm's CLI (which
sends vLLM's ``stream_options.continuous_usage_stats`` on every request) and the request functions of vLLM's
``bench serve`` (formerly ``benchmarks/benchmark_serving.py``: streams with ``include_usage`` and
``ignore_eos``, reads the text deltas and the last chunk's usage), on both OpenAI routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack, require_vllm, start_stack, stop_stack

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

ROUTES = ["/v1/completions", "/v1/chat/completions"]
REQUESTS = 3
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def bench_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack on plain Redis: what is measured here is the HTTP surface, not the Redis topology."""
    running = start_stack(redis_url, tiny_model_path, tmp_path_factory.mktemp("stack-bench"))
    yield running
    stop_stack(running)


def unstreamed(stack: Stack, route: str, body: dict) -> dict:
    """Ferry's whole response to ``body`` asked without streaming: what a streaming client should report."""
    plain = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    response = httpx.post(f"{stack.base_url}{route}", json=plain, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("route", ROUTES)
def test_guidellm_run(bench_stack: Stack, tiny_model_path: Path, tmp_path: Path, route: str) -> None:
    """``guidellm run`` completes every request and reports the token counts of Ferry's usage (guidellm counts
    no tokens itself). Offline: the served model's name is no hub id, so the tokenizer for its synthetic
    prompts is the model folder."""
    report = tmp_path / "guidellm.json"
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={bench_stack.base_url},request_format={route}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_model_path}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": REQUESTS}
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["model"] == bench_stack.model_name  # from GET /v1/models
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["ignore_eos"] is True
        usage = unstreamed(bench_stack, route, body)["usage"]
        assert usage["completion_tokens"] == OUTPUT_TOKENS
        assert (request["input_metrics"]["text_tokens"], request["output_metrics"]["text_tokens"]) == (
            usage["prompt_tokens"], OUTPUT_TOKENS)
        assert request["info"]["timings"]["first_token_iteration"] is not None


@pytest.mark.parametrize("route", ROUTES)
async def test_vllm_bench_serve_request_functions(bench_stack: Stack, route: str) -> None:
    """vLLM's own request functions (``bench serve --backend openai`` / ``openai-chat``): each request succeeds
    with the greedy text of the route unstreamed, and the token counts come from the final usage chunk."""
    require_vllm()
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

    backend = "openai" if route == "/v1/completions" else "openai-chat"
    greedy = {"temperature": 0}
    request = RequestFuncInput(prompt="def main(", api_url=f"{bench_stack.base_url}{route}", prompt_len=0,
                               output_len=OUTPUT_TOKENS, model=bench_stack.model_name, ignore_eos=True,
                               extra_body=greedy)
    async with aiohttp.ClientSession() as session:
        output = await ASYNC_REQUEST_FUNCS[backend](request, session)
    assert output.success, output.error

    if route == "/v1/completions":
        body = {"prompt": request.prompt, "max_tokens": OUTPUT_TOKENS}
    else:
        body = {"messages": [{"role": "user", "content": request.prompt}], "max_completion_tokens": OUTPUT_TOKENS}
    expected = unstreamed(bench_stack, route, {"model": bench_stack.model_name, "ignore_eos": True, **greedy, **body})
    [choice] = expected["choices"]
    assert output.generated_text == (choice["text"] if route == "/v1/completions" else choice["message"]["content"])
    assert (output.prompt_len, output.output_tokens) == (expected["usage"]["prompt_tokens"], OUTPUT_TOKENS)
