"""A stock MindIE ``config.json`` as the config file (:mod:`common.mindie_config`): the keys Ferry does not
implement are refused, every one named in one message; once the user removes what it names, the file loads,
each MindIE key with a Ferry meaning lands in its Ferry setting, and an API pod starts from it.

The two files under ``tests/data`` are MindIE's ``conf/config.json``: the 1.0 layout (``LogConfig.logLevel``,
``tlsCrl``, ...) as its documents' single-node example, with HTTPS off, and 2.x's as it ships."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from common.config_file import flatten_config
from common.settings import ConfigError, Settings, load_settings

DATA = Path(__file__).resolve().parent / "data"
SECTIONS = {"ServerConfig", "LogConfig", "BackendConfig", "ModelDeployConfig", "ScheduleConfig"}
MODEL = "BackendConfig.ModelDeployConfig.ModelConfig[0]"
# The MindIE keys Ferry reads (README "Coming from MindIE"), and those it accepts and ignores.
READ = {
    "ServerConfig.ipAddress", "ServerConfig.managementIpAddress", "ServerConfig.port", "ServerConfig.managementPort",
    "ServerConfig.metricsPort", "ServerConfig.allowAllZeroIpListening", "ServerConfig.maxLinkNum",
    "ServerConfig.httpsEnabled", "ServerConfig.fullTextEnabled", "ServerConfig.tlsCert", "ServerConfig.tlsPk",
    "ServerConfig.tokenTimeout", "ServerConfig.e2eTimeout", "LogConfig.logLevel",
    "BackendConfig.ModelDeployConfig.maxSeqLen", "BackendConfig.ModelDeployConfig.maxInputTokenLen",
    "BackendConfig.ModelDeployConfig.truncation", f"{MODEL}.modelName", f"{MODEL}.modelWeightPath",
    f"{MODEL}.trustRemoteCode", "BackendConfig.ScheduleConfig.maxPrefillBatchSize",
    "BackendConfig.ScheduleConfig.maxPrefillTokens", "BackendConfig.ScheduleConfig.maxBatchSize",
    "BackendConfig.ScheduleConfig.maxIterTimes",
}
IGNORED = {"Version", "BackendConfig.backendName", "BackendConfig.ScheduleConfig.templateName"}
ENV_VARS = ["FERRY_CONFIG", "MODEL_PATH", "MODEL_NAME", "MODEL_CONFIG", "HOST", "PORT", "LOG_LEVEL", "HTTPS_ENABLED"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: the developer's own environment must not leak into these settings."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def stock(version: str) -> dict[str, Any]:
    return json.loads((DATA / f"mindie-{version}-config.json").read_text())


def leaf_paths(node: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key of the file as the error names it: sections walked, ModelConfig's items by index."""
    paths = set()
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key in SECTIONS:
            paths |= leaf_paths(value, f"{path}.")
        elif key == "ModelConfig":
            for index, entry in enumerate(value):
                paths |= leaf_paths(entry, f"{path}[{index}].")
        else:
            paths.add(path)
    return paths


def remove(config: dict[str, Any], path: str) -> None:
    """What the user does with one key the message names."""
    *parents, last = re.split(r"\.|(?=\[)", path)
    node: Any = config
    for part in parents:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    del node[last]


def load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any]) -> Settings:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("FERRY_CONFIG", str(path))
    return load_settings()


def refused_in(message: str) -> list[str]:
    """The dotted paths the refusal names."""
    listed = message.split("what Ferry has instead): ", 1)[1]
    return re.findall(r"`([^`]+)`", listed)


def without_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str) -> dict[str, Any]:
    """The stock file after removing exactly the keys the refusal names, checking that it names every key
    Ferry neither reads nor ignores, and nothing else."""
    config = stock(version)
    with pytest.raises(ConfigError) as info:
        load(monkeypatch, tmp_path, config)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: keys of MindIE's config.json that Ferry does not "
                              "implement; remove them")
    named = refused_in(message)
    assert sorted(named) == sorted(leaf_paths(config) - READ - IGNORED)
    for path in named:
        remove(config, path)
    return config


