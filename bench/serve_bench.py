"""Serving benchmark of Ferry: one command, one report (issue #7).

``.venv/bin/python bench/serve_bench.py [--help]`` starts its own redis-server on a free port and, against
it, separate API and worker processes as in production, then measures:

1. load: the TGI ``/generate_stream`` and ``/generate`` routes at each concurrency level (closed loop,
   a fixed number of requests, prompts cut to exactly ``--prompt-tokens`` by TGI's ``truncate``, greedy,
   exactly ``--new-tokens`` each);
2. the queue hop's overhead: the same prompts, lengths and concurrency through the continuous-batching
   engine called in this process (no HTTP, no Redis), right after the served run of each level;
3. fan-out: how many SSE streams one API pod, pinned to one core, relays from ``bench/fake_token_worker.py``
   (a benchmark-only worker without a model), with the pod's CPU and memory;
4. scale-out: 2 API and 2 worker processes against 1 and 1, at the same load.

Fixed output lengths: the served model is a copy of the tiny model whose ``config.json`` and
``generation_config.json`` have ``eos_token_id: null`` (the engine reads its EOS ids from there, as
bench/bench_engine.py switches them off in memory), so every request generates exactly ``max_new_tokens``.
Workers and the in-process engine run torch with one thread (OMP_NUM_THREADS=1 / torch.set_num_threads(1)):
on a 2-core machine that also runs the API, Redis and the load generator, two OpenMP threads per worker
fight the other processes for the cores and a step takes several times longer.

All traffic goes to 127.0.0.1; every level is bounded by its request count and a time limit. Writes
``report.md``, ``report.json`` and ``serving.png`` to ``--out`` (default bench/out/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import psutil
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench_engine import make_prompts  # noqa: E402
from common.process import freeze_startup_heap  # noqa: E402
from common.protocol import ErrorEvent, Job, SamplingParams  # noqa: E402
from common.settings import Settings, default_model_dir  # noqa: E402
from loadgen import COLLECT_ROUTE, STREAM_ROUTE, RequestRecord, run_level, summarize, tgi_body  # noqa: E402
from server.embedded import embedded_redis  # noqa: E402
from tests.helpers import Stack, free_port, stop_stack, wait_healthy  # noqa: E402
from worker.tiny_model import ensure_tiny_model  # noqa: E402
from worker.transformers_engine import TransformersEngine  # noqa: E402

REQUEST_TIMEOUT = 120.0
FANOUT_LINKS = 100_000  # MAX_LINK_NUM / MAX_QUEUE_SIZE / the fake worker's MAX_BATCH_SIZE for the fan-out run
ITL_TARGET_MS = 50.0


# -- set-up ----------------------------------------------------------------------------------------


def model_without_eos(source: Path, dest: Path) -> Path:
    """A copy of the model folder whose config and generation config declare no EOS token."""
    shutil.copytree(source, dest)
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": None}, indent=2))
    return dest


def prompt_texts(tokenizer: PreTrainedTokenizerBase, count: int, tokens: int) -> list[str]:
    """Seeded random texts that tokenize to at least ``tokens`` tokens (the route keeps the last ``tokens``)."""
    texts = [tokenizer.decode(ids) for ids in make_prompts(tokenizer, len(tokenizer), count, 2 * tokens)]
    assert all(len(tokenizer(text)["input_ids"]) >= tokens for text in texts)
    return texts


def machine_facts() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    meminfo = Path("/proc/meminfo").read_text()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                           if line.startswith("model name")), platform.processor()),
        "ram_gib": round(int(meminfo.split("MemTotal:")[1].split()[0]) / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": commit.stdout.strip(),
    }


@dataclass
class Deployment:
    """API and worker processes of one model name; ``stack`` (the test helpers' type) holds them all."""

    stack: Stack
    base_urls: list[str]
    api_pids: list[int]
    worker_pids: list[int]


@contextlib.contextmanager
def deploy(
    redis_url: str, model_path: Path, log_dir: Path, apis: int = 1, workers: int = 1,
    worker_cmd: Sequence[str] = ("-m", "worker.main"), api_env: dict[str, str] | None = None,
    worker_env: dict[str, str] | None = None, api_cpus: str | None = None, worker_cpus: str | None = None,
) -> Iterator[Deployment]:
    """Start ``apis`` API pods and ``workers`` workers under a model name of their own; stop them on exit.
    ``api_cpus`` / ``worker_cpus`` (taskset lists, e.g. "0") pin those processes when taskset exists."""
    model_name = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "REDIS_URL": redis_url, "MODEL_PATH": str(model_path), "MODEL_NAME": model_name}
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []
    base_urls: list[str] = []

    def start(name: str, command: list[str], extra: dict[str, str], cpus: str | None) -> subprocess.Popen[bytes]:
        pin = ["taskset", "-c", cpus] if cpus is not None and shutil.which("taskset") else []
        with open(log_dir / f"{name}.log", "wb") as log:  # the child has its own copy of the descriptor
            proc = subprocess.Popen([*pin, *command], env={**env, **extra}, cwd=ROOT, stdout=log, stderr=log)
        processes.append(proc)
        return proc

    stack = Stack("", model_name, redis_url, env, processes)
    try:
        # one torch thread per worker (see the module docstring), unless the worker is told to place its threads
        threads = {} if "CPU_THREADS_BIND" in (worker_env or {}) else {"OMP_NUM_THREADS": "1"}
        worker_pids = [start(f"worker{i}", [sys.executable, *worker_cmd], {**threads, **(worker_env or {})},
                             worker_cpus).pid for i in range(workers)]
        api_pids = []
        for i in range(apis):
            port = free_port()
            api = start(f"api{i}", [sys.executable, "-m", "api.main"], {"PORT": str(port), **(api_env or {})}, api_cpus)
            api_pids.append(api.pid)  # taskset execs python: same pid
            base_urls.append(f"http://127.0.0.1:{port}")
        stack.base_url = base_urls[0]
        for url in base_urls:
            wait_healthy(url, processes)
        yield Deployment(stack, base_urls, api_pids, worker_pids)
    finally:
        stop_stack(stack)


