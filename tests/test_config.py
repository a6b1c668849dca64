"""The config file (MindIE's nested layout, or flat keys), env overrides, errors that name the key, and
several models at once: workers pick one, API pods serve them all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.request import QueuedRequest
from common import keys
from common.config_file import flatten_config
from common.protocol import Finish, TokenEvent, TokenInfo
from common.settings import ConfigError, ModelEntry, Settings, env_names, load_settings
from tests.fakes import FakeSubmission, patch_submit

REPO = Path(__file__).resolve().parents[1]
ENV_VARS = [
    "FERRY_CONFIG", "MODEL_PATH", "MODEL_NAME", "MODEL_CONFIG", "MAX_BATCH_SIZE", "PORT", "API_KEYS", "HOST",
    "REDIS_URL", "LOG_FORMAT", "HTTPS_ENABLED", "TLS_CERT", "TLS_PK", "TLS_CA_CERTS",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: the developer's own environment must not leak into these settings."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def use_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "ferry.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("FERRY_CONFIG", str(path))
    return path


def nested(**sections: Any) -> dict[str, Any]:
    """A config with a valid model list and the given sections merged in."""
    backend = {"ModelDeployConfig": {"ModelConfig": [{"modelName": "a", "modelWeightPath": "/m/a"}]}}
    backend.update(sections.pop("BackendConfig", {}))
    return {"BackendConfig": backend, **sections}


def error_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any]) -> str:
    use_config(monkeypatch, tmp_path, config)
    with pytest.raises(ConfigError) as info:
        load_settings()
    return str(info.value)


# --------------------------------------------------------------------------------------------- the file


def test_the_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_CONFIG", str(REPO / "deploy" / "ferry.json"))
    settings = load_settings()
    assert (settings.host, settings.port, settings.log_format) == ("0.0.0.0", 8080, "json")
    assert (settings.max_batch_size, settings.max_iter_times, settings.max_seq_len) == (32, 512, 2048)
    assert settings.worker_metrics_port == 9400
    assert settings.served_model_name == "tiny-llama"
    assert settings.resolved_model_path == Path("/models/tiny-llama")


def test_nested_sections_are_flattened(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_config(monkeypatch, tmp_path, nested(
        ServerConfig={"port": 9001, "maxLinkNum": 7, "apiKeys": ["k1"]},
        LogConfig={"logFormat": "json", "logLevel": "debug"},
        BackendConfig={"device": "cuda:1", "ScheduleConfig": {"maxBatchSize": 4, "maxQueueSize": 9}},
    ))
    settings = load_settings()
    assert (settings.port, settings.max_link_num, settings.device) == (9001, 7, "cuda:1")
    assert (settings.max_batch_size, settings.max_queue_size) == (4, 9)
    assert (settings.log_format, settings.log_level) == ("json", "DEBUG")
    assert [key.get_secret_value() for key in settings.api_keys] == ["k1"]


def test_the_flat_form_is_still_accepted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_config(monkeypatch, tmp_path, {"maxBatchSize": 3, "modelName": "flat", "modelWeightPath": "/m/flat"})
    settings = load_settings()
    assert (settings.max_batch_size, settings.served_model_name) == (3, "flat")


def test_env_overrides_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_config(monkeypatch, tmp_path, nested(BackendConfig={"ScheduleConfig": {"maxBatchSize": 4}}))
    monkeypatch.setenv("MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("API_KEYS", "key-one, key-two,,")
    settings = load_settings()
    assert settings.max_batch_size == 16
    assert [key.get_secret_value() for key in settings.api_keys] == ["key-one", "key-two"]
    assert "key-one" not in repr(settings)


# --------------------------------------------------------------------------------------------- errors


def test_a_bad_value_names_its_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    message = error_of(monkeypatch, tmp_path, nested(BackendConfig={"ScheduleConfig": {"maxBatchSize": 0}}))
    assert "`BackendConfig.ScheduleConfig.maxBatchSize` (env MAX_BATCH_SIZE)" in message
    assert "greater than 0" in message


def test_a_bad_env_value_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "http")
    with pytest.raises(ConfigError, match=r"`ServerConfig.port` \(env PORT\).*valid integer"):
        load_settings()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (nested(ServerConfig={"maxLinkNun": 5}), "unknown key `ServerConfig.maxLinkNun` (did you mean `maxLinkNum`?)"),
        (nested(BackendConfig={"ScheduleConfg": {"maxBatchSize": 4}}),
         "unknown key `BackendConfig.ScheduleConfg` (did you mean `ScheduleConfig`?)"),
        (nested(ServerConfig={"maxBatchSize": 4}), "unknown key `ServerConfig.maxBatchSize`"),  # wrong section
        (nested(Servers={}), "unknown key `Servers`"),
        ({"maxBatchSzie": 4}, "unknown key `maxBatchSzie` (did you mean `maxBatchSize`?)"),  # flat form
        (nested(ServerConfig=[]), "`ServerConfig` must be a JSON object"),
    ],
)
def test_an_unknown_key_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any], expected: str
) -> None:
    assert expected in error_of(monkeypatch, tmp_path, config)


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ([{"modelName": "a", "modelWeightPath": "/m/a", "worldSize": 1}],
         "`BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize`"),
        ([{"modelName": "a"}], "`BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath`"),
        ([{"modelName": "a", "modelWeightPath": "/m/a"}, {"modelName": "a", "modelWeightPath": "/m/b"}],
         "modelName values must be unique"),
    ],
)
def test_bad_model_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, models: list[dict[str, Any]], expected: str
) -> None:
    config = {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": models}}}
    assert expected in error_of(monkeypatch, tmp_path, config)


def test_unsupported_truncation_and_unknown_log_level(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    message = error_of(monkeypatch, tmp_path, nested(
        LogConfig={"logLevel": "LOUD"}, BackendConfig={"ModelDeployConfig": {"truncation": 1}},
    ))
    assert "`BackendConfig.ModelDeployConfig.truncation`" in message and "only 0" in message
    assert "`LogConfig.logLevel`" in message


def test_https_needs_existing_cert_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert "httpsEnabled needs tlsCert" in error_of(monkeypatch, tmp_path, nested(ServerConfig={"httpsEnabled": True}))
    missing = nested(ServerConfig={"httpsEnabled": True, "tlsCert": str(tmp_path / "no.pem"), "tlsPk": "x"})
    assert f"tlsCert: no such file {tmp_path / 'no.pem'}" in error_of(monkeypatch, tmp_path, missing)
    mtls_without_tls = nested(ServerConfig={"tlsCaCerts": "/etc/ca.pem"})
    assert "tlsCaCerts (mutual TLS) needs httpsEnabled" in error_of(monkeypatch, tmp_path, mtls_without_tls)


@pytest.mark.parametrize("size", [0, -2, 1.5, "2", True])
def test_a_vllm_parallel_size_must_count_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, size: Any) -> None:
    """The devices a vLLM worker runs on (``/v2/models/{m}/config``'s world_size) are counted from these."""
    config = nested(BackendConfig={"engine": "vllm", "vllmEngineArgs": {"pipeline_parallel_size": size}})
    assert "vllmEngineArgs.pipeline_parallel_size must be a positive integer" in error_of(monkeypatch, tmp_path, config)


def test_a_key_value_is_never_echoed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    message = error_of(monkeypatch, tmp_path, nested(ServerConfig={"apiKeys": "sk-secret-1", "port": 0}))
    assert "sk-secret-1" not in message


def test_unreadable_or_invalid_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="FERRY_CONFIG: cannot read"):
        load_settings()
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setenv("FERRY_CONFIG", str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_settings()


def test_flatten_rejects_a_non_object() -> None:
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        flatten_config([1], Settings)


@pytest.mark.integration  # starts the API process
def test_an_invalid_config_stops_start_up_with_the_key(tmp_path: Path) -> None:
    path = tmp_path / "ferry.json"
    path.write_text(json.dumps(nested(BackendConfig={"ScheduleConfig": {"maxBatchSize": -1}})))
    env = {"FERRY_CONFIG": str(path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "api.main"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 2
    assert "ferry-api: invalid configuration: `BackendConfig.ScheduleConfig.maxBatchSize`" in proc.stderr


# --------------------------------------------------------------------------------------------- several models


def two_models(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_path: Path) -> None:
    use_config(monkeypatch, tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
        {"modelName": "first", "modelWeightPath": str(model_path)},
        {"modelName": "second", "modelWeightPath": str(model_path)},
    ]}}})


