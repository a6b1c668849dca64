"""``ferry-status``: models, live workers per pool, queue depth, per-worker reports; table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import fakeredis
import pytest
from rich.console import Console

from common import keys
from common.protocol import WorkerStatus
from common.run_files import ServerRecord, running_servers, server_run_file, try_lock
from common.settings import Settings
from common.status import local_server_redis, main, read_status, render
from tests.helpers import Stack


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


@pytest.mark.integration  # runs ferry-status as a process
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


def held_record(path: Path, pid: int, redis_url: str, started: float) -> int:
    """A run file as a running ferry-server holds it: written and locked (the descriptor holds the lock)."""
    fd = try_lock(path)
    assert fd is not None
    os.write(fd, ServerRecord(pid=pid, redis_url=redis_url, started=started).model_dump_json().encode())
    return fd


def test_running_servers_are_the_held_run_files_newest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file no process holds (its server was killed) is stale, whatever pid it names; so is one left half
    written; the server's own file goes when it stops."""
    monkeypatch.setenv("FERRY_RUN_DIR", str(tmp_path))
    stale = ServerRecord(pid=1, redis_url="redis://h:1/0", started=3.0)
    (tmp_path / "server-1.json").write_text(stale.model_dump_json())
    (tmp_path / "server-3.json").write_text("{")
    older = held_record(tmp_path / "server-2.json", 2, "redis://h:2/0", started=1.0)
    try:
        with server_run_file("redis://h:4/0") as path:
            assert path == tmp_path / f"server-{os.getpid()}.json"
            assert [(server.pid, server.redis_url) for server in running_servers()] == [
                (os.getpid(), "redis://h:4/0"), (2, "redis://h:2/0")]
        assert not path.exists()
        assert [server.pid for server in running_servers()] == [2]
    finally:
        os.close(older)
    assert running_servers() == []


def test_status_reads_the_newest_server_and_names_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FERRY_RUN_DIR", str(tmp_path))
    held = [held_record(tmp_path / f"server-{pid}.json", pid, f"redis://h:{pid}/0", started=pid) for pid in (7, 9, 8)]
    try:
        settings = local_server_redis(Settings())
    finally:
        for fd in held:
            os.close(fd)
    assert settings.redis_url == "redis://h:9/0"
    assert capsys.readouterr().err == ("ferry-status: reading redis://h:9/0, the Redis of ferry-server pid 9; also "
                                       "running: pid 8, 7 (--redis-url picks another)\n")


@pytest.mark.integration  # runs ferry-status as a process
def test_a_given_redis_wins_over_a_running_server(tmp_path: Path, redis_url: str) -> None:
    """REDIS_URL (as --redis-url, or the config file's redisUrl) is the operator's choice: no run file is read."""
    fd = held_record(tmp_path / "server-5.json", 5, "redis://127.0.0.1:1/0", started=time.time())
    try:
        done = status_json("--json", env={"REDIS_URL": redis_url, "FERRY_RUN_DIR": str(tmp_path)})
    finally:
        os.close(fd)
    assert done.returncode == 0 and "reading" not in done.stderr, done.stderr