# ------------------------------------------------------------------------------------------ stock files


def test_a_stock_mindie_1_0_file_is_refused_naming_each_key_then_read_once_they_are_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = without_refused(monkeypatch, tmp_path, "1.0")
    message = str(pytest.raises(ConfigError, load, monkeypatch, tmp_path, stock("1.0")).value)
    assert "`BackendConfig.npuDeviceIds` (Ferry: one worker per device, device npu:N)" in message
    assert "`ServerConfig.tlsCaFile` (Ferry: tlsCaCerts, one PEM bundle)" in message
    assert f"`{MODEL}.worldSize`, `{MODEL}.cpuMemSize`, `{MODEL}.npuMemSize`" in message

    settings = load(monkeypatch, tmp_path, config)
    assert (settings.host, settings.port) == ("127.0.0.1", 1025)
    assert (settings.management_host, settings.management_port, settings.metrics_port) == ("127.0.0.2", 1026, 1027)
    assert settings.allow_all_zero_ip_listening is False
    assert (settings.max_link_num, settings.https_enabled, settings.full_text_enabled) == (1000, False, False)
    assert settings.tls_cert == Path("security/certs/server.pem")  # read, unused with HTTPS off
    assert settings.tls_pk == Path("security/keys/server.key.pem")
    assert settings.log_level == "INFO"  # MindIE's "Info"
    assert (settings.max_seq_len, settings.max_input_token_len) == (8192, 8191)  # min(maxInputTokenLen, maxSeqLen-1)
    assert settings.truncation == 0  # MindIE's false: over-long input is refused
    assert (settings.served_model_name, settings.resolved_model_path) == (
        "qwen2.5-7b", Path("/data/weights/Qwen2.5-7B-Instruct"))
    assert (settings.max_prefill_batch_size, settings.max_prefill_tokens) == (50, 8192)
    assert (settings.max_batch_size, settings.max_iter_times) == (200, 4096)
    assert settings.trust_remote_code is False
    assert settings.listeners == {("127.0.0.1", 1025): {"business"}, ("127.0.0.2", 1026): {"management"},
                                  ("127.0.0.2", 1027): {"metrics"}}


def test_a_stock_mindie_2_file_with_https_reads_its_certificate_paths_from_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = without_refused(monkeypatch, tmp_path, "2.x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="tlsCert: no such file security/certs/server.pem"):
        load(monkeypatch, tmp_path, config)
    for name in ("security/certs/server.pem", "security/keys/server.key.pem"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("PEM")

    settings = load(monkeypatch, tmp_path, config)
    assert settings.https_enabled is True and settings.tls_cert == Path("security/certs/server.pem")
    assert (settings.token_timeout, settings.e2e_timeout) == (600, 600)
    assert (settings.max_seq_len, settings.max_input_token_len, settings.truncation) == (2560, 2048, 0)
    assert settings.served_model_name == "llama_65b" and settings.trust_remote_code is False
    assert (settings.max_batch_size, settings.max_prefill_batch_size, settings.max_iter_times) == (200, 50, 512)
    assert settings.log_level == "INFO"  # 2.x's LogConfig has only refused keys: Ferry's default


@pytest.mark.parametrize("version", ["1.0", "2.x"])
def test_an_api_pod_starts_from_the_cleaned_stock_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_path: Path, version: str
) -> None:
    config = without_refused(monkeypatch, tmp_path, version)
    config["ServerConfig"]["httpsEnabled"] = False  # the certificates are the server's business, not the app's
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(tiny_model_path)
    settings = load(monkeypatch, tmp_path, config)
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))
    with TestClient(app) as client:
        model = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
        assert client.get("/info").json()["model_id"] == model
        effective = client.get("/v1/config").json()
    assert effective["ServerConfig"]["port"] == 1025 and effective["ServerConfig"]["allowAllZeroIpListening"] is False
    assert effective["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 200
    assert effective["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"] == model
    flatten_config(effective, Settings)  # /v1/config answers a file Ferry reads back


# ------------------------------------------------------------------------------------------ mappings


def test_refused_keys_and_typos_are_named_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = {"ServerConfig": {"maxLinkNun": 5, "inferMode": "standard"},
              "BackendConfig": {"npuDeviceIds": [[0]], "ScheduleConfig": {"cacheBlockSize": 128}}}
    message = str(pytest.raises(ConfigError, load, monkeypatch, tmp_path, config).value)
    assert "unknown key `ServerConfig.maxLinkNun` (did you mean `maxLinkNum`?)" in message
    assert refused_in(message) == ["ServerConfig.inferMode", "BackendConfig.npuDeviceIds",
                                   "BackendConfig.ScheduleConfig.cacheBlockSize"]
    # A refused key is MindIE's in its own section only; elsewhere it is unknown.
    assert "unknown key `ServerConfig.npuDeviceIds`" in str(
        pytest.raises(ConfigError, load, monkeypatch, tmp_path, {"ServerConfig": {"npuDeviceIds": [[0]]}}).value)


@pytest.mark.parametrize(("given", "level"), [("Verbose", "DEBUG"), ("Info", "INFO"), ("Warn", "WARN"),
                                               ("error", "ERROR"), ("Debug", "DEBUG")])
def test_mindies_log_levels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: str, level: str) -> None:
    assert load(monkeypatch, tmp_path, {"LogConfig": {"logLevel": given}}).log_level == level


