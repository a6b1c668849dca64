"""What a vLLM or TGI user types works, and nothing of it is silently ignored: their env names read as Ferry's
settings (two names of one setting that disagree stop the start), ``ferry-server``'s vLLM and TGI options, the
settings given on its command line reaching its workers, and the warning about env vars that look like settings
but are not read. tests/test_embedded.py serves a request through ``ferry-server --model --api-key
--max-model-len``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import server.embedded
from common.look_alikes import UNREAD, look_alike_warnings, vllm_env_names, warn_look_alikes
from common.process import command_parser
from common.settings import ConfigError, Settings, load_settings, setting_names, settings_env

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No env name of any setting from the developer's environment (or conftest's COMPILE_MODEL)."""
    monkeypatch.delenv("FERRY_CONFIG", raising=False)
    for field in Settings.model_fields:
        for name in setting_names(field):
            monkeypatch.delenv(name, raising=False)
            monkeypatch.delenv(name.upper(), raising=False)


# --------------------------------------------------------------------------------------------- env aliases


@pytest.mark.parametrize(
    ("env", "value", "field", "expected"),
    [
        ("API_KEY", "k1", "api_keys", ["k1"]),  # TGI's launcher
        ("VLLM_API_KEY", "k1", "api_keys", ["k1"]),  # vLLM's server
        ("MODEL_ID", "/models/m", "model_path", Path("/models/m")),  # TGI
        ("SERVED_MODEL_NAME", "m", "model_name", "m"),  # TGI
        ("MAX_MODEL_LEN", "512", "max_seq_len", 512),  # vLLM's max_model_len
        ("MAX_TOTAL_TOKENS", "512", "max_seq_len", 512),  # TGI
        ("MAX_INPUT_TOKENS", "100", "max_input_token_len", 100),  # TGI
        ("MAX_INPUT_LENGTH", "100", "max_input_token_len", 100),  # TGI before 2.0
        ("MAX_BATCH_PREFILL_TOKENS", "1000", "max_prefill_tokens", 1000),  # TGI
        ("MAX_CONCURRENT_REQUESTS", "7", "max_link_num", 7),  # TGI
        ("DTYPE", "half", "dtype", "float16"),  # vLLM's names of two dtypes
        ("DTYPE", "float", "dtype", "float32"),
    ],
)
def test_a_vllm_or_tgi_env_name_sets_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str, expected: Any
) -> None:
    monkeypatch.setenv(env, value)
    got = getattr(load_settings(), field)
    assert ([key.get_secret_value() for key in got] if field == "api_keys" else got) == expected


