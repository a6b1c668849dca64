"""Server settings shared by the API pods, the workers and the operator tools.

Names follow the spec's server configuration (maxIterTimes, maxSeqLen, ...). Each setting is read from,
in order of precedence: an environment variable (the SCREAMING_SNAKE form, e.g. ``MAX_ITER_TIMES``, or the
spec's camelCase name), the JSON file named by ``FERRY_CONFIG``, then the default below.

The file has MindIE's layout, with a section for each setting (:mod:`common.config_file`, which reads it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from common.chat_template import load_chat_template
from common.config_file import ConfigError, JsonConfigSource, key_path, nest_config, setting_keys, spec
from common.core_list import parse_core_list
from common.protocol import ADAPTER_NAME_PATTERN

EngineName = Literal["transformers", "vllm"]
DtypeName = Literal["auto", "float32", "float16", "bfloat16"]
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names of two dtypes (--dtype half)
# The vllm.EngineArgs fields whose product is the devices one vLLM worker runs its model on (vLLM's world size).
VLLM_PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")


def ferry_home() -> Path:
    """Ferry's per-user folder: ``$FERRY_HOME``, else ``~/.cache/ferry``."""
    return Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry"))


def default_model_dir() -> Path:
    """Where the embedded mode keeps the tiny model it makes on first start."""
    return ferry_home() / "tiny-llama"


class ModelEntry(BaseModel):
    """One model of the deployment (an item of ``ModelConfig``): its public name and weight folder."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    name: str = Field(min_length=1, pattern=r"^[^{}]+$", alias="modelName")
    path: Path = Field(alias="modelWeightPath")
    lora_modules: dict[Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)], str] = Field(
        default_factory=dict, alias="loraModules",
        description="LoRA adapters served from start-up: name (as requests select it) -> peft adapter folder",
    )


def setting_names(name: str) -> list[str]:
    """Every name the setting whose field is ``name`` is read by: its camelCase key, then its env vars."""
    alias = Settings.model_fields[name].validation_alias
    assert isinstance(alias, AliasChoices)
    return [str(choice) for choice in alias.choices]


def env_names(name: str) -> list[str]:
    """The env vars of the setting whose field is ``name``: Ferry's, then vLLM's and TGI's names for it."""
    return setting_names(name)[1:]


class _EnvSource(EnvSettingsSource):
    """The env vars, refusing a setting given by two of its env names (e.g. vLLM's MAX_MODEL_LEN and TGI's
    MAX_TOTAL_TOKENS) with different values: which one pydantic would read is not for the user to guess."""

    def __call__(self) -> dict[str, Any]:
        errors = []
        keys = setting_keys(self.settings_cls)
        for field in self.settings_cls.model_fields:
            names = setting_names(field)
            given = {name: self.env_vars[name.lower()] for name in names if name.lower() in self.env_vars}
            if len(set(given.values())) > 1:  # the values are not named: one may be an API key
                errors.append(f"env {' and '.join(given)} give `{key_path(names[0], keys)}` different values; "
                              "set one of them")
        if errors:
            raise ConfigError("; ".join(errors))
        return super().__call__()


