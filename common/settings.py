"""Server settings shared by the API pods and the workers.

Names follow the spec's server configuration (maxIterTimes, maxSeqLen, ...). Each setting is read from,
in order of precedence: an environment variable (the SCREAMING_SNAKE form, e.g. ``MAX_ITER_TIMES``, or the
spec's camelCase name), the JSON file named by ``FERRY_CONFIG``, then the default below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


def _spec(name: str, env: str) -> AliasChoices:
    """Accept the spec's camelCase key (config file) and an upper-case env var for one setting."""
    return AliasChoices(name, env)


def default_model_dir() -> Path:
    """Where the embedded mode keeps the tiny model it makes on first start."""
    return Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry")) / "tiny-llama"


class _JsonConfigSource(PydanticBaseSettingsSource):
    """Reads the optional JSON config file named by FERRY_CONFIG (flat keys, spec names)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        raise NotImplementedError  # __call__ below does the work

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("FERRY_CONFIG")
        if not path:
            return {}
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a JSON object")
        return data


class Settings(BaseSettings):
    """Every tunable of API pods and workers; one instance lives in each app/worker context."""

    model_config = SettingsConfigDict(populate_by_name=True, extra="ignore", case_sensitive=False)

    # Model and its public name
    model_path: Path | None = Field(None, validation_alias=_spec("modelWeightPath", "MODEL_PATH"))
    model_name: str | None = Field(None, validation_alias=_spec("modelName", "MODEL_NAME"))

    # Network
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=_spec("redisUrl", "REDIS_URL"))
    host: str = Field("127.0.0.1", validation_alias=_spec("ipAddress", "HOST"))
    port: int = Field(8080, ge=1, le=65535, validation_alias=_spec("port", "PORT"))

    # Request limits (SPEC.md, section "Server configuration")
    max_iter_times: int = Field(512, gt=0, validation_alias=_spec("maxIterTimes", "MAX_ITER_TIMES"))
    max_seq_len: int = Field(2048, gt=1, validation_alias=_spec("maxSeqLen", "MAX_SEQ_LEN"))
    max_input_token_len: int = Field(
        2047, gt=0, validation_alias=_spec("maxInputTokenLen", "MAX_INPUT_TOKEN_LEN")
    )
    full_text_enabled: bool = Field(False, validation_alias=_spec("fullTextEnabled", "FULL_TEXT_ENABLED"))
    tgi_stream_format: Literal["list", "int"] = Field(
        "list", validation_alias=_spec("tgiStreamFormat", "TGI_STREAM_FORMAT")
    )
    kserve_output_includes_prompt: bool = Field(
        True, validation_alias=_spec("kserveOutputIncludesPrompt", "KSERVE_OUTPUT_INCLUDES_PROMPT")
    )

    # Reliability (docs/reliability.md)
    max_queue_size: int = Field(1024, gt=0, validation_alias=_spec("maxQueueSize", "MAX_QUEUE_SIZE"))
    max_link_num: int = Field(1000, gt=0, validation_alias=_spec("maxLinkNum", "MAX_LINK_NUM"))
    e2e_timeout: float = Field(600.0, gt=0, validation_alias=_spec("e2eTimeout", "E2E_TIMEOUT"))
    token_timeout: float = Field(600.0, gt=0, validation_alias=_spec("tokenTimeout", "TOKEN_TIMEOUT"))
    max_request_length: int = Field(
        40, gt=0, description="MB", validation_alias=_spec("maxRequestLength", "MAX_REQUEST_LENGTH")
    )
    claim_idle_seconds: float = Field(
        30.0, gt=0, validation_alias=_spec("claimIdleSeconds", "CLAIM_IDLE_SECONDS")
    )
    max_deliveries: int = Field(3, gt=0, validation_alias=_spec("maxDeliveries", "MAX_DELIVERIES"))
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, validation_alias=_spec("shutdownGraceSeconds", "SHUTDOWN_GRACE_SECONDS")
    )

    # Worker engine
    device: str = Field("cpu", validation_alias=_spec("device", "DEVICE"))
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "float32", validation_alias=_spec("dtype", "DTYPE")
    )
    max_batch_size: int = Field(32, gt=0, validation_alias=_spec("maxBatchSize", "MAX_BATCH_SIZE"))
    max_prefill_tokens: int = Field(
        8192, gt=0, validation_alias=_spec("maxPrefillTokens", "MAX_PREFILL_TOKENS")
    )
    max_prefill_batch_size: int = Field(
        8, gt=0, validation_alias=_spec("maxPrefillBatchSize", "MAX_PREFILL_BATCH_SIZE")
    )
    max_batch_total_tokens: int = Field(
        65536, gt=0, validation_alias=_spec("maxBatchTotalTokens", "MAX_BATCH_TOTAL_TOKENS")
    )
    worker_pool: str = Field("cpu", validation_alias=_spec("workerPool", "WORKER_POOL"))

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in ("cpu", "cuda", "npu"):
            raise ValueError("device must be cpu, cuda[:n] or npu[:n]")
        return value

    @model_validator(mode="after")
    def _consistent_limits(self) -> "Settings":
        if self.max_input_token_len >= self.max_seq_len:
            self.max_input_token_len = self.max_seq_len - 1
        return self

    @property
    def served_model_name(self) -> str:
        """The model id clients address; defaults to the model folder's name."""
        if self.model_name:
            return self.model_name
        return (self.model_path or default_model_dir()).name

    @property
    def resolved_model_path(self) -> Path:
        return self.model_path or default_model_dir()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _JsonConfigSource(settings_cls))