def test_two_names_of_one_setting_that_disagree_stop_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both conflicts named at once; the values are not (one may be a key)."""
    monkeypatch.setenv("MAX_MODEL_LEN", "4096")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "2048")
    monkeypatch.setenv("API_KEYS", "secret-one")
    monkeypatch.setenv("VLLM_API_KEY", "secret-two")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert ("env MAX_MODEL_LEN and MAX_TOTAL_TOKENS give `BackendConfig.ModelDeployConfig.maxSeqLen` different "
            "values; set one of them") in message
    assert "env API_KEYS and VLLM_API_KEY give `ServerConfig.apiKeys` different values" in message
    assert "secret" not in message and "4096" not in message


def test_two_names_of_one_setting_that_agree_are_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_SEQ_LEN", "512")
    monkeypatch.setenv("MAX_MODEL_LEN", "512")
    assert load_settings().max_seq_len == 512


def test_a_bad_value_under_an_alias_names_every_env_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "many")
    with pytest.raises(ConfigError, match=r"`BackendConfig.ModelDeployConfig.maxSeqLen` \(env MAX_SEQ_LEN / "
                                          r"MAX_MODEL_LEN / MAX_TOTAL_TOKENS\): .*valid integer"):
        load_settings()


def test_a_command_line_value_wins_over_an_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_MODEL_LEN", "4096")
    assert load_settings(max_seq_len=64).max_seq_len == 64


# ------------------------------------------------------------------------------- what reaches the workers


def test_settings_env_gives_a_child_the_parents_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's values land in Ferry's env names, and the other names of those settings (vLLM's, TGI's,
    the camelCase key) leave, so that the child reads what the parent has instead of refusing a conflict."""
    environ = {"MAX_MODEL_LEN": "4096", "maxSeqLen": "4096", "MODEL_ID": "/models/env", "API_KEY": "old",
               "MAX_QUEUE_SIZE": "9", "UNRELATED": "kept"}
    given = {"max_seq_len": 64, "model_path": Path("/models/cli"), "api_keys": ["k1", "k2"],
             "trust_remote_code": True, "vllm_engine_args": {"tensor_parallel_size": 2},
             "chat_template": "{{ messages }}"}
    env = settings_env(environ, given)
    assert env == {"MAX_QUEUE_SIZE": "9", "UNRELATED": "kept", "MAX_SEQ_LEN": "64", "MODEL_PATH": "/models/cli",
                   "API_KEYS": "k1,k2", "TRUST_REMOTE_CODE": "true",
                   "VLLM_ENGINE_ARGS": '{"tensor_parallel_size": 2}', "CHAT_TEMPLATE": "{{ messages }}"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = load_settings()
    assert (child.max_seq_len, child.model_path, child.trust_remote_code) == (64, Path("/models/cli"), True)
    assert [key.get_secret_value() for key in child.api_keys] == ["k1", "k2"]
    assert (child.vllm_engine_args, child.chat_template, child.max_queue_size) == ({"tensor_parallel_size": 2},
                                                                                  "{{ messages }}", 9)


# --------------------------------------------------------------------------------------------- the options


def parse(*argv: str) -> dict[str, Any]:
    """The settings ferry-server's command line sets."""
    parser = command_parser("ferry-server", "test")
    server.embedded.add_setting_options(parser)
    return server.embedded.setting_overrides(parser, parser.parse_args(argv))


def test_vllm_serve_options(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    given = parse("/models/m", "--served-model-name", "m", "--api-key", "k1", "--api-key", "k2", "--host",
                  "0.0.0.0", "--port", "9000", "--max-model-len", "512", "--chat-template", str(template),
                  "--dtype", "half", "--trust-remote-code", "--max-num-seqs", "4")
    assert given == {"model_path": "/models/m", "model_name": "m", "api_keys": ["k1", "k2"], "host": "0.0.0.0",
                     "port": 9000, "max_seq_len": 512, "chat_template": str(template), "dtype": "half",
                     "trust_remote_code": True, "max_batch_size": 4}
    settings = load_settings(**given)
    assert (settings.served_model_name, settings.dtype, settings.max_seq_len) == ("m", "float16", 512)
    assert settings.chat_template == "{{ messages[0].content }}"
    assert parse("--model", "/models/m") == {"model_path": "/models/m"}


def test_tgi_launcher_options() -> None:
    given = parse("--model-id", "/models/m", "--hostname", "0.0.0.0", "--max-total-tokens", "512",
                  "--max-input-tokens", "100", "--max-batch-size", "4", "--max-batch-prefill-tokens", "1000",
                  "--max-batch-total-tokens", "8000", "--max-concurrent-requests", "7", "--api-key", "k1")
    settings = load_settings(**given)
    assert (settings.model_path, settings.host, settings.max_seq_len) == (Path("/models/m"), "0.0.0.0", 512)
    assert (settings.max_input_token_len, settings.max_batch_size, settings.max_prefill_tokens) == (100, 4, 1000)
    assert (settings.max_batch_total_tokens, settings.max_link_num) == (8000, 7)
    assert [key.get_secret_value() for key in settings.api_keys] == ["k1"]
    assert parse("--max-input-length", "100") == {"max_input_token_len": 100}


def test_no_option_sets_nothing() -> None:
    assert parse() == {}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/models/a", "--model", "/models/b"], "argument MODEL/--model/--model-path/--model-id: given different "
                                                "values /models/a, /models/b; give one"),
        (["--max-model-len", "512", "--max-total-tokens", "1024"],
         "argument --max-model-len/--max-total-tokens: given different values 512, 1024"),
        (["--served-model-name", "a", "b"], "argument --served-model-name: given different values a, b"),
    ],
)
def test_options_of_one_setting_that_disagree_are_refused(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        parse(*argv)
    assert done.value.code == 2
    assert expected in capsys.readouterr().err


def test_options_of_one_setting_that_agree_are_fine() -> None:
    assert parse("/models/a", "--model", "/models/a", "--max-model-len", "9", "--max-total-tokens", "9") == {
        "model_path": "/models/a", "max_seq_len": 9}


def tensor_parallel(*argv: str) -> dict[str, Any]:
    parser = command_parser("ferry-server", "test")
    server.embedded.add_setting_options(parser)
    args = parser.parse_args(argv)
    return server.embedded.with_tensor_parallel(parser, args, load_settings(**server.embedded.setting_overrides(
        parser, args)))


def test_tensor_parallel_size_goes_into_the_vllm_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENGINE_ARGS", json.dumps({"gpu_memory_utilization": 0.5}))
    expected = {"vllm_engine_args": {"gpu_memory_utilization": 0.5, "tensor_parallel_size": 2}}
    assert tensor_parallel("--engine", "vllm", "--tensor-parallel-size", "2") == expected
    assert tensor_parallel("--engine", "vllm", "-tp", "2") == expected
    assert tensor_parallel("--engine", "vllm", "--num-shard", "2") == expected  # TGI's name
    assert tensor_parallel("--tensor-parallel-size", "1") == {}  # the built-in engine: one device, as asked


def test_tensor_parallel_size_is_refused_with_the_built_in_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the command before it starts anything."""
    with pytest.raises(SystemExit) as done:
        server.embedded.main(["--tensor-parallel-size", "2"])
    assert done.value.code == 2
    assert "--tensor-parallel-size: 2 needs the vllm engine (--engine vllm)" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- look-alikes


def test_look_alikes_are_named_with_what_to_use_instead(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"NUM_SHARD": "2", "QUANTIZE": "awq", "MAX_BEST_OF": "2", "MAX_NUM_SEQS": "4",
               "MAX_BATCH_SIZES": "4", "maxBatchSizes": "4", "PATH": "/bin", "HOSTNAME": "pod-1",
               "REDIS_PORT": "tcp://10.0.0.1:6379", "MAX_TOTAL_TOKENS": "512", "MAX_BATCH_SIZE": "4",
               "FERRY_HOME": "/tmp"}
    with caplog.at_level(logging.WARNING, logger="ferry.settings"):
        warn_look_alikes(environ)
    assert [record.getMessage() for record in caplog.records] == [
        "env MAX_BATCH_SIZES is not read by Ferry (did you mean MAX_BATCH_SIZE?)",
        "env MAX_BEST_OF is not read by Ferry; instead: none: best_of is always 1",
        "env MAX_NUM_SEQS is not read by Ferry; instead: MAX_BATCH_SIZE (ferry-server --max-num-seqs)",
        "env NUM_SHARD is not read by Ferry; instead: ENGINE=vllm and VLLM_ENGINE_ARGS {\"tensor_parallel_size\": "
        "N} (ferry-server --tensor-parallel-size N)",
        "env QUANTIZE is not read by Ferry; instead: ENGINE=vllm and VLLM_ENGINE_ARGS {\"quantization\": ...}",
        "env maxBatchSizes is not read by Ferry (did you mean maxBatchSize?)",
    ]


def test_vllm_names_are_checked_against_vllms_own_list() -> None:
    """vLLM's own env vars (VLLM_CPU_KVCACHE_SPACE) and Ferry's (VLLM_ENGINE_ARGS, VLLM_API_KEY) pass; a
    VLLM_* name neither reads is named, with the Ferry name it is close to."""
    read_by_vllm = vllm_env_names()
    assert read_by_vllm and "VLLM_CPU_KVCACHE_SPACE" in read_by_vllm  # the test environment installs vLLM
    environ = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "INFO", "VLLM_ENGINE_ARGS": "{}",
               "VLLM_API_KEY": "k", "VLLM_MAX_MODEL_LEN": "512", "VLLM_ENGINE_ARG": "{}"}
    assert look_alike_warnings(environ) == [
        "env VLLM_ENGINE_ARG is not read by Ferry and vLLM does not read it either (did you mean VLLM_ENGINE_ARGS?)",
        "env VLLM_MAX_MODEL_LEN is not read by Ferry and vLLM does not read it either",
    ]


def test_the_readme_lists_every_alias_and_look_alike() -> None:
    """README "Coming from vLLM or TGI" is the documented list."""
    readme = README.read_text()
    section = readme[readme.index("### Coming from vLLM or TGI"):]
    section = section[:section.index("\n## ")]
    aliases = [name for field in Settings.model_fields for name in setting_names(field)[2:]]
    assert aliases and UNREAD
    for name in [*aliases, *UNREAD]:
        assert f"`{name}`" in section, name
