"""The one-command server: embedded Redis (fakeredis or a private redis-server), tiny model made on start, and
its lifecycle: every child process gone after SIGTERM or kill -9, a worker's exit stopping it all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from tests.helpers import free_port, wait_for, wait_healthy

pytestmark = pytest.mark.integration  # the servers and Redis here run as processes

GRACE_SECONDS = 2  # SHUTDOWN_GRACE_SECONDS of the servers started here
needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal")


def run_server(tmp_path: Path, tiny_model_path: Path, *args: str,
               extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MODEL_PATH", "MODEL_NAME")}
    env.update(extra_env or {})
    env["FERRY_HOME"] = str(tmp_path / "home")
    env["FERRY_RUN_DIR"] = str(tmp_path / "run")  # its run file and its workers' core claims: a host of its own
    env["SHUTDOWN_GRACE_SECONDS"] = str(GRACE_SECONDS)
    # The tiny model is made on first start when missing; reuse the session's copy to save time.
    (tmp_path / "home").mkdir()
    shutil.copytree(tiny_model_path, tmp_path / "home" / "tiny-llama")
    with open(tmp_path / "server.log", "wb") as log:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.embedded", "--port", str(port), *args], env=env, stdout=log, stderr=log
        )
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("ferry-server did not stop on SIGINT")


def server_output(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")


@pytest.mark.parametrize("redis_kind", ["fake", pytest.param("redis-server", marks=needs_redis_server)])
def test_embedded_server_answers(tmp_path: Path, tiny_model_path: Path, redis_kind: str) -> None:
    """It serves; ``--redis-port`` puts the embedded Redis (either kind) on that port."""
    redis_port = free_port()
    proc, base_url = run_server(
        tmp_path, tiny_model_path, "--embedded-redis", redis_kind, "--redis-port", str(redis_port)
    )
    try:
        wait_healthy(base_url, [proc])
        body = {"inputs": "def main(", "parameters": {"max_new_tokens": 5, "details": True}}
        resp = httpx.post(f"{base_url}/", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()[0]["details"]["generated_tokens"] == 5
        assert httpx.get(f"{base_url}/info").json()["model_id"] == "tiny-llama"
        client = redis.Redis(port=redis_port)
        assert client.exists("ferry:{tiny-llama}:jobs")  # the job stream of the request above
        client.close()
    finally:
        stop(proc)


@pytest.mark.parametrize("redis_kind", ["fake", pytest.param("redis-server", marks=needs_redis_server)])
def test_a_taken_redis_port_is_one_line(tmp_path: Path, tiny_model_path: Path, redis_kind: str, redis_url: str) -> None:
    """Another Redis already on ``--redis-port`` is an error, not a server sharing that Redis."""
    taken = urlsplit(redis_url)
    if taken.hostname not in ("127.0.0.1", "localhost"):
        pytest.skip(f"the tests' Redis ({redis_url}) is not on this host")
    proc, _ = run_server(tmp_path, tiny_model_path, "--embedded-redis", redis_kind, "--redis-port", str(taken.port))
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
    (line,) = [line for line in server_output(tmp_path).splitlines() if line.startswith("ferry-server:")]
    assert line.startswith("ferry-server: the embedded ") and "Address already in use" in line, line


def test_vllm_options_guard_and_limit_the_server(tmp_path: Path, tiny_model_path: Path) -> None:
    """``ferry-server --model DIR --api-key K --max-model-len N``, as a vLLM user types it: a request without
    the key is 401 in its route's format, one with it is served, and a prompt past N tokens is refused. The
    worker gets the command line's settings too (``--max-num-seqs``: the slots it reports), and an env var
    that looks like a setting but is not read is named in the log."""
    key, max_len = "vllm-habit-key", 16
    proc, base_url = run_server(
        tmp_path, tiny_model_path, "--model", str(tiny_model_path), "--api-key", key, "--max-model-len",
        str(max_len), "--max-num-seqs", "3", extra_env={"QUANTIZE": "awq"},
    )
    try:
        wait_healthy(base_url, [proc])
        body = {"inputs": "def main(", "parameters": {"max_new_tokens": 2}}
        refused = httpx.post(f"{base_url}/generate", json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error_type"] == "invalid_api_key", refused.text
        refused = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"}, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        auth = {"authorization": f"Bearer {key}"}
        served = httpx.post(f"{base_url}/generate", json=body, headers=auth, timeout=60)
        assert served.status_code == 200, served.text
        long = {"inputs": "def main(): return 1 " * 10, "parameters": {"max_new_tokens": 2}}
        too_long = httpx.post(f"{base_url}/generate", json=long, headers=auth, timeout=60)
        assert too_long.status_code == 422, too_long.text
        assert f"`inputs` must have less than {max_len - 1} tokens" in too_long.json()["error"]  # TGI's wording
        assert httpx.get(f"{base_url}/info").json()["max_total_tokens"] == max_len
        slots = httpx.get(f"{base_url}/v2/models/tiny-llama/getSlotCount").json()
        assert slots["total_slots"] == 3, slots
    finally:
        stop(proc)
    assert "env QUANTIZE is not read by Ferry" in server_output(tmp_path)


def proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process from /proc, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``, with its start time (a pid used again later is not it)."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None and stat[1] != "Z":
            parents.setdefault(stat[0], []).append((int(entry.name), stat[2]))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, started in parents.get(todo.pop(), []):
            found[child] = started
            todo.append(child)
    return found


def survivors(children: dict[int, str], within: float) -> list[int]:
    """The ``children`` still alive (not zombies) after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid, started in children.items()
                 if (stat := proc_stat(pid)) is not None and stat[2] == started and stat[1] != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def serving_children(tmp_path: Path, tiny_model_path: Path) -> tuple[subprocess.Popen[bytes], dict[int, str]]:
    """A healthy ferry-server with a redis-server and a worker, and its child processes."""
    proc, base_url = run_server(tmp_path, tiny_model_path, "--embedded-redis", "redis-server")
    wait_healthy(base_url, [proc])
    children = descendants(proc.pid)
    assert len(children) >= 2, children  # redis-server and the worker
    return proc, children