def test_truncation_true_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = {"BackendConfig": {"ModelDeployConfig": {"truncation": True}}}
    message = str(pytest.raises(ConfigError, load, monkeypatch, tmp_path, config).value)
    assert "`BackendConfig.ModelDeployConfig.truncation`" in message and "truncating (-1, 1 or true)" in message


def test_max_prefill_batch_size_zero_is_max_batch_size(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = {"BackendConfig": {"ScheduleConfig": {"maxPrefillBatchSize": 0, "maxBatchSize": 12}}}
    assert load(monkeypatch, tmp_path, config).max_prefill_batch_size == 12


@pytest.mark.parametrize(("server", "error"), [
    ({"ipAddress": "0.0.0.0"}, None),  # Ferry's default: allowed
    ({"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}, None),
    ({"ipAddress": "0.0.0.0", "allowAllZeroIpListening": False}, "ipAddress 0.0.0.0 listens on every interface"),
    ({"managementIpAddress": "::", "managementPort": 1026, "allowAllZeroIpListening": False},
     "managementIpAddress :: listens on every interface"),
    ({"ipAddress": "10.0.0.5", "allowAllZeroIpListening": False}, None),
])
def test_all_zero_listening_is_refused_when_mindies_guard_is_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: dict[str, Any], error: str | None
) -> None:
    if error is None:
        assert load(monkeypatch, tmp_path, {"ServerConfig": server}).host == server.get("ipAddress", "127.0.0.1")
    else:
        with pytest.raises(ConfigError, match=re.escape(f"{error}: allowAllZeroIpListening is false")):
            load(monkeypatch, tmp_path, {"ServerConfig": server})


def test_trust_remote_code_of_the_models_is_ferrys_one_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def models(*trust: bool, backend: bool | None = None) -> dict[str, Any]:
        entries = [{"modelName": f"m{i}", "modelWeightPath": f"/m/{i}", "trustRemoteCode": value}
                   for i, value in enumerate(trust)]
        extra = {} if backend is None else {"trustRemoteCode": backend}
        return {"BackendConfig": {**extra, "ModelDeployConfig": {"ModelConfig": entries}}}

    settings = load(monkeypatch, tmp_path, models(True, True))
    assert settings.trust_remote_code is True and settings.models[1].name == "m1"
    assert load(monkeypatch, tmp_path, models(False, backend=False)).trust_remote_code is False
    for config in (models(True, False), models(True, backend=False)):
        message = str(pytest.raises(ConfigError, load, monkeypatch, tmp_path, config).value)
        assert f"`{MODEL}.trustRemoteCode`" in message and "one setting for every model" in message
