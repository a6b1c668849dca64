"""Decode steps and prompt passes of a Llama-family model with fewer small ops than its forward, compiled.

On CPU a decode step of a small batch is its matrix products plus a few hundred small ops between them, and
those cost as much again when run one by one after the products have streamed the weights through the caches
(bench/RESULTS.md); vLLM compiles them into a few fused kernels. :class:`LlamaStep` runs a pass from the model's
own modules (embeddings, RMSNorms, rotary embedding, LM head), its grouped oneDNN products
(:class:`worker.cpu_linear.SiblingGroup`) and its attention function, but takes the query and key heads of the
stacked q/k/v product as one tensor and rotates them together (``roll`` and a sign-folded sine in place of
``rotate_half``'s slices and ``cat``), and the gated MLP's halves as views of one product: the same operations
on the same values in the same order, so its logits are bit-identical to the model's forward
(tests/test_llama_step.py), in less time per decode step of several rows (bench/RESULTS.md). It writes new keys
and values into the cache's buffers itself (:meth:`worker.kv_cache.GrowingCache.reserve`) and returns the last
position's logits only.

With the worker's ``compileModel`` setting (on by default, as vLLM compiles its CPU models), the passes are also
compiled by ``torch.compile`` with Inductor: the small ops become a few generated C++ kernels and the products stay
oneDNN calls (``torch.ops.ferry.packed_linear``). The compile runs behind the served passes
(:meth:`LlamaStep.compile_behind`): a worker serves eagerly from the moment its model is loaded, and takes the
compiled passes when they are ready, so a compile never holds up its health or its first requests. Inductor
keeps the generated kernels in its cache (``TORCHINDUCTOR_CACHE_DIR``), so a restart on the same machine only
traces the model again. The logits match the eager
ones within float rounding (Inductor reorders the RMSNorm's sums). Three graphs, each dynamic in its sizes,
serve every pass (:data:`COMPILED_SHAPES`); a decode step of one row (its products take MKL's dense path), a
cache of under two positions or a one-token prompt runs eagerly. Where Inductor cannot compile (no C++ compiler,
say) the passes stay eager, with a warning.

It only takes the families whose decoder layer it reproduces (:data:`FAMILIES`), prepared as :func:`applies`
checks; every other model, a model wrapped by peft for LoRA, and prompt passes that need every position's
logits or media features run the model's forward.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F
from torch._inductor.runtime.cache_dir_utils import cache_dir
from transformers import PreTrainedModel

from worker.attention import PADDED_SDPA, padded_sdpa_attention
from worker.cpu_linear import DENSE_ROWS
from worker.kv_cache import GrowingCache

log = logging.getLogger(__name__)

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
"""``model_type``s whose decoder layer is Llama's: pre-norm RMSNorm, rotary q/k/v attention without q/k norms,
a SiLU-gated MLP, plain residual adds, unscaled embeddings (bit-equality with their forward is tested)."""


INDUCTOR_OPTIONS: dict[str, Any] = {
    "dce": True, "size_asserts": False, "nan_asserts": False, "epilogue_fusion": True, "cpp.dynamic_threads": True,
}
"""vLLM's Inductor options on CPU: no size or NaN checks at every call, and kernels that take torch's thread count
at run time (the worker binds its threads after load, worker/cpu_threads.py) rather than the one at compile time."""

COMPILED_SHAPES = ((2, 1, 2), (1, 2, 0), (2, 2, 0))
"""(rows, new positions, cached positions) of the pass that builds each graph: decode steps, a one-row
prompt, a prompt batch. torch.compile gives sizes 0 and 1 graphs of their own and makes every other size a
symbol, so these three serve any decode step of two rows or more on a cache of two positions or more, and any
prompt pass of two tokens or more on an empty cache (:meth:`LlamaStep.compiles`)."""

COMPILE_NICENESS = 10
"""How much lower than the serving threads' the compile thread's CPU priority is (Linux ``nice``): on a worker's
few cores the eager passes being served go first; Inductor's compile processes, started from that thread,
inherit it."""


COMPILE_CANCEL_SECONDS = 30.0
"""How long :meth:`LlamaStep.cancel_compile` waits for the compile thread to end (it ends at its next Python
line, which a kernel build being waited for can hold back)."""


def _distinct_sizes() -> AbstractContextManager[None]:
    """Symbolic shapes without duck sizing: sizes that happen to be equal stay distinct symbols."""
    # patch is what torch's install_config_module adds at run time; this config module, unlike
    # torch._dynamo.config, does not import its declaration (torch.utils._config_typing) for type checkers
    return shape_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]


class CompileCancelled(BaseException):
    """Raised in the compile thread to end it (:meth:`LlamaStep.cancel_compile`); a BaseException, so that
    torch's handlers of ``Exception`` let it through."""


