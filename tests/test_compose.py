"""docker-compose.yml, the Dockerfile and deploy/ checked by reading them (Docker cannot run here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from common.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FERRY_SERVICES = ("model", "api", "worker", "worker-cuda", "worker-npu")
WORKERS = ("worker", "worker-cuda", "worker-npu")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


@pytest.fixture(scope="module")
def scripts() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def env_vars() -> set[str]:
    """Every environment variable a Ferry process reads."""
    declared = {str(field.json_schema_extra["env"]) for field in Settings.model_fields.values()}  # type: ignore[index]
    return declared | {"FERRY_CONFIG", "FERRY_HOME"}


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