class Settings(BaseSettings):
    """Every tunable of API pods and workers; one instance lives in each app/worker context."""

    model_config = SettingsConfigDict(populate_by_name=True, extra="ignore", case_sensitive=False)

    # The model this process serves (a worker), or the default one (an API pod: TGI routes serve it).
    # With ModelConfig, MODEL_NAME picks an entry (default: the first) and the path comes from it.
    model_path: Path | None = Field(
        None, description="the model's folder, or a Hugging Face model id (fetched into the hub cache)",
        **spec(None, "modelWeightPath", "MODEL_PATH", "MODEL_ID"),
    )
    model_name: str | None = Field(
        None, description="the model a worker serves, the default model of an API pod; names its job streams",
        **spec(None, "modelName", "MODEL_NAME", "SERVED_MODEL_NAME"),
    )
    models: list[ModelEntry] = Field(
        default_factory=list, description="every model of the deployment; API pods serve them all",
        **spec("ModelDeployConfig", "ModelConfig", "MODEL_CONFIG"),
    )

    lora_modules: dict[Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)], str] = Field(
        default_factory=dict, description="the default model's LoRA adapters (a JSON object name -> folder), "
        "beside its ModelConfig entry's loraModules",
        **spec("ModelDeployConfig", "loraModules", "LORA_MODULES"),
    )
    lora_adapter_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="folders POST /v1/load_lora_adapter may load adapters from (comma "
        "separated), beside the configured loraModules' own folders, which it always may; symlinks and `..` are "
        "resolved first", **spec("ModelDeployConfig", "loraAdapterRoots", "LORA_ADAPTER_ROOTS"),
    )

    # Network and security
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="redis:// or, over TLS, rediss://; a user and password go in it "
        "(rediss://USER:PASSWORD@host:port/0, an ACL user: README \"Redis\")",
        **spec("BackendConfig", "redisUrl", "REDIS_URL"),
    )
    redis_cluster: bool = Field(
        False, description="redisUrl names a node of a Redis Cluster: keys and sharded pub/sub spread over its shards "
        "(docs/scaling.md)", **spec("BackendConfig", "redisCluster", "REDIS_CLUSTER"),
    )
    redis_tls_ca_certs: Path | None = Field(
        None, description="PEM CA bundle a rediss:// server's certificate is checked against (default: the system's)",
        **spec("BackendConfig", "redisTlsCaCerts", "REDIS_TLS_CA_CERTS"),
    )
    redis_tls_cert: Path | None = Field(
        None, description="PEM client certificate for a rediss:// server that asks for one (tls-auth-clients)",
        **spec("BackendConfig", "redisTlsCert", "REDIS_TLS_CERT"),
    )
    redis_tls_key: Path | None = Field(
        None, description="PEM private key of redisTlsCert", **spec("BackendConfig", "redisTlsKey", "REDIS_TLS_KEY"),
    )
    host: str = Field("127.0.0.1", description="API listen address", **spec("ServerConfig", "ipAddress", "HOST"))
    port: int = Field(8080, ge=1, le=65535, description="API listen port", **spec("ServerConfig", "port", "PORT"))
    https_enabled: bool = Field(
        False, description="serve HTTPS; needs tlsCert and tlsPk",
        **spec("ServerConfig", "httpsEnabled", "HTTPS_ENABLED"),
    )
    tls_cert: Path | None = Field(None, description="PEM certificate (chain)",
                                  **spec("ServerConfig", "tlsCert", "TLS_CERT"))
    tls_pk: Path | None = Field(None, description="PEM private key", **spec("ServerConfig", "tlsPk", "TLS_PK"))
    tls_ca_certs: Path | None = Field(
        None, description="PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)",
        **spec("ServerConfig", "tlsCaCerts", "TLS_CA_CERTS"),
    )
    management_host: str | None = Field(
        None, min_length=1, description="address of the management plane (default: ipAddress)",
        **spec("ServerConfig", "managementIpAddress", "MANAGEMENT_HOST"),
    )
    management_port: int = Field(
        0, ge=0, le=65535, description="port of the management plane (health, status, metrics, stopService); "
        "0 or the business port: none, everything on the business port",
        **spec("ServerConfig", "managementPort", "MANAGEMENT_PORT"),
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="port serving /metrics and /metrics-json beside the business port "
        "(on managementIpAddress, else ipAddress); 0 or the business port: none",
        **spec("ServerConfig", "metricsPort", "METRICS_PORT"),
    )
    allow_all_zero_ip_listening: bool = Field(
        True, description="false: an all-zero ipAddress or managementIpAddress (0.0.0.0, ::) is refused (MindIE's "
        "guard against listening on every interface)",
        **spec("ServerConfig", "allowAllZeroIpListening", "ALLOW_ALL_ZERO_IP_LISTENING"),
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="accepted `Authorization: Bearer` keys; empty: no auth",
        **spec("ServerConfig", "apiKeys", "API_KEYS", "API_KEY", "VLLM_API_KEY"),
    )
    allow_open_stop_service: bool = Field(
        False, description="serve GET /stopService to anyone when neither apiKeys nor a managementPort guards it "
        "(false: refused with 403); a browser's cross-site request is refused whatever this says",
        **spec("ServerConfig", "allowOpenStopService", "ALLOW_OPEN_STOP_SERVICE"),
    )

    # Multimodal inputs (SPEC.md "Multimodal input"; README "Multimodal inputs")
    multimodal_input_dir: Path = Field(
        Path("/data/multimodal_inputs/"), description="the only folder local media files are read from",
        **spec("ServerConfig", "multimodalInputDir", "MULTIMODAL_INPUT_DIR"),
    )
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts http(s) media may be fetched from (comma separated); empty: none",
        **spec("ServerConfig", "allowedMediaDomains", "ALLOWED_MEDIA_DOMAINS_ENV"),
    )
    media_timeout: float = Field(
        30.0, gt=0, description="seconds to connect to a media host, between two reads, and for a whole fetch",
        **spec("ServerConfig", "mediaTimeout", "MEDIA_TIMEOUT"),
    )
    # 2**26: the full-size pictures of 48 and 64 MP phone cameras (8000 x 6000, 9248 x 6936) and 8192 x 8192 pass;
    # decoded as RGB one is 192 MiB at most. The ceiling is where Pillow refuses an image itself (twice its
    # MAX_IMAGE_PIXELS), whatever is set here.
    max_image_pixels: int = Field(
        2**26, gt=0, le=178_956_970, description="pixels (width x height) an image item may have, read from its "
        "header: a larger one is refused by the API pod before it is queued, and by a worker before decoding",
        **spec("ServerConfig", "maxImagePixels", "MAX_IMAGE_PIXELS"),
    )

    # Request limits (SPEC.md, section "Server configuration")
    max_iter_times: int = Field(
        512, gt=0, description="cap on generated tokens (max_new_tokens is min'ed with it)",
        **spec("ScheduleConfig", "maxIterTimes", "MAX_ITER_TIMES"),
    )
    max_seq_len: int = Field(
        2048, gt=1, description="cap on prompt + generated tokens per request (vLLM's max_model_len)",
        **spec("ModelDeployConfig", "maxSeqLen", "MAX_SEQ_LEN", "MAX_MODEL_LEN", "MAX_TOTAL_TOKENS")
    )
    max_input_token_len: int = Field(
        2047, gt=0,
        description="cap on prompt tokens",
        **spec("ModelDeployConfig", "maxInputTokenLen", "MAX_INPUT_TOKEN_LEN", "MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
    )
    truncation: int = Field(
        0, description="0: reject over-long input (the only mode built)",
        **spec("ModelDeployConfig", "truncation", "TRUNCATION"),
    )
    full_text_enabled: bool = Field(
        False, description="stream events carry the whole text so far instead of the delta",
        **spec("ServerConfig", "fullTextEnabled", "FULL_TEXT_ENABLED"),
    )
    tgi_stream_format: Literal["list", "int"] = Field(
        "list", description="POST / stream token ids: list (the spec's) or int (TGI's)",
        **spec("ServerConfig", "tgiStreamFormat", "TGI_STREAM_FORMAT")
    )
    kserve_output_includes_prompt: bool = Field(
        True, description="KServe infer output0 holds the prompt ids before the generated ones",
        **spec("ServerConfig", "kserveOutputIncludesPrompt", "KSERVE_OUTPUT_INCLUDES_PROMPT")
    )
    chat_template: str | None = Field(
        None, description="the default model's chat template for /v1/chat/completions: a file or inline Jinja; "
        "held here as the template's text",
        **spec("ServerConfig", "chatTemplate", "CHAT_TEMPLATE"),
    )

    # Reliability (docs/reliability.md)
    max_queue_size: int = Field(
        1024, gt=0, description="jobs queued or running per model (429 past it)",
        **spec("ScheduleConfig", "maxQueueSize", "MAX_QUEUE_SIZE"),
    )
    max_link_num: int = Field(
        1000, gt=0, description="concurrent requests per API pod (429 past it)",
        **spec("ServerConfig", "maxLinkNum", "MAX_LINK_NUM", "MAX_CONCURRENT_REQUESTS")
    )
    e2e_timeout: float = Field(
        600.0, gt=0, description="seconds a whole request may take",
        **spec("ServerConfig", "e2eTimeout", "E2E_TIMEOUT"),
    )
    token_timeout: float = Field(
        600.0, gt=0, description="seconds between two tokens",
        **spec("ServerConfig", "tokenTimeout", "TOKEN_TIMEOUT"),
    )
    max_request_length: int = Field(
        40, gt=0, description="MB", **spec("ServerConfig", "maxRequestLength", "MAX_REQUEST_LENGTH")
    )
    max_header_bytes: int = Field(
        32768, ge=1024, description="bytes a request's header fields may take together, each counted as "
        "`name: value` and its line end (nginx's default); past it: 431",
        **spec("ServerConfig", "maxHeaderBytes", "MAX_HEADER_BYTES"),
    )
    timed_health_cache_seconds: float = Field(
        5.0, ge=0, description="seconds a GET /health/timed probe's result answers further calls (0: none); one "
        "probe generation runs at a time per pod, its result shared by the callers waiting",
        **spec("ServerConfig", "timedHealthCacheSeconds", "TIMED_HEALTH_CACHE_SECONDS"),
    )
    claim_idle_seconds: float = Field(
        30.0, gt=0, description="when live workers take over a dead worker's jobs",
        **spec("BackendConfig", "claimIdleSeconds", "CLAIM_IDLE_SECONDS")
    )
    max_deliveries: int = Field(
        3, gt=0, description="how often a job is tried",
        **spec("BackendConfig", "maxDeliveries", "MAX_DELIVERIES"),
    )
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="open requests' time to finish when a pod stops",
        **spec("ServerConfig", "shutdownGraceSeconds", "SHUTDOWN_GRACE_SECONDS")
    )

    # Operations
    log_format: Literal["text", "json"] = Field(
        "text", description="text, or json (one object per line)",
        **spec("LogConfig", "logFormat", "LOG_FORMAT"),
    )
    log_level: str = Field(
        "INFO", description="a logging level in any case; MindIE's Verbose is DEBUG",
        **spec("LogConfig", "logLevel", "LOG_LEVEL"),
    )
    worker_metrics_port: int = Field(
        0, ge=0, le=65535, description="0: off", **spec("BackendConfig", "workerMetricsPort", "WORKER_METRICS_PORT")
    )
    worker_metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="the address the worker's metrics listen on (0.0.0.0: every interface)",
        **spec("BackendConfig", "workerMetricsHost", "WORKER_METRICS_HOST"),
    )

    # Worker engine (README "Engines")
    engine: EngineName = Field(
        "transformers", description="the workers' engine",
        **spec("BackendConfig", "engine", "ENGINE"),
    )
    trust_remote_code: bool = Field(
        False, description="run the model folder's own Python code (Hugging Face trust_remote_code)",
        **spec("BackendConfig", "trustRemoteCode", "TRUST_REMOTE_CODE"),
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="further vllm.EngineArgs fields for the vllm engine (a JSON object)",
        **spec("BackendConfig", "vllmEngineArgs", "VLLM_ENGINE_ARGS"),
    )
    device: str = Field(
        "cpu", description="worker device: cpu, cuda[:n], npu[:n]",
        **spec("BackendConfig", "device", "DEVICE"),
    )
    dtype: DtypeName = Field(
        "float32", description="the model's dtype (vLLM's half and float too)",
        **spec("BackendConfig", "dtype", "DTYPE")
    )
    max_batch_size: int = Field(
        32, gt=0, description="running requests per worker (vLLM's max_num_seqs)",
        **spec("ScheduleConfig", "maxBatchSize", "MAX_BATCH_SIZE"),
    )
    max_prefill_tokens: int = Field(
        8192, gt=0, description="prompt tokens per prefill pass",
        **spec("ScheduleConfig", "maxPrefillTokens", "MAX_PREFILL_TOKENS", "MAX_BATCH_PREFILL_TOKENS")
    )
    max_prefill_batch_size: int = Field(
        8, ge=0, description="0: maxBatchSize (MindIE's rule)",
        **spec("ScheduleConfig", "maxPrefillBatchSize", "MAX_PREFILL_BATCH_SIZE"),
    )
    max_batch_total_tokens: int = Field(
        65536, gt=0, description="KV budget per worker, in tokens (both engines)",
        **spec("ScheduleConfig", "maxBatchTotalTokens", "MAX_BATCH_TOTAL_TOKENS")
    )
    cpu_threads_bind: str = Field(
        "auto", description="a CPU worker's torch threads (built-in engine): auto (its share of the usable cores but "
        "one, left to the API pod and Redis, claimed against the host's other workers: cpuWorkersPerHost; nothing "
        "when OMP_NUM_THREADS is set), nobind (torch's default) or cores such as 0-3,6",
        **spec("BackendConfig", "cpuThreadsBind", "CPU_THREADS_BIND"),
    )
    cpu_workers_per_host: int | None = Field(
        None, ge=1, description="the CPU workers of this host that cpuThreadsBind auto shares its cores among: each "
        "claims 1/N of them (default: the workers ferry-server starts, else 1)",
        **spec("BackendConfig", "cpuWorkersPerHost", "CPU_WORKERS_PER_HOST"),
    )
    compile_model: bool = Field(
        True, description="compile the built-in engine's decode steps and prompt passes of Llama, Mistral and Qwen2 "
        "models on CPU with torch.compile (Inductor, which needs a C++ compiler; without one they stay eager) when "
        "the worker starts: faster passes, a longer start", **spec("BackendConfig", "compileModel", "COMPILE_MODEL"),
    )
    worker_pool: str = Field(
        "cpu", pattern=r"^[A-Za-z0-9_-]+$", description="pool label in the worker's consumer name",
        **spec("BackendConfig", "workerPool", "WORKER_POOL")
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in ("cpu", "cuda", "npu"):
            raise ValueError("device must be cpu, cuda[:n] or npu[:n]")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, value: Any) -> Any:
        """vLLM's other names of two dtypes (``--dtype half``, ``float``)."""
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("cpu_threads_bind")
    @classmethod
    def _core_list(cls, value: str) -> str:
        if value not in ("auto", "nobind"):
            parse_core_list(value)
        return value

    @field_validator("truncation")
    @classmethod
    def _built_truncation(cls, value: int) -> int:
        if value != 0:  # MindIE's false is 0, its true (truncate) 1
            raise ValueError("only 0 or false (reject input over maxInputTokenLen) is supported; truncating "
                             "(-1, 1 or true) is not built")
        return value

    @field_validator("chat_template")
    @classmethod
    def _load_chat_template(cls, value: str | None) -> str | None:
        return None if value is None else load_chat_template(value)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        """Python's level names, in any case (MindIE's Info, Warn, ...), and MindIE's Verbose: DEBUG."""
        level = "DEBUG" if value.upper() == "VERBOSE" else value.upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ValueError("logLevel must be DEBUG (or VERBOSE), INFO, WARNING, ERROR or CRITICAL")
        return level

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """API_KEYS is comma separated; the config file may give a list."""
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("lora_adapter_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        """LORA_ADAPTER_ROOTS is comma separated; the config file may give a list."""
        return [root.strip() for root in value.split(",") if root.strip()] if isinstance(value, str) else value

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _split_domains(cls, value: Any) -> Any:
        """ALLOWED_MEDIA_DOMAINS_ENV is comma separated (the seed's form); hosts compare case-insensitively."""
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, list):
            return value
        return [host.strip().lower().rstrip(".") for host in value if host.strip()]

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> Any:
        """MODEL_CONFIG (env) holds the list as JSON."""
        return json.loads(value) if isinstance(value, str) else value

    # The checks across settings. Pydantic runs them in the order below, and the first that fails is the error
    # reported: the defaults that follow from other settings come first, the model pick before its name's check.

    @model_validator(mode="after")
    def _input_below_seq_len(self) -> Settings:
        """maxInputTokenLen at most maxSeqLen less one: a prompt must leave room for a generated token."""
        if self.max_input_token_len >= self.max_seq_len:
            self.max_input_token_len = self.max_seq_len - 1
        return self

    @model_validator(mode="after")
    def _prefill_batch_default(self) -> Settings:
        """maxPrefillBatchSize 0 is maxBatchSize (MindIE's rule)."""
        if self.max_prefill_batch_size == 0:
            self.max_prefill_batch_size = self.max_batch_size
        return self

    @model_validator(mode="after")
    def _unique_model_names(self) -> Settings:
        """ModelConfig's names are how requests and workers address a model: two alike would be one."""
        names = [entry.name for entry in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"ModelConfig: modelName values must be unique. Given: {names}")
        return self

    @model_validator(mode="after")
    def _pick_model(self) -> Settings:
        """With ModelConfig and no modelWeightPath: the model named by modelName (the first by default)."""
        names = [entry.name for entry in self.models]
        if self.models and self.model_path is None:
            name = self.model_name or names[0]
            if name not in names:
                raise ValueError(f"modelName `{name}` (MODEL_NAME / --model-name) is not in ModelConfig: {names}")
            self.model_name, self.model_path = name, self.models[names.index(name)].path
        return self

    @model_validator(mode="after")
    def _vllm_parallel_sizes(self) -> Settings:
        """vLLM's parallel sizes are the devices a worker takes (:attr:`devices_per_worker`): each a count."""
        for key in VLLM_PARALLEL_ARGS:
            size = self.vllm_engine_args.get(key, 1)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"vllmEngineArgs.{key} must be a positive integer. Given: {size!r}")
        return self

    @model_validator(mode="after")
    def _no_braces_in_model_name(self) -> Settings:
        """A model's Redis keys are hash-tagged by its name (common.keys): a brace in it would split the tag, and
        the model's keys would no longer sit on one Redis Cluster shard."""
        if "{" in self.served_model_name or "}" in self.served_model_name:
            raise ValueError(f"the model name `{self.served_model_name}` must not contain braces")
        return self

    @model_validator(mode="after")
    def _https_files(self) -> Settings:
        """HTTPS needs its certificate and key, mutual TLS needs HTTPS, and each file must exist: found out at
        start-up rather than at the first client's handshake."""
        if self.https_enabled:
            for key, path in (("tlsCert", self.tls_cert), ("tlsPk", self.tls_pk)):
                if path is None:
                    raise ValueError(f"httpsEnabled needs {key}")
            for key, path in (("tlsCert", self.tls_cert), ("tlsPk", self.tls_pk), ("tlsCaCerts", self.tls_ca_certs)):
                if path is not None and not path.is_file():
                    raise ValueError(f"{key}: no such file {path}")
        elif self.tls_ca_certs is not None:
            raise ValueError("tlsCaCerts (mutual TLS) needs httpsEnabled")
        return self

    @model_validator(mode="after")
    def _management_plane_port(self) -> Settings:
        """A management address with no port of its own would listen on nothing (:attr:`listeners`)."""
        if self.management_host is not None and self.management_port in (0, self.port) and self.metrics_port in (
                0, self.port):
            raise ValueError("managementIpAddress needs a managementPort or metricsPort other than port")
        return self

    @model_validator(mode="after")
    def _all_zero_addresses(self) -> Settings:
        """allowAllZeroIpListening false: MindIE's guard against listening on every interface."""
        if not self.allow_all_zero_ip_listening:
            for key, host in (("ipAddress", self.host), ("managementIpAddress", self.management_host)):
                if host in ("0.0.0.0", "::"):
                    raise ValueError(f"{key} {host} listens on every interface: allowAllZeroIpListening is false")
        return self

    @model_validator(mode="after")
    def _redis_tls(self) -> Settings:
        """Redis TLS files need a rediss:// URL, a certificate its key, and each file must exist: a client made
        without them would fail at its first command, far from the setting at fault."""
        redis_tls = {"redisTlsCaCerts": self.redis_tls_ca_certs, "redisTlsCert": self.redis_tls_cert,
                     "redisTlsKey": self.redis_tls_key}
        given = {key: path for key, path in redis_tls.items() if path is not None}
        if given and not self.redis_url.startswith("rediss://"):
            raise ValueError(f"{', '.join(given)} need a rediss:// redisUrl (Redis over TLS)")
        if (self.redis_tls_cert is None) != (self.redis_tls_key is None):
            raise ValueError("redisTlsCert and redisTlsKey go together")
        for key, path in given.items():
            if not path.is_file():
                raise ValueError(f"{key}: no such file {path}")
        return self

    @property
    def listeners(self) -> dict[tuple[str, int], frozenset[str]]:
        """Each (host, port) the API pod listens on and the planes it serves there: ``business`` (every
        route), ``management`` (health, status, metrics, stopService), ``metrics`` (the metrics routes).
        A management or metrics port left 0 or equal to the business port adds nothing."""
        result: dict[tuple[str, int], set[str]] = {(self.host, self.port): {"business"}}
        host = self.management_host or self.host
        for plane, port in (("management", self.management_port), ("metrics", self.metrics_port)):
            if port not in (0, self.port):
                result.setdefault((host, port), set()).add(plane)
        return {address: frozenset(planes) for address, planes in result.items()}

    @property
    def devices_per_worker(self) -> int:
        """The devices one worker runs its model on: the built-in engine uses one (``device``), vLLM its tensor
        times pipeline parallel size (``vllmEngineArgs``)."""
        if self.engine != "vllm":
            return 1
        return math.prod(self.vllm_engine_args.get(key, 1) for key in VLLM_PARALLEL_ARGS)

    @property
    def redis_location(self) -> str:
        """The Redis URL with its password masked, for messages and logs."""
        parts = urlsplit(self.redis_url)
        if parts.password is None:
            return self.redis_url
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))

    @property
    def redis_options(self) -> dict[str, Any]:
        """What every Redis client of the deployment is made with besides the URL (redis-py's names)."""
        options = {"ssl_ca_certs": self.redis_tls_ca_certs, "ssl_certfile": self.redis_tls_cert,
                   "ssl_keyfile": self.redis_tls_key}
        return {name: str(value) for name, value in options.items() if value is not None}

    @property
    def served_model_name(self) -> str:
        """The model id clients address; defaults to the model folder's name."""
        if self.model_name:
            return self.model_name
        return (self.model_path or default_model_dir()).name

    @property
    def resolved_model_path(self) -> Path:
        return self.model_path or default_model_dir()

    @property
    def served_models(self) -> list[ModelEntry]:
        """Every model of the deployment, the default one (MODEL_NAME, else the first) first."""
        name = self.served_model_name
        entry = next((entry for entry in self.models if entry.name == name), None)
        adapters = {**(entry.lora_modules if entry else {}), **self.lora_modules}
        default = ModelEntry(name=name, path=self.resolved_model_path, lora_modules=adapters)
        return [default, *(entry for entry in self.models if entry.name != default.name)]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvSource(settings_cls), JsonConfigSource(settings_cls))