# -- the measurements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The requests every path serves: the same prompts and lengths."""

    texts: list[str]
    prompt_ids: list[list[int]]  # what the API makes of each text: tokenized, the last prompt_tokens kept
    prompt_tokens: int
    new_tokens: int

    def bodies(self, details: bool) -> list[dict[str, Any]]:
        return [tgi_body(text, self.prompt_tokens, self.new_tokens, details) for text in self.texts]


def served(deployment: Deployment, route: str, workload: Workload, concurrency: int) -> dict[str, Any]:
    bodies = workload.bodies(details=route == COLLECT_ROUTE)
    records, wall = asyncio.run(run_level(
        deployment.base_urls, route, bodies, concurrency, REQUEST_TIMEOUT, expected_tokens=workload.new_tokens
    ))
    return summarize(records, wall)


def in_process(engine: TransformersEngine, workload: Workload, concurrency: int, time_limit: float) -> dict[str, Any]:
    """The same closed loop as the HTTP clients, on the engine's own step loop: a request is added as soon
    as a client's previous one finished, each token is timed when the step that made it returns."""
    records: dict[str, RequestRecord] = {}
    queue = iter(enumerate(workload.prompt_ids))
    active = 0
    started = time.perf_counter()
    while time.perf_counter() - started < time_limit:
        while active < concurrency and (item := next(queue, None)) is not None:
            index, prompt = item
            request_id = str(index)
            records[request_id] = RequestRecord(start=time.perf_counter())
            params = SamplingParams(seed=index, max_new_tokens=workload.new_tokens)
            engine.add(Job(request_id=request_id, model="bench", reply_channel="-", input_ids=prompt,
                           params=params, enqueued_at=time.time()))
            active += 1
        if engine.idle:
            break
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            record = records[output.job.request_id]
            if isinstance(output.event, ErrorEvent):
                record.error = output.event.message
            else:
                record.token_times.append(now)
                record.tokens += 1
            if output.finished:
                record.end = now
                active -= 1
    for request_id in list(records):  # cut by the time limit
        if engine.cancel(request_id):
            records[request_id].error = "cut by the level's time limit"
    return summarize(list(records.values()), time.perf_counter() - started)


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def runqueue_wait_seconds(pid: int) -> float:
    """Time the process's main thread (the API's event loop) was ready to run but waited for a core."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def peak_rss(pid: int) -> int:
    """Peak resident memory of a process so far (VmHWM), bytes."""
    return int(Path(f"/proc/{pid}/status").read_text().split("VmHWM:")[1].split()[0]) * 1024


def fanout_level(deployment: Deployment, texts: list[str], streams: int, tokens: int) -> dict[str, Any]:
    """``streams`` concurrent streams of ``tokens`` tokens each from the fake token source."""
    bodies = [tgi_body(texts[i % len(texts)], 8, tokens, details=False) for i in range(streams)]
    pids = {"api": deployment.api_pids[0], "worker": deployment.worker_pids[0], "client": os.getpid()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    waited = runqueue_wait_seconds(pids["api"])
    records, wall = asyncio.run(run_level(
        deployment.base_urls, STREAM_ROUTE, bodies, streams, REQUEST_TIMEOUT, stamped=True, expected_tokens=tokens
    ))
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    stats = summarize(records, wall)
    return {"streams": streams, **stats, **{f"{name}_cpu_percent": 100 * s / wall for name, s in used.items()},
            "api_cpu_us_per_token": 1e6 * used["api"] / max(1.0, stats["tokens_per_s"] * wall),
            "api_runqueue_wait_percent": 100 * (runqueue_wait_seconds(pids["api"]) - waited) / wall,
            "api_peak_rss_mib": peak_rss(pids["api"]) / 2**20}


def warm_up(deployment: Deployment, workload: Workload) -> None:
    """A few requests on every pod before measuring (first-call costs of torch, tokenizer, connections)."""
    small = Workload(workload.texts[:8], workload.prompt_ids[:8], workload.prompt_tokens, 8)
    for route in (STREAM_ROUTE, COLLECT_ROUTE):
        result = served(deployment, route, small, 4)
        if result["errors"]:
            raise RuntimeError(f"warm-up failed: {result['first_error']}")


def run_load(args: argparse.Namespace, redis_url: str, model: Path, workload: Workload,
             log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Sections 1 and 2: every level served (stream, then non-stream) then in-process, level by level."""
    torch.set_num_threads(1)
    engine = TransformersEngine.load(Settings(model_path=model))
    freeze_startup_heap()  # as a worker does after loading its model
    in_process(engine, Workload([], workload.prompt_ids[:8], workload.prompt_tokens, 8), 4, 60)  # warm-up
    results: dict[str, list[dict[str, Any]]] = {"stream": [], "non_stream": [], "in_process": []}
    with deploy(redis_url, model, log_dir / "load") as deployment:
        warm_up(deployment, workload)
        for level in args.concurrency:
            print(f"load: concurrency {level}", flush=True)
            results["stream"].append({"concurrency": level, **served(deployment, STREAM_ROUTE, workload, level)})
            results["non_stream"].append({"concurrency": level, **served(deployment, COLLECT_ROUTE, workload, level)})
            results["in_process"].append({"concurrency": level, **in_process(engine, workload, level, REQUEST_TIMEOUT)})
    return results


