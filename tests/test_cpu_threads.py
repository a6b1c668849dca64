"""The CPU worker's thread placement (worker/cpu_threads.py): the rule, the setting, what a process gets, and
how several workers of one host split the cores.

Placement changes the calling process's affinity, so each case runs in a child process of its own: pytest's
own cores stay as they are. Core claims are files of the run dir: the claim tests use one of their own.
"""

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from common.core_list import parse_core_list
from common.settings import Settings
from tests.helpers import start_stack, stop_stack, wait_for
from worker.cpu_threads import CoreClaim, auto_cores, claim_cores, launched_worker_cores

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, os, sys, torch
from common.settings import Settings
from worker.cpu_threads import place_worker_threads
settings = Settings(**json.loads(sys.argv[1]))
claim = place_worker_threads(settings)  # (auto: its cores claimed until this probe exits)
bound = claim and claim.cores
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


def test_auto_keeps_the_last_core_only_while_each_worker_has_one_of_its_own() -> None:
    assert auto_cores({0, 1, 2}, workers=2) == [0, 1]
    assert auto_cores({0, 1}, workers=2) == [0, 1]  # two workers on one core would each get half of it
    assert auto_cores({0, 1}, workers=3) == [0, 1]


@pytest.fixture
def claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CoreClaim]]:
    """A run dir of the test's own; the claims the test appends are released at its end."""
    monkeypatch.setenv("FERRY_RUN_DIR", str(tmp_path))
    made: list[CoreClaim] = []
    yield made
    for claim in made:
        claim.close()


def test_workers_of_a_host_claim_disjoint_shares(claims: list[CoreClaim]) -> None:
    """Nine usable cores, two workers: the last core stays free, each worker claims four consecutive ones."""
    usable = set(range(9))
    claims += [claim_cores(usable, 2), claim_cores(usable, 2)]
    assert [(claim.cores, claim.shared) for claim in claims] == [([0, 1, 2, 3], False), ([4, 5, 6, 7], False)]


def test_a_worker_past_the_count_shares_and_says_so(claims: list[CoreClaim]) -> None:
    usable = {0, 1, 2, 3, 4}
    claims += [claim_cores(usable, 2), claim_cores(usable, 2)]
    extra = claim_cores(usable, 2)
    assert (extra.cores, extra.shared, extra.locks) == ([0, 1], True, [])
    assert "cpuWorkersPerHost 2 counts fewer workers than run here" in extra.describe(usable, 2)


def test_more_workers_than_cores_share_and_say_so(claims: list[CoreClaim]) -> None:
    usable = {0, 1}
    claims += [claim_cores(usable, 3) for _ in range(3)]
    assert [(claim.cores, claim.shared) for claim in claims] == [([0], False), ([1], False), ([0], True)]
    assert "2 usable cores are fewer than the 3 CPU workers" in claims[2].describe(usable, 3)


def test_a_released_claim_is_free_again(claims: list[CoreClaim]) -> None:
    usable = {0, 1, 2, 3, 4}
    first = claim_cores(usable, 2)
    claims.append(claim_cores(usable, 2))
    first.close()
    claims.append(claim_cores(usable, 2))
    assert [claim.cores for claim in claims] == [[2, 3], [0, 1]]


