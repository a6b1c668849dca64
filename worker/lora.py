"""LoRA adapter folders as both engines take them: what a folder must hold before an engine loads it, whether
its weights fit the served model, and the one line a client gets when they do not.

The built-in engine loads adapters with peft, which raises for weights shaped for another model or layers
LoRA cannot wrap; vLLM loads some such adapters without a word. So the vllm engine first loads the adapter
with peft onto the model's skeleton on the ``meta`` device (no memory, no weights read into it), which raises
what the built-in engine's load would.
"""

from __future__ import annotations

import os
import warnings

import torch
from peft import LoraConfig, PeftConfig, PeftModel
from peft.utils import CONFIG_NAME as ADAPTER_CONFIG
from transformers import AutoModelForCausalLM, PretrainedConfig

from common.protocol import AdapterRef
from worker.engine import RequestRefused


def read_config(path: str) -> LoraConfig:
    """The adapter's config; raises ValueError for a folder that holds no LoRA adapter for a causal LM."""
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):  # (peft would look for it on the Hub)
        raise ValueError("no such folder" if not os.path.isdir(path)
                         else f"the folder holds no peft adapter (no {ADAPTER_CONFIG})")
    config = PeftConfig.from_pretrained(path)
    if not isinstance(config, LoraConfig):
        raise ValueError(f"it is a {config.peft_type} adapter, not LoRA")
    if config.task_type not in (None, "CAUSAL_LM"):
        raise ValueError(f"it is a {config.task_type} adapter, not one for a causal LM")
    return config


def check_fits(path: str, model_config: PretrainedConfig) -> None:
    """Raise what peft raises loading the adapter into a model of ``model_config`` (on the meta device)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    with warnings.catch_warnings():  # that copying weights onto the meta device does nothing: as meant here
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter", category=UserWarning)
        PeftModel.from_pretrained(skeleton, path, config=read_config(path))


def refusal(adapter: AdapterRef, exc: Exception) -> RequestRefused:
    """The adapter cannot be loaded, in one line: a state dict that does not fit lists every mismatched
    weight, the first one says enough."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
    return RequestRefused(f"the LoRA adapter `{adapter.name}` cannot be loaded from {adapter.path}: "
                          f"{' '.join(lines[:2])}{more}")