@linux_only
@needs_redis_server
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_no_child_outlives_the_server(tmp_path: Path, tiny_model_path: Path, how: str) -> None:
    """SIGTERM or SIGINT to the launcher alone (not its process group) stops it and all its children cleanly
    within the grace time; after kill -9 of the launcher, its children are gone too (the parent-death signal)."""
    proc, children = serving_children(tmp_path, tiny_model_path)
    try:
        proc.send_signal(getattr(signal, how))
        status = proc.wait(timeout=GRACE_SECONDS + 30)
        left = survivors(children, within=GRACE_SECONDS + 15)
        assert not left, f"still running after {how}: {left}"
        if how != "SIGKILL":  # it stopped itself, after stopping its children
            assert status == 0 and "ferry-server stopped" in server_output(tmp_path), server_output(tmp_path)
    finally:
        proc.kill()
        for pid in survivors(children, within=0):
            os.kill(pid, signal.SIGKILL)


def live_workers(base_url: str) -> int:
    return httpx.get(f"{base_url}/health", timeout=5).json()["models"]["tiny-llama"]["live_workers"]


@linux_only
def test_the_servers_workers_get_disjoint_cores_and_its_log_says_which(tmp_path: Path, tiny_model_path: Path) -> None:
    """``--workers 2``: the server claims each worker its share of the cores and logs it; each worker process
    is bound to the cores its line names, and no core is bound twice."""
    proc, base_url = run_server(tmp_path, tiny_model_path, "--embedded-redis", "fake", "--workers", "2")
    try:
        wait_healthy(base_url, [proc])
        wait_for(lambda: live_workers(base_url) == 2, 120, "both workers live")
        affinities = [os.sched_getaffinity(pid) for pid in descendants(proc.pid)]
    finally:
        stop(proc)
    logged = [set(map(int, cores.split(", "))) for cores in
              re.findall(r"CPU worker \d of 2 \(model tiny-llama\): cores \[([\d, ]+)\], 1/2 of the host's cores",
                         server_output(tmp_path))]
    assert len(logged) == 2 and sorted(map(sorted, logged)) == sorted(map(sorted, affinities)), server_output(tmp_path)
    first, second = affinities
    assert first and second and not first & second, affinities


def test_plain_ferry_status_finds_the_server(tmp_path: Path, tiny_model_path: Path) -> None:
    """With neither --redis-url nor REDIS_URL, ``ferry-status`` reads the embedded Redis of the running
    ferry-server (its run file) and says so; the file goes with the server."""
    proc, base_url = run_server(tmp_path, tiny_model_path, "--embedded-redis", "fake")
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FERRY_CONFIG", "MODEL_NAME", "MODEL_PATH")}
    try:
        wait_healthy(base_url, [proc])
        status = subprocess.run([sys.executable, "-m", "common.status", "--json", "--check"], capture_output=True,
                                text=True, timeout=60, env={**env, "FERRY_RUN_DIR": str(tmp_path / "run")})
    finally:
        stop(proc)
    assert status.returncode == 0, status.stderr
    ((model, workers),) = [(state["model"], len(state["workers"])) for state in json.loads(status.stdout)]
    assert (model, workers) == ("tiny-llama", 1)
    assert re.fullmatch(rf"ferry-status: reading redis://127\.0\.0\.1:\d+/0, the Redis of ferry-server pid "
                        rf"{proc.pid}\n", status.stderr), status.stderr
    assert not list((tmp_path / "run").glob("server-*")), "the run file outlived the server"


def broken_model(tmp_path: Path, tiny_model_path: Path) -> Path:
    """A copy of the tiny model without its weights."""
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model_path, path, ignore=shutil.ignore_patterns("*.safetensors"))
    return path


def test_a_model_that_cannot_load_stops_the_server(tmp_path: Path, tiny_model_path: Path) -> None:
    """The worker's one line names the folder and the cause; the server stops at once with status 1."""
    path = broken_model(tmp_path, tiny_model_path)
    proc, _ = run_server(tmp_path, tiny_model_path, "--embedded-redis", "fake", "--model-path", str(path))
    try:
        assert proc.wait(timeout=90) == 1
    finally:
        proc.kill()
    output = server_output(tmp_path)
    assert f"ferry-worker: cannot load the model at {path}: " in output and "model.safetensors" in output, output
    assert f"ferry-server: a worker of model no-weights ({path}) exited with status 1" in output, output
    assert "Traceback" not in output


@linux_only
def test_a_worker_exiting_later_stops_the_server(tmp_path: Path, tiny_model_path: Path) -> None:
    proc, base_url = run_server(tmp_path, tiny_model_path, "--embedded-redis", "fake")
    try:
        wait_healthy(base_url, [proc])
        (worker,) = descendants(proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=GRACE_SECONDS + 30) == 1
    finally:
        proc.kill()
    (line,) = [line for line in server_output(tmp_path).splitlines() if line.startswith("ferry-server:")]
    model = tmp_path / "home" / "tiny-llama"
    assert line == f"ferry-server: a worker of model tiny-llama ({model}) was killed by SIGKILL; stopped"


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