@pytest.fixture
def nine_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> set[int]:
    """This process seen as one of a nine-core host (its affinity is not changed), with a run dir of its own."""
    usable = set(range(9))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: usable)
    monkeypatch.setenv("FERRY_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return usable


def test_ferry_server_hands_each_worker_its_share_and_logs_it(nine_cores: set[int],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "worker.cpu_threads")
    with launched_worker_cores(Settings(), ["a", "a", "b"]) as binds:
        assert binds == ["0,1", "2,3", "4,5"]
        assert claim_cores(nine_cores, 3).cores == [6, 7]  # a worker started apart takes what is left
    assert [record.getMessage() for record in caplog.records] == [
        "CPU worker 1 of 3 (model a): cores [0, 1], 1/3 of the host's cores (cpuWorkersPerHost 3)",
        "CPU worker 2 of 3 (model a): cores [2, 3], 1/3 of the host's cores (cpuWorkersPerHost 3)",
        "CPU worker 3 of 3 (model b): cores [4, 5], 1/3 of the host's cores (cpuWorkersPerHost 3)",
    ]
    released = claim_cores(nine_cores, 3)
    released.close()
    assert released.cores == [0, 1]  # the server's claims end with it


def test_ferry_server_counts_other_workers_of_the_host_when_told(nine_cores: set[int]) -> None:
    """Two ferry-servers of one host, each with cpuWorkersPerHost 2: the second takes the other half."""
    settings = Settings(cpu_workers_per_host=2)
    with launched_worker_cores(settings, ["a"]) as first, launched_worker_cores(settings, ["b"]) as second:
        assert (first, second) == (["0,1,2,3"], ["4,5,6,7"])


def test_ferry_server_refuses_a_count_below_its_own_workers(nine_cores: set[int]) -> None:
    with (pytest.raises(ValueError, match="cpuWorkersPerHost 1 counts fewer CPU workers than the 2"),
          launched_worker_cores(Settings(cpu_workers_per_host=1), ["a", "a"])):
        pass


@pytest.mark.parametrize("settings", [{"cpu_threads_bind": "nobind"}, {"cpu_threads_bind": "0-1"},
                                      {"engine": "vllm"}, {"device": "cuda"}])
def test_ferry_server_leaves_a_setting_other_than_auto_to_its_workers(nine_cores: set[int],
                                                                      settings: dict[str, str]) -> None:
    with launched_worker_cores(Settings(**settings), ["a", "a"]) as binds:
        assert binds == [None, None]


def test_independent_workers_of_one_host_get_disjoint_affinities(redis_url: str, tiny_model_path: Path,
                                                                 tmp_path: Path) -> None:
    """Two ``ferry-worker`` processes started apart, each told the host runs two: each claims its own cores
    (on two cores: one each, the reserved one too), and its process is bound to them."""
    usable = os.sched_getaffinity(0)
    env = {"CPU_WORKERS_PER_HOST": "2", "FERRY_RUN_DIR": str(tmp_path / "run")}  # a host of their own
    stack = start_stack(redis_url, tiny_model_path, tmp_path, env, workers=2)
    try:
        wait_for(lambda: httpx.get(f"{stack.base_url}/health").json()["models"][stack.model_name]["live_workers"] == 2,
                 120, "both workers live")
        first, second = (os.sched_getaffinity(proc.pid) for proc in stack.processes[:2])
    finally:
        stop_stack(stack)
    assert first and second and not first & second, (first, second)
    assert first | second <= set(auto_cores(usable, 2))


@pytest.mark.integration  # starts worker processes
def test_auto_binds_a_cpu_worker_of_the_built_in_engine() -> None:
    usable = sorted(os.sched_getaffinity(0))
    result = placed()
    assert result["bound"] == auto_cores(set(usable))
    assert result["affinity"] == result["bound"]
    assert result["threads"] == len(result["bound"])


@pytest.mark.integration  # starts worker processes
def test_auto_respects_an_operators_omp_num_threads() -> None:
    result = placed({"OMP_NUM_THREADS": "2"})
    assert result["bound"] is None
    assert result["affinity"] == sorted(os.sched_getaffinity(0)) and result["threads"] == 2


@pytest.mark.integration  # starts worker processes
def test_an_explicit_core_list_binds_those_cores() -> None:
    core = min(os.sched_getaffinity(0))
    result = placed(cpu_threads_bind=str(core))
    assert result["bound"] == [core] and result["affinity"] == [core] and result["threads"] == 1


@pytest.mark.integration  # starts worker processes
@pytest.mark.parametrize("settings", [{"cpu_threads_bind": "nobind"}, {"engine": "vllm"}, {"device": "cuda"}])
def test_placement_is_left_alone_where_it_is_not_the_workers(settings: dict[str, str]) -> None:
    """nobind; the vllm engine (it binds its own engine core); a non-CPU device."""
    result = placed(**settings)
    assert result["bound"] is None and result["affinity"] == sorted(os.sched_getaffinity(0))


@pytest.mark.integration  # starts worker processes
def test_a_worker_given_cores_it_cannot_use_exits_with_one_line(tiny_model_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "worker.main", "--model-path", str(tiny_model_path)],
                            env={**env, "CPU_THREADS_BIND": "4096"}, capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "ferry-worker: cpuThreadsBind 4096: cores [4096] are not usable" in result.stderr
