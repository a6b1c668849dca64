"""docker-compose.yml, the Dockerfile and deploy/ checked by reading them (Docker cannot run here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import uvicorn
import yaml

from api.app import create_app
from common.settings import Settings
from tests.helpers import REPO, dockerfile, env_vars, free_port

FERRY_SERVICES = ("model", "api", "worker", "worker-cuda", "worker-npu")
WORKERS = ("worker", "worker-cuda", "worker-npu")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


@pytest.fixture(scope="module")
def scripts() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])




def test_the_stack_has_its_services(services: dict[str, Any]) -> None:
    assert set(services) == {"redis", "model", "api", "gateway", *WORKERS}


def test_every_command_is_a_declared_console_script(services: dict[str, Any], scripts: set[str]) -> None:
    for name in FERRY_SERVICES:
        assert services[name]["command"][0] in scripts, name
    dockerfile = (REPO / "Dockerfile").read_text()
    default = re.search(r'^CMD \["([^"]+)"', dockerfile, re.M)
    assert default is not None and default.group(1) in scripts


def test_every_long_running_service_has_a_healthcheck(services: dict[str, Any]) -> None:
    for name, service in services.items():
        if name != "model":  # a one-shot job
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD" and len(test) > 1, name


def test_worker_healthchecks_use_the_configured_metrics_port(services: dict[str, Any]) -> None:
    config = (REPO / "deploy" / "ferry.json").read_text()
    port = re.search(r'"workerMetricsPort": (\d+)', config)
    assert port is not None
    for name in WORKERS:
        assert f"127.0.0.1:{port.group(1)}/metrics" in " ".join(services[name]["healthcheck"]["test"]), name


def test_environment_names_only_known_settings(services: dict[str, Any]) -> None:
    known = env_vars()
    for name in ("api", "worker", "worker-cuda", "worker-npu"):
        env = services[name]["environment"]
        assert set(env) <= known, (name, set(env) - known)
        assert env["FERRY_CONFIG"] == "/etc/ferry/ferry.json" and env["LOG_FORMAT"] == "json"
        assert any(volume.endswith(":/etc/ferry/ferry.json:ro") for volume in services[name]["volumes"])
    pools = {name: services[name]["environment"]["WORKER_POOL"] for name in WORKERS}
    assert pools == {"worker": "cpu", "worker-cuda": "cuda", "worker-npu": "npu"}


def test_two_api_replicas_behind_one_gateway(services: dict[str, Any]) -> None:
    assert services["api"]["deploy"]["replicas"] == 2
    assert "ports" not in services["api"]  # only the gateway publishes a port
    gateway = services["gateway"]
    assert gateway["ports"] == ["8080:8080"]
    assert gateway["depends_on"]["api"]["condition"] == "service_healthy"
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    assert "server api:8080;" in nginx and "proxy_pass http://ferry_api;" in nginx
    assert "proxy_buffering off;" in nginx  # SSE token by token


def test_accelerator_pools_start_only_with_their_profile(services: dict[str, Any]) -> None:
    assert "profiles" not in services["worker"]
    cuda = services["worker-cuda"]
    assert cuda["profiles"] == ["gpu"]
    device = cuda["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert cuda["environment"]["DEVICE"] == "cuda"
    npu = services["worker-npu"]
    assert npu["profiles"] == ["npu"]
    assert {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(npu["devices"])
    assert "/usr/local/Ascend/driver:/usr/local/Ascend/driver:ro" in npu["volumes"]
    assert npu["environment"]["DEVICE"].startswith("npu")


def test_build_args_are_declared_in_the_dockerfile(services: dict[str, Any]) -> None:
    declared = set(re.findall(r"^ARG (\w+)", (REPO / "Dockerfile").read_text(), re.M))
    for name in FERRY_SERVICES:
        assert set(services[name]["build"]["args"]) <= declared, name


def test_services_wait_for_redis_and_the_model(services: dict[str, Any]) -> None:
    for name in ("api", *WORKERS):
        depends = services[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy"
        assert depends["model"]["condition"] == "service_completed_successfully"


# --------------------------------------------------------------------------------------------- the image




def instruction_index(instructions: list[tuple[str, str]], name: str, fragment: str) -> int:
    """Where the first ``name`` instruction holding ``fragment`` is."""
    return next(i for i, (kind, args) in enumerate(instructions) if kind == name and fragment in args)


def test_the_image_runs_as_an_unprivileged_user_owning_ferry_home() -> None:
    instructions = dockerfile()
    users = [i for i, (kind, _) in enumerate(instructions) if kind == "USER"]
    assert users and users[-1] < instruction_index(instructions, "CMD", "")
    user = instructions[users[-1]][1].split(":")[0]
    assert user not in ("root", "0")
    home = re.search(r"FERRY_HOME=(\S+)", " ".join(args for kind, args in instructions if kind == "ENV"))
    assert home is not None
    created = instruction_index(instructions, "RUN", f"useradd --uid {user} ")
    assert created < users[-1] and f"chown ferry {home.group(1)}" in instructions[created][1]


@pytest.mark.integration  # runs the image's commands as processes
def test_dependencies_install_in_a_layer_before_the_source() -> None:
    """Editing the code must not reinstall the dependencies: they install from pyproject.toml alone, and the
    project itself without them once the source is in."""
    instructions = dockerfile()
    pyproject = instruction_index(instructions, "COPY", "pyproject.toml")
    dependencies = instruction_index(instructions, "RUN", "pip install -r")
    sources = [instruction_index(instructions, "COPY", f"{name} {name}") for name in ("api", "common", "worker")]
    project = instruction_index(instructions, "RUN", "pip install --no-deps .")
    assert pyproject < dependencies < min(sources) and max(sources) < project
    words = shlex.split(instructions[dependencies][1])
    listing = subprocess.run([sys.executable, "-c", words[words.index("-c") + 1]], cwd=REPO, capture_output=True,
                             text=True, check=True)
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert listing.stdout.splitlines() == expected


def healthcheck_command() -> list[str]:
    """The HEALTHCHECK's exec-form command, run by this interpreter (the image's is ``python``)."""
    args = dict(dockerfile())["HEALTHCHECK"]
    command = json.loads(args[args.index(" CMD [") + len(" CMD "):])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


@pytest.mark.integration  # runs the image's commands as processes
def test_the_healthcheck_passes_on_a_serving_pod_and_fails_without_one(tiny_model_path: Path) -> None:
    """Run as Docker would (PORT from the image's environment) against a real API pod, then against none."""
    port = free_port()
    env = {**os.environ, "PORT": str(port)}
    app = create_app(Settings(model_path=tiny_model_path, model_name="m"), redis=fakeredis.FakeAsyncRedis())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        assert subprocess.run(healthcheck_command(), env=env, capture_output=True, timeout=30).returncode == 0
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert subprocess.run(healthcheck_command(), env=env, capture_output=True, timeout=30).returncode != 0


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last pattern matching it, or a folder above
    it, decides; ``!`` takes it back in (fnmatch stands in for Go's filepath.Match, alike for these patterns)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        glob = pattern.removeprefix("!")
        if any(fnmatch(prefix, glob) or fnmatch(prefix, glob.removeprefix("**/")) for prefix in prefixes):
            ignored = not pattern.startswith("!")
    return ignored


def test_the_build_context_holds_what_the_image_copies_and_nothing_else() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied = [word for kind, args in dockerfile() if kind == "COPY" for word in args.split()[:-1]]
    for path in [*copied, "worker/data/corpus.txt", "worker/tiny_model.py", "api/app.py"]:
        assert (REPO / path).exists() and not docker_ignores(path, patterns), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "bench/out/report.md", "models/x",
                 "api/__pycache__/app.cpython-311.pyc", "worker/__pycache__"):
        assert docker_ignores(path, patterns), path