@contextlib.contextmanager
def confined(cpus: list[int]) -> Iterator[None]:
    """Run this process (the load generator) and the redis-server it started on ``cpus`` until exit, so
    that they do not take the API pod's core."""
    me = psutil.Process()
    processes = [me, *(child for child in me.children() if child.name() == "redis-server")]
    before = [process.cpu_affinity() for process in processes]
    for process in processes:
        process.cpu_affinity(cpus)
    try:
        yield
    finally:
        for process, affinity in zip(processes, before, strict=True):
            process.cpu_affinity(affinity)


def run_fanout(args: argparse.Namespace, redis_url: str, model: Path, texts: list[str],
               log_dir: Path) -> list[dict[str, Any]]:
    """Section 3: one API pod alone on core 0; the fake token worker, Redis and the load generator on the
    other cores; rising stream counts."""
    limits = {"MAX_LINK_NUM": str(FANOUT_LINKS), "MAX_QUEUE_SIZE": str(FANOUT_LINKS)}
    worker_cmd = (str(BENCH / "fake_token_worker.py"), "--interval-ms", str(args.fanout_interval_ms))
    others = list(range(1, os.cpu_count() or 1))
    results = []
    with deploy(redis_url, model, log_dir / "fanout", worker_cmd=worker_cmd, api_env=limits,
                worker_env={"MAX_BATCH_SIZE": str(FANOUT_LINKS)}, api_cpus="0",
                worker_cpus=",".join(map(str, others)) or None) as deployment, \
            confined(others) if others else contextlib.nullcontext():
        fanout_level(deployment, texts, 10, 10)  # warm-up
        for streams in args.fanout_streams:
            print(f"fan-out: {streams} streams", flush=True)
            results.append(fanout_level(deployment, texts, streams, args.fanout_tokens))
    return results