def applies(model: PreTrainedModel) -> bool:
    """Whether :class:`LlamaStep` reproduces this model's passes: a causal LM of :data:`FAMILIES` with
    the padded SDPA attention (full attention, :func:`worker.attention.use_padded_attention`), a SiLU MLP and
    grouped packed products in every layer (:func:`worker.cpu_linear.use_packed_linear` on CPU)."""
    config = model.config
    inner = getattr(model, "model", None)
    if (config.model_type not in FAMILIES or config._attn_implementation != PADDED_SDPA
            or config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1
            or inner is None or not hasattr(model, "lm_head")):
        return False
    return all(
        getattr(layer.self_attn.q_proj, "group", None) is not None
        and layer.self_attn.q_proj.group.members
        == [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        and getattr(layer.mlp.gate_proj, "group", None) is not None
        and layer.mlp.gate_proj.group.members == [layer.mlp.gate_proj, layer.mlp.up_proj]
        for layer in inner.layers
    )


class LlamaStep:
    """The last position's logits of a decode step or prompt pass of a model :func:`applies` takes; see the
    module docstring."""

    @classmethod
    def of(cls, model: PreTrainedModel) -> LlamaStep | None:
        """The step for ``model``, eager, or None where it does not apply (:func:`applies`)."""
        return cls(model) if applies(model) else None

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.compiled: Any = None  # the compiled _layers, once compile() succeeded
        self._compiling: threading.Thread | None = None

    def compile_behind(self) -> None:
        """Start :meth:`compile` in a thread of its own, at a lower CPU priority (:data:`COMPILE_NICENESS`): the
        passes run eagerly until it is done, then compiled. Only the graphs' construction runs in that thread,
        on inputs of its own; the model's modules must not change until :meth:`wait_compiled` returns."""
        log.info("compiling the model's decode steps and prompt passes (Inductor's cache: %s); the passes run "
                 "eagerly meanwhile", cache_dir())
        self._compiling = threading.Thread(target=self._compile_niced, name="ferry-compile", daemon=True)
        self._compiling.start()

    def wait_compiled(self) -> None:
        """Return once a compile started by :meth:`compile_behind` has ended (at once when none runs)."""
        if self._compiling is not None:
            self._compiling.join()

    def cancel_compile(self) -> None:
        """End a compile started by :meth:`compile_behind` that still runs, as the worker stops. Python ends no
        thread from outside, so this raises :class:`CompileCancelled` in it (CPython's
        ``PyThreadState_SetAsyncExc``); left running into the interpreter's exit, the thread would be killed
        inside torch's C++ frames, which aborts the process."""
        thread = self._compiling
        if thread is None or thread.ident is None or not thread.is_alive():
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileCancelled))
        thread.join(COMPILE_CANCEL_SECONDS)

    def _compile_niced(self) -> None:
        started = time.monotonic()
        try:
            if sys.platform == "linux":  # there a thread's priority is its own (``nice`` of its thread id)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
            self.compile()
        except CompileCancelled:
            log.info("stopped compiling the model's passes after %.1f s", time.monotonic() - started)

    def compile(self) -> bool:
        """Compile the passes and build their graphs (:data:`COMPILED_SHAPES`) on dummy inputs, so that requests
        do not wait for Inductor; returns whether it compiled (the passes stay eager where it did not)."""
        compiled = torch.compile(self._layers, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
        started = time.monotonic()
        device = self.model.device
        try:
            with torch.inference_mode(), _distinct_sizes():  # tensors as the engine's
                for rows, new, length in COMPILED_SHAPES:
                    cache = GrowingCache()
                    if length:
                        self._reserve(cache, rows, length)
                        cache.commit(length)
                    buffers, _ = self._reserve(cache, rows, new)
                    compiled(torch.zeros((rows, new), dtype=torch.long, device=device),
                             torch.ones((rows, 1, new, length + new), dtype=torch.bool, device=device),
                             torch.arange(length, length + new, device=device).repeat(rows, 1), length, buffers)
        except Exception as exc:  # Inductor's failures have no common type (a missing compiler, an unsupported op)
            log.warning("the model's passes stay eager: torch.compile failed: %s",
                        str(exc).strip().splitlines()[0])
            return False
        log.info("compiled the model's decode steps and prompt passes in %.1f s: the compiled passes serve from "
                 "now on", time.monotonic() - started)
        self.compiled = compiled
        return True

    @staticmethod
    def compiles(rows: int, new: int, length: int) -> bool:
        """Whether a pass of ``rows`` rows of ``new`` positions on ``length`` cached ones takes a graph of
        :data:`COMPILED_SHAPES`."""
        if new == 1:
            return rows > DENSE_ROWS and length >= 2
        return length == 0

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: GrowingCache) -> torch.Tensor:
        """``input_ids`` and ``positions`` [batch, new], ``mask`` boolean [batch, 1, new, keys] over the cache
        and the new positions; appends each layer's keys and values to ``cache``; returns the last position's
        logits [batch, 1, vocab]."""
        rows, new = input_ids.shape
        buffers, length = self._reserve(cache, rows, new)
        if self.compiled is not None and self.compiles(rows, new, length):
            with _distinct_sizes():
                logits = self.compiled(input_ids, mask, positions, length, buffers)
        else:
            logits = self._layers(input_ids, mask, positions, length, buffers)
        cache.commit(length + new)
        return logits

    def _reserve(self, cache: GrowingCache, rows: int,
                 new: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        shape = torch.empty((rows, self.kv_heads, new, self.head_dim), dtype=self.model.dtype,
                            device=self.model.device)
        return cache.reserve(len(self.model.model.layers), shape, shape)

    def _layers(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, length: int,
                buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The pass on the cache's key and value buffers, which hold ``length`` positions: writes each layer's
        new keys and values after them."""
        inner = self.model.model
        batch, new = input_ids.shape
        end = length + new
        heads, kv_heads, dim, half = self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)  # [batch, new, dim]
        cos = cos[:, :, None, :]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None, :]
        rotated = (heads + kv_heads) * dim  # the query and key columns of the q/k/v product
        for layer, (keys, values) in zip(inner.layers, buffers, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = attention.q_proj.group.stacked(layer.input_layernorm(hidden))
            query_key = qkv[..., :rotated].view(batch, new, heads + kv_heads, dim)
            query_key = query_key * cos + torch.roll(query_key, half, -1) * sin
            keys[:, :, length:end].copy_(query_key[:, :, heads:].transpose(1, 2))
            values[:, :, length:end].copy_(qkv[..., rotated:].view(batch, new, kv_heads, dim).transpose(1, 2))
            output, _ = padded_sdpa_attention(attention, query_key[:, :, :heads].transpose(1, 2),
                                              keys[:, :, :end], values[:, :, :end], mask, scaling=attention.scaling)
            hidden = hidden + attention.o_proj(output.reshape(batch, new, heads * dim))
            gate_up = mlp.gate_proj.group.stacked(layer.post_attention_layernorm(hidden))
            gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
        return self.model.lm_head(inner.norm(hidden[:, -1:]))
