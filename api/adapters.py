"""LoRA adapters: each model's adapter registry in Redis (:func:`common.keys.adapters_key`), which the
run-time routes vLLM and MindIE serve change (``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
in :mod:`api.openai.routes`: vLLM answers them in OpenAI's error format).

A request selects an adapter by name (TGI and KServe ``adapter_id``, OpenAI ``model``) and the pipeline takes it
while the name is in the registry. Workers load an adapter from its folder the first time a job names it.
Unloading removes the name at once (new requests for it are refused) and tells the model's workers, which free
the weights when the requests already running with it have finished: nothing running is cut short.

The load route takes folders in the allowed ones only (:func:`allowed_folder`): any other path, whether it exists
or not, gets the same refusal, which names no path, so the route neither loads nor reveals the server's files.
"""

from __future__ import annotations

import json
from pathlib import Path

from api.context import ServerContext
from common import keys
from common.connection import as_text, publish
from common.protocol import Control
from common.settings import Settings

ADAPTER_CONFIG = "adapter_config.json"  # peft's save_pretrained writes it beside the weights


async def register_configured(ctx: ServerContext) -> None:
    """Put every model's configured adapters (``loraModules``) in its registry; each pod does so at start-up."""
    for entry in ctx.settings.served_models:
        if entry.lora_modules:
            # a copy, typed as redis-py wants: its mapping type is invariant in the key
            await ctx.redis.hset(keys.adapters_key(entry.name), mapping=dict(entry.lora_modules.items()))


async def registered(ctx: ServerContext) -> dict[str, str]:
    """The adapters of the model of ``ctx``: name -> folder."""
    found = await ctx.redis.hgetall(keys.adapters_key(ctx.model.model_id))
    return {as_text(name): as_text(path) for name, path in found.items()}


async def model_of(ctx: ServerContext, adapter: str) -> ServerContext | None:
    """The context of the served model that has the adapter ``adapter``, None when none has."""
    pipe = ctx.redis.pipeline(transaction=False)
    for model in ctx.models:
        pipe.hexists(keys.adapters_key(model), adapter)
    found = await pipe.execute()
    return next((ctx.for_model(model) for model, has in zip(ctx.models, found, strict=True) if has), None)


async def was_unloaded(ctx: ServerContext, name: str) -> bool:
    """Whether ``name`` is an adapter of the model of ``ctx`` that was unloaded (and may be loaded again)."""
    return bool(await ctx.redis.sismember(keys.unloaded_adapters_key(ctx.model.model_id), name))


def allowed_folder(settings: Settings, path: str) -> bool:
    """Whether ``path``, symlinks and ``..`` resolved, is in a folder adapters may be loaded from at run time:
    one of loraAdapterRoots, or a configured adapter's own (loraModules), which can so be loaded again."""
    configured = [Path(folder) for entry in settings.served_models for folder in entry.lora_modules.values()]
    try:
        target = Path(path).resolve()
        return any(target.is_relative_to(root.resolve()) for root in [*settings.lora_adapter_roots, *configured])
    except (OSError, RuntimeError, ValueError):  # a NUL character; a symlink loop (RuntimeError before 3.13)
        return False


def folder_refusal(path: str) -> str | None:
    """Why ``path`` is not a LoRA adapter folder, None when it is one."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not Path(path).is_dir():
        return f"{path} is not a folder"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{config_file} cannot be read as JSON: {exc}"
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return f"{config_file} is not a LoRA adapter's config (peft_type is not LORA)"
    return None


async def add(ctx: ServerContext, name: str, path: str) -> bool:
    """Register the adapter for the model of ``ctx``; False when the name is taken."""
    return bool(await ctx.redis.hsetnx(keys.adapters_key(ctx.model.model_id), name, path))


async def remove(ctx: ServerContext, name: str) -> bool:
    """Refuse new requests for the adapter and tell the model's workers to free it once unused; False when
    the model has no such adapter."""
    model = ctx.model.model_id
    if not await ctx.redis.hdel(keys.adapters_key(model), name):
        return False
    await ctx.redis.sadd(keys.unloaded_adapters_key(model), name)
    await publish(ctx.redis, ctx.settings.redis_cluster, keys.control_channel(model),
                  Control(request_id=name, action="unload_adapter").model_dump_json())
    return True
