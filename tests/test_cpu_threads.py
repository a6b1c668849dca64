"""The CPU worker's thread placement (worker/cpu_threads.py): the rule, the setting, and what a process gets.

Placement changes the calling process's affinity, so each case runs in a child process of its own: pytest's
own cores stay as they are.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from common.settings import Settings, parse_core_list
from worker.cpu_threads import auto_cores

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, os, sys, torch
from common.settings import Settings
from worker.cpu_threads import place_worker_threads
settings = Settings(**json.loads(sys.argv[1]))
bound = place_worker_threads(settings)
print(json.dumps({"bound": bound, "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}))
"""


def placed(env: dict[str, str] | None = None, **settings: str) -> dict:
    """What a fresh process binds with ``settings`` (OMP_NUM_THREADS only when ``env`` gives it)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_") and k != "CPU_THREADS_BIND"}
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(settings)], env={**child_env, **(env or {})},
                            capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("text", "cores"), [("0", [0]), ("0-3,6", [0, 1, 2, 3, 6]), ("2,0-1", [0, 1, 2]),
                                             (" 1 , 3 ", [1, 3])])
def test_core_lists_parse(text: str, cores: list[int]) -> None:
    assert parse_core_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "0,,1", "0-1-2", "all"])
def test_a_bad_core_list_is_a_settings_error_naming_the_field(text: str) -> None:
    with pytest.raises(ValidationError, match="cpu_threads_bind"):
        Settings(cpu_threads_bind=text)


def test_auto_leaves_the_last_core_to_the_processes_beside_the_worker() -> None:
    assert auto_cores({0, 1}) == [0]
    assert auto_cores({3, 0, 2, 1}) == [0, 1, 2]
    assert auto_cores({5}) == [5]  # one core: the worker keeps it


def test_auto_binds_a_cpu_worker_of_the_built_in_engine() -> None:
    usable = sorted(os.sched_getaffinity(0))
    result = placed()
    assert result["bound"] == auto_cores(set(usable))
    assert result["affinity"] == result["bound"]
    assert result["threads"] == len(result["bound"])


def test_auto_respects_an_operators_omp_num_threads() -> None:
    result = placed({"OMP_NUM_THREADS": "2"})
    assert result["bound"] is None
    assert result["affinity"] == sorted(os.sched_getaffinity(0)) and result["threads"] == 2


def test_an_explicit_core_list_binds_those_cores() -> None:
    core = min(os.sched_getaffinity(0))
    result = placed(cpu_threads_bind=str(core))
    assert result["bound"] == [core] and result["affinity"] == [core] and result["threads"] == 1


@pytest.mark.parametrize("settings", [{"cpu_threads_bind": "nobind"}, {"engine": "vllm"}, {"device": "cuda"}])
def test_placement_is_left_alone_where_it_is_not_the_workers(settings: dict[str, str]) -> None:
    """nobind; the vllm engine (it binds its own engine core); a non-CPU device."""
    result = placed(**settings)
    assert result["bound"] is None and result["affinity"] == sorted(os.sched_getaffinity(0))


def test_a_worker_given_cores_it_cannot_use_exits_with_one_line(tiny_model_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "worker.main", "--model-path", str(tiny_model_path)],
                            env={**env, "CPU_THREADS_BIND": "4096"}, capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "ferry-worker: cpuThreadsBind 4096: cores [4096] are not usable" in result.stderr