def run_scaleout(args: argparse.Namespace, redis_url: str, model: Path, workload: Workload,
                 log_dir: Path) -> list[dict[str, Any]]:
    """Section 4: the stream route at one concurrency, 1 API + 1 worker, then 2 + 2."""
    results = []
    for size in (1, 2):
        print(f"scale-out: {size} API + {size} worker", flush=True)
        with deploy(redis_url, model, log_dir / f"scaleout{size}", apis=size, workers=size) as deployment:
            warm_up(deployment, workload)
            result = served(deployment, STREAM_ROUTE, workload, args.scaleout_concurrency)
        results.append({"apis": size, "workers": size, "concurrency": args.scaleout_concurrency, **result})
    return results


# -- the report ------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _latency_cells(row: dict[str, Any], names: Sequence[str]) -> list[str]:
    return [_ms(row[f"{name}_{q}_ms"]) for name in names for q in ("p50", "p99")]


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def overhead(load: dict[str, list[dict[str, Any]]], new_tokens: int) -> list[dict[str, Any]]:
    """Served stream minus in-process engine, level by level (p50s; positive: the hop costs that much)."""
    rows = []
    for served_row, local in zip(load["stream"], load["in_process"], strict=True):
        added_e2e = served_row["e2e_p50_ms"] - local["e2e_p50_ms"]
        rows.append({
            "concurrency": served_row["concurrency"],
            "added_ttft_p50_ms": served_row["ttft_p50_ms"] - local["ttft_p50_ms"],
            "added_itl_p50_ms": served_row["itl_p50_ms"] - local["itl_p50_ms"],
            "added_e2e_p50_ms": added_e2e,
            "added_e2e_per_token_ms": added_e2e / new_tokens,
            "tokens_per_s_ratio": served_row["tokens_per_s"] / local["tokens_per_s"],
        })
    return rows


def targets(report: dict[str, Any]) -> list[str]:
    """Each target of issue #7 against what this run measured."""
    lines = []
    by_level = {row["concurrency"]: row for row in report.get("overhead", [])}
    if 1 in by_level:
        added = by_level[1]["added_e2e_p50_ms"]
        lines.append(f"- added latency per request (e2e p50, concurrency 1) < 2 ms: **{added:.2f} ms**, "
                     f"{'met' if added < 2 else 'NOT met'}")
    if 32 in by_level:
        ratio = by_level[32]["tokens_per_s_ratio"]
        lines.append(f"- served tokens/s at concurrency 32 >= 90% of the in-process engine's: **{100 * ratio:.0f}%**, "
                     f"{'met' if ratio >= 0.9 else 'NOT met'}")
    if "fanout" in report:
        held = [row["streams"] for row in report["fanout"]
                if not row["errors"] and row["itl_p99_ms"] is not None and row["itl_p99_ms"] < ITL_TARGET_MS]
        top = max(held, default=0)
        steady = max((row["streams"] for row in report["fanout"] if not row["errors"]
                      and row["steady_itl_p99_ms"] is not None and row["steady_itl_p99_ms"] < ITL_TARGET_MS), default=0)
        lines.append(f"- one API pod on one core holds 1000 streams with p99 inter-token latency "
                     f"< {ITL_TARGET_MS:g} ms: **held {top} streams** "
                     f"(largest level measured: {report['fanout'][-1]['streams']}; "
                     f"{steady} once all streams are open), {'met' if top >= 1000 else 'NOT met'}")
    return lines