def test_a_worker_serves_the_model_it_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    two_models(monkeypatch, tmp_path, tmp_path)
    assert load_settings().served_model_name == "first"  # the default: the first listed
    assert load_settings(model_name="second").served_model_name == "second"  # ferry-worker --model-name second
    assert load_settings(model_name="second").served_models[0] == ModelEntry(name="second", path=tmp_path)
    with pytest.raises(ConfigError, match=r"modelName `third` .* is not in ModelConfig: \['first', 'second'\]"):
        load_settings(model_name="third")
    # An explicit path serves that folder under the given name, listed or not.
    assert load_settings(model_name="third", model_path="/m/x").served_model_name == "third"


@pytest.fixture
def multi_client(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_path: Path
) -> Iterator[tuple[TestClient, fakeredis.FakeServer]]:
    two_models(monkeypatch, tmp_path, tiny_model_path)
    server = fakeredis.FakeServer()
    app = create_app(load_settings(), redis=fakeredis.FakeAsyncRedis(server=server))
    with TestClient(app) as client:
        yield client, server


def test_the_api_pod_serves_every_listed_model(
    multi_client: tuple[TestClient, fakeredis.FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, server = multi_client
    assert client.get("/info").json()["model_id"] == "first"  # TGI routes: the default model
    assert client.get("/v2/models/second").json()["name"] == "second"
    assert client.get("/v2/models/third").status_code == 404

    queued_for: list[str] = []

    async def fake_submit(ctx: Any, request: QueuedRequest) -> FakeSubmission:
        queued_for.append(ctx.model.model_id)
        finish = Finish(finish_reason="length", generated_tokens=1, prompt_tokens=len(request.input_ids),
                        seed=request.params.seed, generated_text="x")
        return FakeSubmission(ctx, [TokenEvent(index=0, token=TokenInfo(id=5, text="x", logprob=-1.0, special=False),
                                               finish=finish)])

    patch_submit(monkeypatch, fake_submit)
    body = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2]}],
            "outputs": [{"name": "output0"}]}
    assert client.post("/v2/models/second/infer", json=body).status_code == 200
    assert client.post("/generate", json={"inputs": "hi"}).status_code == 200
    assert queued_for == ["second", "first"]

    # Readiness per model, and /health lists every model's workers.
    redis = fakeredis.FakeRedis(server=server)
    redis.zadd(keys.heartbeats("second"), {"cuda:gpu-host:7": time.time() + 60})
    assert client.get("/v2/models/second/ready").status_code == 200
    assert client.get("/v2/models/first/ready").status_code == 503
    health = client.get("/health")
    assert health.status_code == 503  # the default model has no live worker
    assert health.json()["models"] == {
        "first": {"live_workers": 0, "pools": {}, "queue_depth": 0},
        "second": {"live_workers": 1, "pools": {"cuda": 1}, "queue_depth": 0},
    }


def test_settings_constructed_directly_keep_working(tiny_model_path: Path) -> None:
    settings = Settings(model_path=tiny_model_path, model_name="m")
    assert [entry.name for entry in settings.served_models] == ["m"]


def test_every_setting_is_described_and_in_the_readme_table() -> None:
    """Each setting says what it is (its field's description) and has its row in the README's configuration
    table, under its env var (a row may name two: ``HOST`` / ``PORT``)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("\n## Configuration\n", 1)[1].split("\n### ", 1)[0]
    documented = {name for row in re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
                  for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    assert [name for name, field in Settings.model_fields.items() if not field.description] == []
    assert [env_names(name)[0] for name in Settings.model_fields if env_names(name)[0] not in documented] == []
