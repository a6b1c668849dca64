"""``ferry-status``: models, live workers per pool, queue depth, per-worker reports; table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version

import fakeredis
import pytest
from rich.console import Console

from common import keys
from common.protocol import WorkerStatus
from common.status import main, read_status, render
from tests.conftest import Stack


def status_json(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.status", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


async def test_models_workers_and_queues_from_redis() -> None:
    redis = fakeredis.FakeAsyncRedis()
    now = time.time()
    await redis.zadd(keys.heartbeats("llama"), {"cpu:host-a:11": now + 5, "cuda:host-b:12": now + 5,
                                                "cpu:host-c:13": now - 1})  # the last one is dead
    busy = WorkerStatus(device="cuda:0", batch_size=3, waiting=1, kv_reserved_tokens=900, kv_budget_tokens=4096)
    await redis.set(keys.worker_status("llama", "cuda:host-b:12"), busy.model_dump_json())
    for priority in (1, 3, 5, 5):  # the queue depth counts the jobs of every priority
        await redis.xadd(keys.job_stream("llama", priority), {keys.JOB_FIELD: "{}"})
    await redis.xadd(keys.job_stream("idle", 2), {keys.JOB_FIELD: "{}"})
    await redis.xtrim(keys.job_stream("idle", 2), maxlen=0)  # a model with an empty stream and no worker

    states = await read_status(redis, configured=["configured-only"])
    assert [state.model for state in states] == ["configured-only", "idle", "llama"]
    llama = states[2]
    assert (llama.queue_depth, llama.pools, llama.batch_size, llama.kv_reserved_tokens) == (4, {"cpu": 1, "cuda": 1},
                                                                                          3, 900)
    by_pool = {worker.pool: worker for worker in llama.workers}
    assert by_pool["cuda"].status == busy and by_pool["cpu"].status is None
    assert (by_pool["cuda"].host, by_pool["cuda"].pid) == ("host-b", 12)
    assert [state.model for state in await read_status(redis, ["x"], only=["llama"])] == ["llama"]

    console = Console(record=True, width=200)
    render(states, console)
    text = console.export_text()
    assert "cpu: 1, cuda: 1" in text and "cuda:host-b:12" in text and "900 / 4096" in text
    assert "configured-only" in text


def test_the_command_against_the_stack(stack: Stack) -> None:
    done = status_json("--redis-url", stack.redis_url, "--model", stack.model_name, "--json", "--check", env=stack.env)
    assert done.returncode == 0, done.stderr
    [state] = json.loads(done.stdout)
    assert state["model"] == stack.model_name and state["pools"] == {"cpu": 1}
    worker = state["workers"][0]
    assert worker["pool"] == "cpu" and worker["status"]["kv_budget_tokens"] > 0
    table = status_json("--redis-url", stack.redis_url, "--model", stack.model_name,
                        env={**stack.env, "COLUMNS": "200"})
    assert table.returncode == 0 and stack.model_name in table.stdout and "Workers" in table.stdout


def test_check_fails_for_a_model_without_workers(stack: Stack) -> None:
    assert status_json("--redis-url", stack.redis_url, "--model", "nobody-serves-this", "--check",
                       env=stack.env).returncode == 1


def test_an_unreachable_redis_is_reported() -> None:
    done = status_json("--redis-url", "redis://127.0.0.1:1/0")
    assert done.returncode == 2 and "cannot read redis://127.0.0.1:1/0" in done.stderr


def test_version_and_help_name_the_distribution_and_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"ferry-status {version('ferry-llm')}\n"
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "FERRY_CONFIG" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("output", [["--json"], []])
def test_a_reader_that_left_is_no_traceback(redis_url: str, output: list[str]) -> None:
    """``ferry-status --json | head -1``: the pipe's reader is gone before the command writes."""
    proc = subprocess.Popen([sys.executable, "-m", "common.status", "--redis-url", redis_url, "--model", "m",
                             *output], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stderr) == (1, b"")