def markdown(report: dict[str, Any]) -> str:
    config, facts = report["config"], report["machine"]
    lines = [
        "# Ferry serving benchmark", "",
        f"Command: `{config['command']}`", "",
        f"Machine: {facts['nproc']} cores ({facts['cpu_model']}), {facts['ram_gib']} GiB RAM, "
        f"Python {facts['python']}, torch {facts['torch']}, {facts['date']}, commit {facts['git_commit']}, "
        "load average at start "
        f"{' / '.join(str(x) for x in facts['load_average_at_start'])}.", "",
        f"Workload: tiny model (EOS off), prompts of {config['prompt_tokens']} tokens, {config['new_tokens']} new "
        f"tokens per request (greedy), {config['requests']} requests per level, closed-loop clients; workers "
        f"and the in-process engine use one torch thread. Latencies in ms.", "",
        "## Targets", "", *targets(report), "",
    ]
    latency_header = ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50", "e2e p99"]
    if "load" in report:
        rows = []
        for path, label in (("stream", "served `/generate_stream`"), ("non_stream", "served `/generate`"),
                            ("in_process", "in-process engine")):
            for row in report["load"][path]:
                rows.append([label, row["concurrency"], row["requests"], row["errors"], f"{row['requests_per_s']:.2f}",
                             f"{row['tokens_per_s']:.0f}", *_latency_cells(row, ("ttft", "itl", "e2e"))])
        lines += ["## Load (API -> Redis -> worker -> pub/sub -> API) and the in-process engine", "",
                  *_table(["path", "concurrency", "requests", "errors", "req/s", "tokens/s", *latency_header],
                          rows), "",
                  "## Overhead of the queue hop (served stream minus in-process engine, p50s)", "",
                  *_table(["concurrency", "added TTFT", "added ITL", "added e2e", "added e2e per token",
                           "served / in-process tokens/s"],
                          [[row["concurrency"], _ms(row["added_ttft_p50_ms"]), _ms(row["added_itl_p50_ms"]),
                            _ms(row["added_e2e_p50_ms"]), f"{row['added_e2e_per_token_ms']:.2f}",
                            f"{100 * row['tokens_per_s_ratio']:.0f}%"] for row in report["overhead"]]), ""]
    if "fanout" in report:
        lines += [f"## Fan-out: one API pod on one core, fake token source (one token per stream every "
                  f"{config['fanout_interval_ms']:g} ms, {config['fanout_tokens']} tokens per stream)", "",
                  "The API pod is pinned to core 0 (taskset); the fake token worker, Redis and the load generator "
                  "run on the other cores. Relay lag: from the fake worker's `time.time()` at emission (the token's "
                  "text) to the client's arrival. API CPU µs per token: the pod's CPU time over the tokens it "
                  "relayed (request handling included). API waiting for a core: time its event loop was runnable "
                  "but not running (/proc schedstat). Steady ITL: only the gaps after every stream of the level "
                  "has its first token (all streams open at once; this leaves out the burst of opening them).", "",
                  *_table(["streams", "errors", "tokens/s relayed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                           "steady ITL p50", "steady ITL p99", "relay lag p50", "relay lag p99",
                           "API CPU % of a core", "API CPU µs per token",
                           "API waiting for a core %",
                           "API peak RSS MiB",
                           "fake worker CPU %", "client CPU %"],
                          [[row["streams"], row["errors"], f"{row['tokens_per_s']:.0f}",
                            *_latency_cells(row, ("ttft", "itl", "steady_itl", "relay_lag")),
                            f"{row['api_cpu_percent']:.0f}",
                            f"{row['api_cpu_us_per_token']:.0f}", f"{row['api_runqueue_wait_percent']:.0f}",
                            f"{row['api_peak_rss_mib']:.0f}", f"{row['worker_cpu_percent']:.0f}",
                            f"{row['client_cpu_percent']:.0f}"]
                           for row in report["fanout"]]), ""]
    if "scaleout" in report:
        lines += ["## Scale-out (`/generate_stream`)", "",
                  *_table(["API pods", "workers", "concurrency", "errors", "req/s", "tokens/s", *latency_header],
                          [[row["apis"], row["workers"], row["concurrency"], row["errors"],
                            f"{row['requests_per_s']:.2f}", f"{row['tokens_per_s']:.0f}",
                            *_latency_cells(row, ("ttft", "itl", "e2e"))] for row in report["scaleout"]]), ""]
    errors = [(section, row.get("concurrency", row.get("streams")), row["first_error"])
              for section in ("fanout", "scaleout") for row in report.get(section, []) if row["first_error"]]
    errors += [(f"load {path}", row["concurrency"], row["first_error"])
               for path, rows in report.get("load", {}).items() for row in rows if row["first_error"]]
    if errors:
        lines += ["## First error of each level that had errors", "",
                  *(f"- {section} @ {level}: {message}" for section, level, message in errors), ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s and TTFT against concurrency, served and in-process."""
    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = [row["concurrency"] for row in report["load"]["stream"]]
    for (key, label), color in zip((("stream", "served /generate_stream"), ("non_stream", "served /generate"),
                                    ("in_process", "in-process engine")), ("C0", "C1", "C2"), strict=True):
        rows = report["load"][key]
        rate.plot(levels, [row["tokens_per_s"] for row in rows], marker="o", color=color, label=label)
        if key != "non_stream":
            ttft.plot(levels, [row["ttft_p50_ms"] for row in rows], marker="o", color=color, label=f"{label} p50")
            ttft.plot(levels, [row["ttft_p99_ms"] for row in rows], marker="x", color=color, linestyle="--",
                      label=f"{label} p99")
    for axis, title, unit in ((rate, "generated tokens/s", "tokens/s"), (ttft, "time to first token", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set_xlabel("concurrency")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    ttft.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=["load", "fanout", "scaleout"],
                        default=["load", "fanout", "scaleout"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128], help="load levels")
    parser.add_argument("--requests", type=int, default=128, help="requests per load level")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--fanout-streams", type=int, nargs="+", default=[100, 250, 500, 1000])
    parser.add_argument("--fanout-tokens", type=int, default=200, help="tokens per fan-out stream")
    parser.add_argument("--fanout-interval-ms", type=float, default=25.0, help="fake source: ms between tokens")
    parser.add_argument("--scaleout-concurrency", type=int, default=64)
    parser.add_argument("--redis-url", help="use this Redis (default: start a redis-server on a free port)")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    report: dict[str, Any] = {
        "config": {"command": " ".join([".venv/bin/python", "bench/serve_bench.py", *sys.argv[1:]]),
                   **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
        "machine": machine_facts(),
    }
    started = time.monotonic()
    redis_cm = contextlib.nullcontext(args.redis_url) if args.redis_url else embedded_redis("redis-server")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as scratch, redis_cm as redis_url:
        model = model_without_eos(ensure_tiny_model(default_model_dir()), Path(scratch) / "tiny-llama-no-eos")
        tokenizer = AutoTokenizer.from_pretrained(model)
        texts = prompt_texts(tokenizer, args.requests, args.prompt_tokens)
        prompt_ids = [tokenizer(text)["input_ids"][-args.prompt_tokens:] for text in texts]
        workload = Workload(texts, prompt_ids, args.prompt_tokens, args.new_tokens)
        if "load" in args.sections:
            report["load"] = run_load(args, redis_url, model, workload, log_dir)
            report["overhead"] = overhead(report["load"], args.new_tokens)
        if "fanout" in args.sections:
            report["fanout"] = run_fanout(args, redis_url, model, texts, log_dir)
        if "scaleout" in args.sections:
            report["scaleout"] = run_scaleout(args, redis_url, model, workload, log_dir)
    report["duration_s"] = time.monotonic() - started

    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "report.md").write_text(text)
    if "load" in report:
        plot(report, args.out / "serving.png")
    print(text)
    print(f"\nwrote {args.out}/report.md, report.json" + (", serving.png" if "load" in report else "")
          + f" in {report['duration_s']:.0f} s")


if __name__ == "__main__":
    main()