def effective_config(settings: Settings) -> dict[str, Any]:
    """The settings in the config file's nested layout (:func:`common.config_file.nest_config`), without
    secrets: no ``apiKeys``, the Redis password masked in ``redisUrl``. The served models are ``ModelConfig``
    (the default one first), so the flat-only ``modelName`` / ``modelWeightPath`` are not repeated."""
    values = settings.model_dump(mode="json")
    flat = {key: values[name] for key, (_, _, name) in setting_keys(Settings).items() if key != "apiKeys"}
    flat.update(redisUrl=settings.redis_location,
                ModelConfig=[entry.model_dump(mode="json", by_alias=True) for entry in settings.served_models])
    return nest_config(flat, Settings)


def _describe(error: Any) -> str:
    """One line naming the setting of a pydantic error: its place in the config file and its env var."""
    loc = [str(part) for part in error.get("loc", ())]
    message = error["msg"].removeprefix("Value error, ")
    if not loc:
        return message
    keys = setting_keys(Settings)
    key = loc[0]
    if key not in keys:  # given by field name (a command-line option)
        key = next((k for k, (_, _, name) in keys.items() if name == key), key)
    _, _, name = keys.get(key, (None, "", ""))
    dotted = key_path(key, keys) + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc[1:])
    given = f" (given {error['input']!r})" if "input" in error and not isinstance(error["input"], (dict, list)) else ""
    if key == "apiKeys":
        given = ""  # never echo secrets
    return f"`{dotted}`" + (f" (env {' / '.join(env_names(name))})" if name else "") + f": {message}{given}"


def _env_value(value: Any) -> str:
    """A setting's value as its env var holds it: a list comma separated (API_KEYS' form), a number, bool or
    object as JSON."""
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value) if isinstance(value, (str, Path)) else json.dumps(value)


def settings_env(environ: Mapping[str, str], values: dict[str, Any]) -> dict[str, str]:
    """``environ`` with ``values`` (settings by field name) in their env vars, for a child process to read them
    as this one has them: without the settings' other names (vLLM's, TGI's, the camelCase key), which could
    disagree."""
    given = {alias.lower() for name in values for alias in setting_names(name)}
    env = {key: value for key, value in environ.items() if key.lower() not in given}
    env.update({env_names(name)[0]: _env_value(value) for name, value in values.items()})
    return env


def load_settings(**overrides: Any) -> Settings:
    """The settings from ``overrides`` (command-line options), env and FERRY_CONFIG, or a
    :class:`ConfigError` whose message names each key at fault."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(error) for error in exc.errors())) from None


def settings_or_exit(prog: str, **overrides: Any) -> Settings:
    """:func:`load_settings` for a command's start-up: an invalid configuration stops it with the message."""
    try:
        return load_settings(**overrides)
    except ConfigError as exc:
        print(f"{prog}: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
