"""Env vars that look like settings but that nothing here reads, named at start-up.

A vLLM or TGI user brings their environment along: the names that mean what one of Ferry's settings means are
read as that setting (:func:`common.settings.setting_names`); the others would change nothing without a word. So
each command logs a warning, at start, for every env var that is

- one of TGI's launcher settings, or one of vLLM's options written as an env var, that Ferry does not read
  (:data:`UNREAD`, with what Ferry has instead);
- a ``VLLM_*`` name that is neither Ferry's nor one vLLM reads (vLLM's own list, ``vllm.envs``);
- close to one of Ferry's own names (a typo such as ``MAX_BATCH_SIZES``).

README "Coming from vLLM or TGI" lists them.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path

from common.run_files import RUN_DIR_ENV
from common.settings import Settings, setting_names

log = logging.getLogger("ferry.settings")

FERRY_ENV = ("FERRY_CONFIG", "FERRY_HOME", RUN_DIR_ENV)
"""Ferry's env vars that are not settings."""
NEAR_MISS_CUTOFF = 0.85
"""How alike (difflib's ratio) a name must be to one of Ferry's to be taken for a typo of it: MAX_BATCH_SIZES,
REDIS_URI and DTYPES are; the usual names of shells, containers and Kubernetes (HOSTNAME, REDIS_PORT,
NODE_NAME, ...) are not."""
_VLLM_ARGS = "ENGINE=vllm and VLLM_ENGINE_ARGS"
_TENSOR_PARALLEL = f"{_VLLM_ARGS} {{\"tensor_parallel_size\": N}} (ferry-server --tensor-parallel-size N)"

UNREAD: dict[str, str] = {
    # TGI's launcher (text-generation-launcher): its settings that mean nothing Ferry has
    "NUM_SHARD": _TENSOR_PARALLEL,
    "SHARDED": _TENSOR_PARALLEL,
    "QUANTIZE": f"{_VLLM_ARGS} {{\"quantization\": ...}}",
    "SPECULATE": f"{_VLLM_ARGS} {{\"speculative_config\": ...}}",
    "KV_CACHE_DTYPE": f"{_VLLM_ARGS} {{\"kv_cache_dtype\": ...}}",
    "CUDA_MEMORY_FRACTION": f"{_VLLM_ARGS} {{\"gpu_memory_utilization\": ...}}",
    "CUDA_GRAPHS": "the vllm engine captures CUDA graphs itself; the built-in engine has none",
    "ROPE_SCALING": "the model's config.json (rope_scaling)",
    "ROPE_FACTOR": "the model's config.json (rope_scaling)",
    "REVISION": "a model folder, or the hub id's files as the Hugging Face cache holds them",
    "LORA_ADAPTERS": "LORA_MODULES",
    "PAYLOAD_LIMIT": "MAX_REQUEST_LENGTH (in MB, not bytes)",
    "JSON_OUTPUT": "LOG_FORMAT=json",
    "MAX_BEST_OF": "none: best_of is always 1",
    "MAX_STOP_SEQUENCES": "none: the limit of stop sequences is fixed",
    "MAX_TOP_N_TOKENS": "none: top_n_tokens is accepted and has no effect",
    "MAX_CLIENT_BATCH_SIZE": "none",
    "MAX_WAITING_TOKENS": "none: a worker with room takes queued requests between any two steps",
    "WAITING_SERVED_RATIO": "none: a worker with room takes queued requests between any two steps",
    "VALIDATION_WORKERS": "none: run more API pods",
    "CORS_ALLOW_ORIGIN": "none: put a proxy in front",
    "OTLP_ENDPOINT": "none: Prometheus metrics at /metrics",
    "DISABLE_CUSTOM_KERNELS": "none",
    "WATERMARK_GAMMA": "none: no watermarking",
    "WATERMARK_DELTA": "none: no watermarking",
    "TOKENIZER_CONFIG_PATH": "CHAT_TEMPLATE for the chat template; the tokenizer is the model folder's",
    # vLLM's options (vllm serve --max-num-seqs ...) written as env vars: vLLM itself takes them as options only
    "MAX_NUM_SEQS": "MAX_BATCH_SIZE (ferry-server --max-num-seqs)",
    "TENSOR_PARALLEL_SIZE": _TENSOR_PARALLEL,
    "GPU_MEMORY_UTILIZATION": f"{_VLLM_ARGS} {{\"gpu_memory_utilization\": ...}}",
    "MAX_NUM_BATCHED_TOKENS": f"{_VLLM_ARGS} {{\"max_num_batched_tokens\": ...}}",
    "QUANTIZATION": f"{_VLLM_ARGS} {{\"quantization\": ...}}",
}


def vllm_env_names() -> frozenset[str] | None:
    """The env vars vLLM reads (the keys of ``vllm.envs.environment_variables``), none when vLLM is not
    installed, None when its list cannot be found. Read from the module's source rather than imported:
    importing vllm imports torch, seconds an API pod does not otherwise spend."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "envs.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "environment_variables" and isinstance(node.value, ast.Dict):
            return frozenset(key.value for key in node.value.keys
                             if isinstance(key, ast.Constant) and isinstance(key.value, str))
    return None


def ferry_env_names() -> dict[str, str]:
    """Every env var name Ferry reads, by its upper case (settings are read case-insensitively, by their env
    names, vLLM's and TGI's, and their camelCase keys)."""
    names = [*FERRY_ENV, *(alias for field in Settings.model_fields for alias in setting_names(field))]
    return {name.upper(): name for name in names}


def look_alike_warnings(environ: Mapping[str, str]) -> list[str]:
    """One line for each env var of ``environ`` that looks like a setting but is not read (module docstring)."""
    ferry = ferry_env_names()
    foreign = sorted(name for name in environ if name.upper() not in ferry)
    vllm = vllm_env_names() if any(name.upper().startswith("VLLM_") for name in foreign) else None
    lines = []
    for name in foreign:
        upper = name.upper()
        close = [ferry[match] for match in difflib.get_close_matches(upper, ferry, n=1, cutoff=NEAR_MISS_CUTOFF)]
        hint = f" (did you mean {close[0]}?)" if close else ""
        if upper in UNREAD:
            lines.append(f"env {name} is not read by Ferry; instead: {UNREAD[upper]}")
        elif upper.startswith("VLLM_"):
            if vllm is not None and name not in vllm:
                reader = "vLLM does not read it either" if vllm else "vLLM is not installed"
                lines.append(f"env {name} is not read by Ferry and {reader}{hint}")
        elif close:
            lines.append(f"env {name} is not read by Ferry{hint}")
    return lines


def warn_look_alikes(environ: Mapping[str, str]) -> None:
    """Log :func:`look_alike_warnings` (each command calls it at start, once its logging is configured)."""
    for line in look_alike_warnings(environ):
        log.warning(line)
