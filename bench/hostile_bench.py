"""Hostile-traffic benchmark of Ferry: "no request may hurt another", measured.

``.venv/bin/python bench/hostile_bench.py [--help]`` starts its own redis-server on a free loopback port, one
``ferry-api`` and one ``ferry-worker`` (built-in engine, CPU, threads and torch.compile left at the project's
defaults) serving a tiny model made locally: the tiny LLaVA-style vision-language model of
``ferry-tiny-model --kind vlm`` (it serves text requests too, so image requests can join the hostile mix), or
the tiny text model (``--model text``, or ``auto`` when the VLM cannot be served; image bombs are then skipped).

Each round runs one VICTIM workload twice: "quiet" (victims alone) and "hostile" (the same victims while
hostile clients run beside them), the order alternating over rounds so that drift shows as spread. The
victims look like real traffic: ``--victims`` closed-loop streaming clients on TGI's ``/generate_stream`` (or
OpenAI's streamed ``/v1/completions``), prompts of a seeded triangular length distribution (8 to ~600 words of
the tiny model's corpus, some sharing a long prefix), greedy, ``max_new_tokens`` drawn from 16..128; per
request the time to first token and every inter-token gap are recorded, and any error is a victim failure.

The hostile clients run in a process of their own (so that their parsing never delays a victim's clock), all
on 127.0.0.1, each bounded by a request count and the side's time limit, and all stop when the victims are done:

1. poisoners: sampling parameters at float edges (5e-324, 1e-46, 1e-300, 1e-320, 1e308) on TGI ``/generate``,
   OpenAI ``/v1/completions`` and KServe ``/v2/models/<m>/generate``: expected 4xx, a 5xx is a defect;
2. image bombs: a 12000 x 12000 black PNG (17 KB, 432 MB decoded) as a file item on TGI ``/generate`` and
   OpenAI chat, again and again;
3. quitters: streams closed after 1-3 tokens, again and again;
4. a flood of ``GET /health/timed`` (waves of 100 at once) and requests carrying a 1 MB header;
5. bursts past maxQueueSize (the stack runs with ``MAX_QUEUE_SIZE`` 64): their 429s are counted. A burst fills
   the queue for a moment, so any request that arrives then, a victim's too, is refused as the queue bound
   says (429 on TGI routes, 503 ``overloaded`` on OpenAI and KServe routes): the report counts these "queue
   full" refusals apart from other failures, and never as a server error.

A 5xx other than that queue-full 503 is a defect; so is a Ferry process that exits. ``--hostile`` runs a
subset of the clients, to tell which one costs the victims what.

``--ferry-root PATH`` drives another checkout's processes (cwd and PYTHONPATH = PATH) for a before/after
comparison: the script uses only the HTTP API, the env vars of README's configuration table and the job
streams' Redis keys (to wait until the queue is drained between sides); models, Redis and clients are this
checkout's. Writes ``hostile.md`` and ``hostile.json`` to ``--out`` (default bench/out/).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from common.process import child_process, stop_processes  # noqa: E402
from loadgen import COMPLETIONS_ROUTE, STREAM_ROUTE, run_level, summarize  # noqa: E402
from worker.tiny_model import ensure_tiny_model, make_tiny_vlm  # noqa: E402

CORPUS = ROOT / "worker" / "data" / "corpus.txt"
BOMB_NAME = "bomb.png"
HEADER_BYTES = 1 << 20  # the big header's value: 1 MB
# Pauses between one hostile client's requests (or waves): with the default counts each kind keeps going for
# about two minutes, longer than a hostile side lasts, and then stops by itself.
POISON_INTERVAL, BOMB_INTERVAL, QUITTER_INTERVAL, HEALTH_INTERVAL, BURST_INTERVAL = 0.1, 0.5, 0.25, 3.0, 15.0
SHED = "503 overloaded"  # the queue-full answer of the KServe and OpenAI routes (TGI's is 429)
STOP_GRACE_SECONDS = 30.0
SETTLE_SECONDS = 60.0  # the most one wait for a drained queue takes between sides
START_SECONDS = 300.0  # a worker compiling on 2 cores takes 30-70 s; a cold Inductor cache twice that
# Variables the bench's processes must not inherit from the caller's shell: the config file, and the threading
# and compile settings the task wants at the project's defaults. --env sets any setting explicitly.
SCRUBBED_ENV = ("FERRY_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CPU_THREADS_BIND", "COMPILE_MODEL",
                "MAX_BATCH_SIZE", "API_KEYS", "REDIS_URL", "MODEL_CONFIG")


# -- the stack -------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the API pod binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_tiny_vlm(folder: Path) -> Path:
    """The tiny VLM, made once and kept (``make_tiny_vlm`` writes the folder atomically)."""
    if not (folder / "processor_config.json").exists() or not (folder / "model.safetensors").exists():
        make_tiny_vlm(folder)
    return folder


@dataclass
class Stack:
    """One API pod and one worker of one model name on the bench's Redis."""

    base_url: str
    model_name: str
    redis_url: str
    processes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path

    def exited(self) -> dict[str, int]:
        """Processes that are gone, and their exit status: a worker that died under hostile load is a defect."""
        return {name: proc.returncode for name, proc in self.processes.items() if proc.poll() is not None}

    def peak_rss_mib(self) -> dict[str, float | None]:
        """Each process's peak resident memory so far (VmHWM): an image decoded in full shows here."""
        peaks: dict[str, float | None] = {}
        for name, proc in self.processes.items():
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peaks[name] = int(status.split("VmHWM:")[1].split()[0]) / 1024
            except (OSError, IndexError):
                peaks[name] = None
        return peaks


def wait_healthy(stack: Stack, timeout: float) -> None:
    """Until ``GET /health`` is 200 (the pod serves and a worker is alive); fail at once if a process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone := stack.exited():
            raise RuntimeError(f"{gone} exited before the stack was healthy; logs in {stack.log_dir}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{stack.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{stack.base_url} was not healthy within {timeout:.0f} s; logs in {stack.log_dir}")


@contextlib.contextmanager
def start_stack(ferry_root: Path, redis_url: str, model: Path, log_dir: Path,
                extra_env: dict[str, str]) -> Iterator[Stack]:
    """``python -m worker.main`` and ``python -m api.main`` of ``ferry_root`` (cwd and PYTHONPATH), configured
    by env vars only, under a model name of their own; both stopped (SIGTERM, then SIGKILL) on exit."""
    model_name = f"hostile-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED_ENV}
    env.update({"PYTHONPATH": str(ferry_root), "REDIS_URL": redis_url, "MODEL_PATH": str(model),
                "MODEL_NAME": model_name, "PORT": str(port), "HOST": "127.0.0.1", **extra_env})
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    for name, module in (("worker", "worker.main"), ("api", "api.main")):
        with open(log_dir / f"{name}.log", "wb") as log:  # the child has its own copy of the descriptor
            processes[name] = child_process([sys.executable, "-m", module], env=env, cwd=ferry_root,
                                            stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(f"http://127.0.0.1:{port}", model_name, redis_url, processes, log_dir)
    try:
        wait_healthy(stack, START_SECONDS)
        yield stack
    finally:
        stop_processes(list(processes.values()), STOP_GRACE_SECONDS)


def queue_busy(client: redis.Redis, model: str) -> bool:
    """Whether any job of ``model`` is still queued or running, read from its job streams (``ferry:{m}:jobs``
    and the priority streams): a consumer-group entry pending (taken, not acknowledged) or not yet delivered.
    This holds whether or not a checkout deletes acknowledged entries."""
    for key in client.scan_iter(match=f"ferry:{{{model}}}:jobs*", _type="stream"):
        groups = client.xinfo_groups(key)
        if not groups:
            if client.xlen(key):
                return True
            continue
        for group in groups:
            if group["pending"]:
                return True
            last = group["last-delivered-id"]
            last = last.decode() if isinstance(last, bytes) else last
            if client.xrange(key, min=f"({last}", count=1):
                return True
    return False


def settle(stack: Stack, timeout: float = SETTLE_SECONDS) -> float:
    """Wait until the previous side's work is gone (cancelled quitters included) and the stack is healthy, so
    that no side pays for the one before; returns the seconds waited."""
    started = time.monotonic()
    client = redis.Redis.from_url(stack.redis_url)
    try:
        while time.monotonic() - started < timeout and queue_busy(client, stack.model_name):
            time.sleep(0.2)
    finally:
        client.close()
    wait_healthy(stack, timeout)
    time.sleep(1.0)  # the worker's last steps and the pod's last writes
    return time.monotonic() - started


# -- the victims -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VictimSpec:
    """The shape of the victims' traffic (``--victim-*`` options)."""

    clients: int
    requests: int
    route: str
    seed: int
    min_words: int
    mode_words: int
    max_words: int
    min_new: int
    max_new: int
    shared_every: int
    shared_words: int
    max_prompt_tokens: int


def corpus_words() -> list[str]:
    return CORPUS.read_text(encoding="utf-8").split()


def victim_prompts(spec: VictimSpec, words: list[str], count_tokens: Callable[[str], int]) -> list[tuple[str, int]]:
    """Seeded (prompt, max_new_tokens) pairs: word runs from the corpus of triangular lengths; every
    ``shared_every``-th one opens with the same ``shared_words``-word prefix (a system prompt many requests
    share). A prompt is cut to ``max_prompt_tokens`` so that prompt + output stays inside the context."""
    rng = random.Random(spec.seed)
    start = rng.randrange(len(words) - spec.shared_words)
    shared = " ".join(words[start:start + spec.shared_words])
    pairs = []
    for index in range(spec.requests):
        length = round(rng.triangular(spec.min_words, spec.max_words, spec.mode_words))
        start = rng.randrange(len(words) - length)
        text = " ".join(words[start:start + length])
        if spec.shared_every and index % spec.shared_every == 0:
            text = f"{shared}\n\n{text}"
        while count_tokens(text) > spec.max_prompt_tokens:
            text = text[: int(len(text) * 0.9)]
        pairs.append((text, rng.randint(spec.min_new, spec.max_new)))
    return pairs


def victim_bodies(spec: VictimSpec, prompts: list[tuple[str, int]], model_name: str) -> list[dict[str, Any]]:
    """Greedy requests (both sides get the same tokens; a failure shows as an error, not as other text)."""
    if spec.route == COMPLETIONS_ROUTE:
        return [{"model": model_name, "prompt": text, "max_tokens": new, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}} for text, new in prompts]
    return [{"inputs": text, "parameters": {"max_new_tokens": new}} for text, new in prompts]


def failure_kind(error: str) -> str:
    """A victim error's class for the report: its HTTP status, ``stream error`` or the exception's name."""
    if error.startswith("HTTP "):
        code = error.split(":", 1)[0].removeprefix("HTTP ")
        return SHED if code == "503" and "overloaded" in error else code
    if error.startswith("stream error"):
        return "stream error"
    return error.split(":", 1)[0]


def run_victims(stack: Stack, spec: VictimSpec, bodies: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    """The victim workload once: closed-loop clients (bench/loadgen.py), summarized."""
    records, wall = asyncio.run(run_level([stack.base_url], spec.route, bodies, spec.clients, timeout))
    stats = summarize(records, wall)
    kinds = collections.Counter(failure_kind(r.error) for r in records if r.error is not None)
    errors = [r.error for r in records if r.error is not None]
    stats.update({
        "failures": len(errors),
        "failures_shed": kinds.get("429", 0) + kinds.get(SHED, 0),  # refused while the queue was full
        "failure_kinds": dict(kinds),
        "failure_samples": errors[:5],
        "tokens": sum(r.tokens for r in records if r.error is None),
    })
    return stats


# -- the hostile clients (a process of their own) --------------------------------------------------


HOSTILE_KINDS = ("poisoners", "bombs", "quitters", "health", "bursts")


@dataclass(frozen=True)
class HostileSpec:
    """What the hostile process sends; every count is a bound, ``time_limit`` bounds the whole side."""

    base_url: str
    model_name: str
    bomb_item: str | None  # the bomb's name inside MULTIMODAL_INPUT_DIR; None: image bombs skipped
    poison_limit: int
    poison_interval: float
    bombs: int
    bomb_interval: float
    quitters: int
    quitter_clients: int
    quitter_interval: float
    health_waves: int
    health_flood: int
    health_interval: float
    big_headers: int
    burst_waves: int
    burst: int
    burst_tokens: int
    burst_interval: float
    time_limit: float
    request_timeout: float
    prompt: str
    kinds: tuple[str, ...] = HOSTILE_KINDS


# (case, parameters in TGI's names); each route sends the cases it has fields for.
POISON_CASES: list[tuple[str, dict[str, Any]]] = [
    ("repetition_penalty=5e-324", {"repetition_penalty": 5e-324}),
    ("repetition_penalty=1e-46", {"repetition_penalty": 1e-46}),
    ("repetition_penalty=1e308", {"repetition_penalty": 1e308}),
    ("temperature=1e-300, sampling", {"temperature": 1e-300, "do_sample": True}),
    ("temperature=1e308, sampling", {"temperature": 1e308, "do_sample": True}),
    ("top_p=1e-320, sampling", {"top_p": 1e-320, "do_sample": True}),
    ("typical_p=5e-324, sampling", {"typical_p": 5e-324, "do_sample": True}),
]
# Poisoned requests a 200 is the documented answer to: the value is in range and harmless there.
ACCEPTED_BY_DESIGN = {
    "OpenAI /v1/completions temperature=1e-300, sampling": "OpenAI's temperature below 1e-5 is greedy (vLLM's rule)",
}


def poison_requests(spec: HostileSpec) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of every poisoned request: TGI takes every case; OpenAI has no ``do_sample``
    (temperature > 0 samples) and no ``typical_p``; Triton's generate extension has no ``typical_p`` (it would
    be ignored, not refused, so it is not sent)."""
    prompt = spec.prompt
    requests = []
    for case, params in POISON_CASES:
        requests.append((f"TGI /generate {case}", "/generate",
                         {"inputs": prompt, "parameters": {"max_new_tokens": 8, **params}}))
        if "typical_p" not in params:
            openai = {k: v for k, v in params.items() if k != "do_sample"}
            requests.append((f"OpenAI /v1/completions {case}", "/v1/completions",
                             {"model": spec.model_name, "prompt": prompt, "max_tokens": 8, **openai}))
            requests.append((f"KServe generate {case}", f"/v2/models/{spec.model_name}/generate",
                             {"text_input": prompt, "parameters": {"max_tokens": 8, **params}}))
    return requests


class Tally:
    """Status codes per hostile client kind and, within a kind, per request case (poisoners: route and value;
    image bombs: route), and the first answers of every 5xx."""

    def __init__(self) -> None:
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.by_case: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(
            lambda: collections.defaultdict(collections.Counter))
        self.server_errors: list[dict[str, str]] = []
        self.samples: dict[str, str] = {}  # "kind status" -> the first answer's body: why it was refused
        self.extra: collections.Counter[str] = collections.Counter()

    def count(self, kind: str, status: str, case: str | None = None, body: str = "") -> None:
        self.by_kind[kind][status] += 1
        self.samples.setdefault(f"{kind} {status}", body[:300])
        if case is not None:
            self.by_case[kind][case][status] += 1
        if server_error(status) and len(self.server_errors) < 20:
            self.server_errors.append({"kind": kind, "case": case or "", "status": status, "body": body[:300]})

    def as_dict(self) -> dict[str, Any]:
        return {"by_kind": {k: dict(v) for k, v in self.by_kind.items()},
                "by_case": {k: {case: dict(c) for case, c in v.items()} for k, v in self.by_case.items()},
                "server_errors": self.server_errors, "samples": self.samples, "extra": dict(self.extra)}


def status_label(code: int, body: str) -> str:
    """The status as the report counts it: a 503 whose body says ``overloaded`` is the documented queue-full
    answer of KServe and OpenAI routes (load shedding, like TGI's 429), not a server error."""
    return SHED if code == 503 and "overloaded" in body else str(code)


def server_error(status: str) -> bool:
    """A 5xx other than load shedding: a defect to report."""
    return status.startswith("5") and status != SHED


def _outcome(exc: BaseException) -> str:
    """A transport failure as a status-like label (the report shows it beside the codes)."""
    return f"exc:{type(exc).__name__}"


class Hostile:
    """The hostile clients of one side, as asyncio tasks sharing one HTTP client (loopback only)."""

    def __init__(self, spec: HostileSpec, stop: Any) -> None:
        self.spec = spec
        self.stop = stop  # a multiprocessing.Event: set when the victims are done
        self.deadline = time.monotonic() + spec.time_limit
        self.tally = Tally()
        self.client: httpx.AsyncClient | None = None

    def over(self) -> bool:
        return self.stop.is_set() or time.monotonic() > self.deadline

    async def pause(self, seconds: float) -> None:
        """Sleep, waking early when the side is over."""
        end = time.monotonic() + seconds
        while not self.over() and time.monotonic() < end:
            await asyncio.sleep(min(0.1, end - time.monotonic()))

    async def request(self, kind: str, method: str, path: str, case: str | None = None, **kwargs: Any) -> str:
        assert self.client is not None
        try:
            response = await self.client.request(method, self.spec.base_url + path, **kwargs)
        except httpx.HTTPError as exc:
            status = _outcome(exc)
            self.tally.count(kind, status, case)
            return status
        status = status_label(response.status_code, response.text)
        self.tally.count(kind, status, case, response.text)
        return status

    async def poisoners(self) -> None:
        """Every poisoned request in turn, paced, until the bound; each is expected to be a 4xx."""
        requests = poison_requests(self.spec)
        for index in range(self.spec.poison_limit):
            label, path, body = requests[index % len(requests)]
            await self.request("poisoner", "POST", path, case=label, json=body)
            await self.pause(self.spec.poison_interval)
            if self.over():
                return

    async def bombs(self) -> None:
        """The 12000 x 12000 PNG as a file item, on TGI's list input and OpenAI chat's image part."""
        item = self.spec.bomb_item
        if item is None:
            return
        tgi = {"inputs": [{"type": "text", "text": "Describe this picture:"}, {"type": "image_url", "image_url": item}],
               "parameters": {"max_new_tokens": 8}}
        chat = {"model": self.spec.model_name, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture:"}, {"type": "image_url", "image_url": {"url": item}}]}]}
        for index in range(self.spec.bombs):
            if index % 2 == 0:
                await self.request("image bomb", "POST", "/generate", case="TGI /generate", json=tgi)
            else:
                await self.request("image bomb", "POST", "/v1/chat/completions", case="OpenAI chat", json=chat)
            await self.pause(self.spec.bomb_interval)
            if self.over():
                return

    async def quitter(self, index: int, count: int) -> None:
        """Streams of up to 128 tokens closed after 1-3 token events: the worker should stop computing them."""
        assert self.client is not None
        rng = random.Random(index)
        body = {"inputs": self.spec.prompt, "parameters": {"max_new_tokens": 128}}
        for _ in range(count):
            wanted = rng.randint(1, 3)
            try:
                async with self.client.stream("POST", self.spec.base_url + STREAM_ROUTE, json=body) as response:
                    seen = 0
                    if response.status_code == 200:
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                seen += 1
                                if seen >= wanted:
                                    break  # leaving the block closes the connection mid-stream
                    else:
                        await response.aread()
                answer = response.text if response.status_code != 200 else ""
                self.tally.count("quitter", status_label(response.status_code, answer), body=answer)
                self.tally.extra["quitter tokens read"] += seen
            except httpx.HTTPError as exc:
                self.tally.count("quitter", _outcome(exc))
            await self.pause(self.spec.quitter_interval)
            if self.over():
                return

    async def quitters(self) -> None:
        clients = max(1, self.spec.quitter_clients)
        share = [self.spec.quitters // clients + (i < self.spec.quitters % clients) for i in range(clients)]
        await asyncio.gather(*(self.quitter(i, n) for i, n in enumerate(share) if n))

    async def health_flood(self) -> None:
        """Waves of concurrent ``GET /health/timed``, each with requests whose one header takes 1 MB."""
        big = {"x-hostile-padding": "a" * HEADER_BYTES}
        body = {"inputs": self.spec.prompt, "parameters": {"max_new_tokens": 4}}
        for _ in range(self.spec.health_waves):
            await asyncio.gather(
                *(self.request("health/timed flood", "GET", "/health/timed") for _ in range(self.spec.health_flood)),
                *(self.request("1 MB header", "POST", "/generate", json=body, headers=big)
                  for _ in range(self.spec.big_headers)),
            )
            await self.pause(self.spec.health_interval)
            if self.over():
                return

    async def bursts(self) -> None:
        """Waves of short requests past maxQueueSize, all at once: the ones past it are expected 429s. Each
        generates ``burst_tokens`` tokens, so that the admitted ones are still in flight when the rest arrive."""
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": self.spec.burst_tokens}}
        await self.pause(1.0)  # the victims are in flight first
        for _ in range(self.spec.burst_waves):
            await asyncio.gather(*(self.request("burst", "POST", "/generate", json=body)
                                   for _ in range(self.spec.burst)))
            await self.pause(self.spec.burst_interval)
            if self.over():
                return

    async def run(self) -> dict[str, Any]:
        connections = self.spec.burst + self.spec.health_flood + self.spec.big_headers + self.spec.quitter_clients + 8
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        timeout = httpx.Timeout(self.spec.request_timeout)
        started = time.monotonic()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as self.client:
            clients = {"poisoners": self.poisoners, "bombs": self.bombs, "quitters": self.quitters,
                       "health": self.health_flood, "bursts": self.bursts}
            tasks = [asyncio.create_task(clients[kind]()) for kind in self.spec.kinds]
            _, pending = await asyncio.wait(tasks, timeout=self.spec.time_limit + self.spec.request_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return {**self.tally.as_dict(), "seconds": time.monotonic() - started}


def hostile_process(spec: HostileSpec, stop: Any, results: Any) -> None:
    """Entry point of the hostile process: says it is ready, runs the clients, sends their tally."""
    results.put("ready")
    try:
        results.put(asyncio.run(Hostile(spec, stop).run()))
    except BaseException as exc:  # the main process reports it instead of waiting for a tally
        results.put({"crashed": f"{type(exc).__name__}: {exc}"})


def run_side(side: str, stack: Stack, spec: VictimSpec, bodies: list[dict[str, Any]],
             hostile: HostileSpec, timeout: float) -> dict[str, Any]:
    """One side: the victims alone ("quiet") or beside the hostile process ("hostile")."""
    waited = settle(stack)
    if side == "quiet":
        result: dict[str, Any] = {"victims": run_victims(stack, spec, bodies, timeout)}
    else:
        result = {"victims": None, "hostile": {"crashed": "no tally from the hostile process in time"}}
        context = multiprocessing.get_context("spawn")  # no inherited locks, threads or event loops
        stop, results = context.Event(), context.Queue()
        proc = context.Process(target=hostile_process, args=(hostile, stop, results), daemon=True)
        proc.start()
        try:
            if results.get(timeout=60) != "ready":
                raise RuntimeError("the hostile process did not start")
            result["victims"] = run_victims(stack, spec, bodies, timeout)
            stop.set()
            result["hostile"] = results.get(timeout=hostile.request_timeout + 60)
        except queue.Empty:
            pass  # reported as the hostile process's failure
        finally:
            stop.set()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    result["settle_s"] = waited
    result["exited"] = stack.exited()
    return result


# -- the report ------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{status}: {n}" for status, n in sorted(counter.items())) or "–"


def ratios(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hostile over quiet, per round, of the victims' numbers (tok/s below 1 and latencies above 1 hurt)."""
    rows = []
    for number, sides in enumerate(rounds, 1):
        quiet, hostile = (sides.get(name, {}).get("victims") for name in ("quiet", "hostile"))
        if not quiet or not hostile:
            continue
        rows.append({"round": number,
                     "tokens_per_s": _ratio(hostile["tokens_per_s"], quiet["tokens_per_s"]),
                     "itl_p99": _ratio(hostile["itl_p99_ms"], quiet["itl_p99_ms"]),
                     "ttft_p99": _ratio(hostile["ttft_p99_ms"], quiet["ttft_p99_ms"]),
                     "failures": (quiet["failures"], hostile["failures"])})
    return rows


def merged_tally(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The hostile clients' counts over every hostile side."""
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_case: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter))
    errors, crashes, extra, samples = [], [], collections.Counter(), {}
    for sides in rounds:
        tally = sides.get("hostile", {}).get("hostile") or {}
        if "crashed" in tally:
            crashes.append(tally["crashed"])
            continue
        for kind, counts in tally.get("by_kind", {}).items():
            by_kind[kind].update(counts)
        for kind, cases in tally.get("by_case", {}).items():
            for case, counts in cases.items():
                by_case[kind][case].update(counts)
        errors += tally.get("server_errors", [])
        for key, body in tally.get("samples", {}).items():
            samples.setdefault(key, body)
        extra.update(tally.get("extra", {}))
    return {"by_kind": {k: dict(v) for k, v in by_kind.items()},
            "by_case": {k: {case: dict(c) for case, c in v.items()} for k, v in by_case.items()},
            "server_errors": errors, "samples": samples, "crashes": crashes, "extra": dict(extra)}


EXPECTED = {  # what a hostile request should get; anything else is listed in the findings
    "poisoner": "4xx", "image bomb": "4xx", "1 MB header": "431", "health/timed flood": "200",
    "burst": "200 or 429", "quitter": "200 or 429",  # a quitter arriving while a burst fills the queue: 429
}


def _unexpected(kind: str, status: str) -> bool:
    """Whether ``status`` is not what ``kind`` should get; load shedding (429, 503 overloaded) is allowed to any
    request: it hurts nobody else."""
    if status in ("429", SHED):
        return False
    want = EXPECTED.get(kind, "")
    if want == "4xx":
        return not status.startswith("4")
    return status not in want.split(" or ")


def findings(report: dict[str, Any]) -> list[str]:
    """What the run says against "no request may hurt another", one line each: 5xx (defects), hostile
    requests answered otherwise than expected (a poison or bomb accepted, a dropped connection), victim
    failures and Ferry processes that exited."""
    tally = report["hostile_totals"]
    server_total = sum(n for counts in tally["by_kind"].values() for s, n in counts.items() if server_error(s))
    shed_total = sum(n for counts in tally["by_kind"].values() for s, n in counts.items() if s in ("429", SHED))
    victim_total = sum((result.get("victims") or {}).get("failures", 0)
                       for sides in report["rounds"] for result in sides.values())
    exits = sum(bool(result.get("exited")) for sides in report["rounds"] for result in sides.values())
    lines = [f"- hostile requests answered 5xx: **{server_total}** (load shedding, 429 or 503 overloaded, apart: "
             f"{shed_total}); victim failures: **{victim_total}**; sides after which a Ferry process had exited: "
             f"**{exits}**"]
    for kind, counts in tally["by_kind"].items():
        server = {s: n for s, n in counts.items() if server_error(s)}
        if server:
            note = (" (the route's `unhealthy` answer: its probe got no token in time under this load)"
                    if kind == "health/timed flood" else "")
            lines.append(f"- **DEFECT**: {kind}: {_counts(server)}{note}")
        other = {s: n for s, n in counts.items() if not server_error(s) and _unexpected(kind, s)}
        if other and kind not in tally["by_case"]:  # poisoners and bombs: judged per case below
            first = tally.get("samples", {}).get(f"{kind} {next(iter(other))}", "")
            lines.append(f"- {kind}: expected {EXPECTED.get(kind, '?')}, also got {_counts(other)}"
                         + (f"; first answer: `{first[:200]}`" if first else ""))
    lines += _case_findings(tally)
    for crash in tally["crashes"]:
        lines.append(f"- the hostile process failed: {crash}")
    lines += _round_findings(report)
    if len(lines) == 1:
        lines.append("- every hostile request was answered as expected")
    return lines


def _case_findings(tally: dict[str, Any]) -> list[str]:
    """The poisoners' and bombs' cases answered otherwise than expected, one line each."""
    lines = []
    for kind, cases in tally["by_case"].items():
        for case, counts in sorted(cases.items()):
            other = {s: n for s, n in counts.items() if not server_error(s) and _unexpected(kind, s)}
            if not other:
                continue
            if set(other) == {"200"} and case in ACCEPTED_BY_DESIGN:
                lines.append(f"- {kind} `{case}`: 200 {other['200']} times, by design: {ACCEPTED_BY_DESIGN[case]}")
            else:
                lines.append(f"- {kind} `{case}`: expected {EXPECTED[kind]}, got {_counts(other)}"
                             + (" (accepted: the server ran it)" if "200" in other else ""))
    return lines


def _round_findings(report: dict[str, Any]) -> list[str]:
    """Per round and side: Ferry processes that exited, victim failures."""
    lines = []
    for number, sides in enumerate(report["rounds"], 1):
        for side, result in sides.items():
            if result.get("exited"):
                lines.append(f"- **DEFECT**: round {number} {side}: Ferry processes exited: {result['exited']}")
            victims = result.get("victims") or {}
            if victims.get("failures"):
                lines.append(f"- round {number} {side}: {victims['failures']} victim failures "
                             f"({_counts(victims['failure_kinds'])}); first: {victims['failure_samples'][0][:200]}")
    return lines


def markdown(report: dict[str, Any]) -> str:
    config, facts, tally = report["config"], report["machine"], report["hostile_totals"]
    victim = config["victim"]
    lines = [
        "# Ferry hostile-traffic benchmark: no request may hurt another", "",
        f"Command: `{config['command']}`", "",
        f"Ferry processes from `{config['ferry_root']}` (commit {facts['ferry_commit']}); model: "
        f"{report['model_kind']}{'' if report['images'] else ' (image bombs skipped: ' + report['images_note'] + ')'}; "
        f"stack: 1 API pod + 1 worker, MAX_QUEUE_SIZE {config['max_queue_size']}.", "",
        f"Machine: {facts['nproc']} cores ({facts['cpu_model']}), Python {facts['python']}, {facts['date']}, "
        f"load average at start {' / '.join(str(x) for x in facts['load_average_at_start'])}; "
        f"run took {report.get('duration_s', 0):.0f} s.", "",
        f"Victims: {victim['clients']} closed-loop streaming clients on `{victim['route']}`, {victim['requests']} "
        f"requests per side (seed {victim['seed']}): prompts of {victim['min_words']}-{victim['max_words']} words "
        f"(triangular, mode {victim['mode_words']}; every {victim['shared_every']}th opens with the same "
        f"{victim['shared_words']}-word prefix), {report['workload']['prompt_tokens_p50']}-token median "
        f"prompt (max {report['workload']['prompt_tokens_max']}), max_new_tokens {victim['min_new']}-"
        f"{victim['max_new']}, greedy. Latencies in ms; tok/s: the victims' generated tokens over the side's wall "
        "time.",
        "",
        f"Hostile clients (a process of their own, stopped when the victims are done): {', '.join(config['hostile'])}; "
        f"bursts of {config['burst'] or 2 * config['max_queue_size']} requests of {config['burst_tokens']} tokens, "
        f"{config['health_flood']} `/health/timed` per wave with {config['big_headers']} 1 MB-header requests, "
        f"a {config['bomb_side']} x {config['bomb_side']} PNG bomb.",
        "", "## Findings", "", *findings(report), "",
    ]
    rows = []
    for number, sides in enumerate(report["rounds"], 1):
        for order, (side, result) in enumerate(sides.items(), 1):
            v = result.get("victims")
            if not v:
                rows.append([number, side, order, "–", "did not run", *["–"] * 7])
                continue
            rows.append([number, side, order, v["requests"], v["failures"], v["failures_shed"],
                         f"{v['tokens_per_s']:.0f}", _ms(v["ttft_p50_ms"]), _ms(v["ttft_p99_ms"]),
                         _ms(v["itl_p50_ms"]), _ms(v["itl_p99_ms"]), f"{v['wall_s']:.1f}"])
    lines += ["## Victims, per round and side", "",
              *_table(["round", "side", "order", "requests", "failures", "of which queue full", "victim tok/s",
                       "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "wall s"], rows), ""]
    ratio_rows = [[r["round"], _fmt_ratio(r["tokens_per_s"]), _fmt_ratio(r["itl_p99"]), _fmt_ratio(r["ttft_p99"]),
                   f"{r['failures'][0]} → {r['failures'][1]}"] for r in report["ratios"]]
    if report["ratios"]:
        medians = [statistics.median(x) if (x := [r[key] for r in report["ratios"] if r[key] is not None]) else None
                   for key in ("tokens_per_s", "itl_p99", "ttft_p99")]
        ratio_rows.append(["median", *map(_fmt_ratio, medians), ""])
    admitted = tally["by_kind"].get("burst", {}).get("200", 0)
    lines += ["## Hostile / quiet, per round", "",
              "Victim tok/s below 1 and latency ratios above 1 are what the hostile clients cost the victims. Not all "
              "of it is harm: admitted hostile requests are ordinary work sharing the worker (over all hostile "
              f"sides: {admitted} burst requests of up to {config['burst_tokens']} tokens, "
              f"{tally['by_kind'].get('quitter', {}).get('200', 0)} quitter streams' prompts and first tokens, the "
              "health probes' one-token generations), and on a 2-core host the hostile clients' own CPU (their "
              "process, and the API pod answering them) is taken from the cores the worker uses; `--hostile` runs "
              "a subset to tell them apart.", "",
              *_table(["round", "victim tok/s", "ITL p99", "TTFT p99", "victim failures quiet → hostile"],
                      ratio_rows), ""]
    kind_rows = []
    for kind, counts in tally["by_kind"].items():
        server = sum(n for s, n in counts.items() if server_error(s))
        kind_rows.append([kind, sum(counts.values()), _counts(counts), f"**{server}**" if server else 0])
    lines += ["## Hostile clients' status codes (every hostile side together)", "",
              *_table(["client", "requests", "status counts", "5xx (not shedding)"], kind_rows), ""]
    if tally["extra"]:
        lines += [f"Quitters read {tally['extra'].get('quitter tokens read', 0)} token events before closing.", ""]
    case_rows = [[kind, case, _counts(counts)] for kind, cases in tally["by_case"].items()
                 for case, counts in sorted(cases.items())]
    lines += ["### Per request kind (poisoners by route and value; image bombs by route)", "",
              *_table(["client", "request", "status counts"], case_rows), ""]
    if tally["server_errors"]:
        lines += ["### First 5xx answers", "",
                  *(f"- {e['kind']} {e['case']}: {e['status']} {e['body']!r}" for e in tally["server_errors"][:10]), ""]
    lines += ["## Processes' peak RSS at the end (MiB)", "",
              *_table(list(report["peak_rss_mib"]), [[_ms(v) for v in report["peak_rss_mib"].values()]]), ""]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def machine_facts(ferry_root: Path) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ferry_root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ferry_root,
                           capture_output=True, text=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                           if line.startswith("model name")), platform.processor()),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "ferry_commit": (commit.stdout.strip() or "not a git checkout")
                        + (" + uncommitted changes" if dirty.stdout.strip() else ""),
    }


def write_bomb(folder: Path, side: int) -> Path:
    """A ``side`` x ``side`` black PNG, one bit per pixel: 17 KB for 12000 (432 MB once decoded to RGB)."""
    import PIL.Image

    path = folder / BOMB_NAME
    PIL.Image.new("1", (side, side)).save(path, format="PNG")
    return path


def prepare_model(kind: str, home: Path) -> Path:
    return ensure_tiny_vlm(home / "tiny-vlm") if kind == "vlm" else ensure_tiny_model(home / "tiny-llama")


def text_works(stack: Stack, route: str) -> str | None:
    """None when a short text request streams on the stack, else why not (the VLM must take text alone)."""
    body = ({"model": stack.model_name, "prompt": "Hello there", "max_tokens": 4, "stream": True}
            if route == COMPLETIONS_ROUTE else {"inputs": "Hello there", "parameters": {"max_new_tokens": 4}})
    try:
        with httpx.stream("POST", stack.base_url + route, json=body, timeout=120) as response:
            text = response.read().decode(errors="replace")
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200 or '"error"' in text:
        return f"HTTP {response.status_code}: {text[:200]}"
    return None


def warm_up(stack: Stack, spec: VictimSpec, bodies: list[dict[str, Any]], timeout: float) -> None:
    """A few victim requests before measuring (first-call costs of the pod, the worker and the connections)."""
    few = VictimSpec(**{**asdict(spec), "requests": min(len(bodies), spec.clients)})
    result = run_victims(stack, few, bodies[: few.requests], timeout)
    if result["failures"]:
        raise RuntimeError(f"warm-up failed: {result['failure_samples'][0]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ferry-root", type=Path, default=ROOT,
                        help="checkout whose ferry-api and ferry-worker run (cwd and PYTHONPATH)")
    parser.add_argument("--model", choices=["auto", "vlm", "text"], default="auto",
                        help="served tiny model; auto: the VLM if it serves text, else the text model")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of quiet + hostile, order alternating")
    parser.add_argument("--victims", type=int, default=8, help="concurrent victim clients")
    parser.add_argument("--victim-requests", type=int, default=128, help="victim requests per side")
    parser.add_argument("--victim-route", choices=["tgi", "openai"], default="tgi",
                        help="tgi: /generate_stream; openai: streamed /v1/completions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims' prompts and lengths")
    parser.add_argument("--words", type=int, nargs=3, default=[8, 120, 600], metavar=("MIN", "MODE", "MAX"),
                        help="victim prompt length in words (triangular)")
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                        help="victim max_new_tokens, uniform")
    parser.add_argument("--shared-every", type=int, default=4, help="every Nth victim prompt has the shared prefix")
    parser.add_argument("--shared-words", type=int, default=200, help="length of the shared prefix")
    parser.add_argument("--max-queue-size", type=int, default=64, help="MAX_QUEUE_SIZE of the stack")
    parser.add_argument("--burst", type=int, default=0, help="requests per burst (0: 2 x max-queue-size)")
    parser.add_argument("--burst-tokens", type=int, default=32, help="max_new_tokens of a burst request")
    parser.add_argument("--burst-waves", type=int, default=8, help="bursts per hostile side, at most")
    parser.add_argument("--health-flood", type=int, default=100, help="concurrent GET /health/timed per wave")
    parser.add_argument("--health-waves", type=int, default=40, help="health waves per hostile side, at most")
    parser.add_argument("--big-headers", type=int, default=4, help="1 MB-header requests per health wave")
    parser.add_argument("--poison-limit", type=int, default=1200, help="poisoned requests per hostile side, at most")
    parser.add_argument("--bombs", type=int, default=240, help="image bomb requests per hostile side, at most")
    parser.add_argument("--bomb-side", type=int, default=12000, help="the bomb's width and height in pixels")
    parser.add_argument("--quitters", type=int, default=400, help="streams closed early per hostile side, at most")
    parser.add_argument("--hostile", nargs="+", choices=HOSTILE_KINDS, default=list(HOSTILE_KINDS),
                        help="which hostile clients run (a subset shows which one costs the victims what)")
    parser.add_argument("--side-time-limit", type=float, default=180.0, help="seconds a hostile side may last")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="client timeout of every request")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra env var for both Ferry processes (repeatable), e.g. COMPILE_MODEL=false")
    parser.add_argument("--model-home", type=Path,
                        default=Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry")),
                        help="where the tiny models are made once and kept")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.env):
        parser.error("--env takes KEY=VALUE")

    from server.embedded import embedded_redis  # here: the hostile process (spawned) needs none of the server

    ferry_root = args.ferry_root.resolve()
    route = COMPLETIONS_ROUTE if args.victim_route == "openai" else STREAM_ROUTE
    spec = VictimSpec(clients=args.victims, requests=args.victim_requests, route=route, seed=args.seed,
                      min_words=args.words[0], mode_words=args.words[1], max_words=args.words[2],
                      min_new=args.new_tokens[0], max_new=args.new_tokens[1], shared_every=args.shared_every,
                      shared_words=args.shared_words, max_prompt_tokens=2047 - args.new_tokens[1] - 64)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "config": {"command": " ".join([".venv/bin/python", "bench/hostile_bench.py", *sys.argv[1:]]),
                   **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "ferry_root": str(ferry_root), "victim": {**asdict(spec)}},
        "machine": machine_facts(ferry_root),
        "rounds": [],
    }
    started = time.monotonic()
    kinds = ["vlm", "text"] if args.model == "auto" else [args.model]
    with tempfile.TemporaryDirectory(prefix="ferry-hostile-") as scratch, \
            embedded_redis("redis-server") as redis_url:
        media = Path(scratch) / "multimodal_inputs"
        media.mkdir()
        write_bomb(media, args.bomb_side)
        base_env = {"MAX_QUEUE_SIZE": str(args.max_queue_size), "MULTIMODAL_INPUT_DIR": str(media),
                    **dict(item.split("=", 1) for item in args.env)}
        with contextlib.ExitStack() as running:
            stack, why_not = None, []
            for kind in kinds:
                model = prepare_model(kind, args.model_home)
                print(f"starting ferry-api + ferry-worker from {ferry_root} on the tiny {kind} model", flush=True)
                attempt = contextlib.ExitStack()
                try:
                    candidate = attempt.enter_context(start_stack(ferry_root, redis_url, model,
                                                                  args.out / "logs" / kind, base_env))
                    if (problem := text_works(candidate, route)) is None:
                        stack = candidate
                        running.enter_context(attempt)
                        report["model_kind"] = kind
                        break
                    why_not.append(f"{kind}: a text request failed: {problem}")
                except (RuntimeError, TimeoutError) as exc:
                    why_not.append(f"{kind}: {exc}")
                attempt.close()
            if stack is None:
                raise SystemExit("no stack served text: " + "; ".join(why_not))
            report["images"] = report["model_kind"] == "vlm"
            report["images_note"] = "; ".join(why_not) or ("text model chosen" if not report["images"] else "")

            from tokenizers import Tokenizer  # the served model's own tokenizer, to keep prompts in its context

            tokenizer = Tokenizer.from_file(str(prepare_model(report["model_kind"], args.model_home)
                                                / "tokenizer.json"))
            prompts = victim_prompts(spec, corpus_words(), lambda text: len(tokenizer.encode(text).ids))
            lengths = sorted(len(tokenizer.encode(text).ids) for text, _ in prompts)
            report["workload"] = {"prompt_tokens_p50": lengths[len(lengths) // 2], "prompt_tokens_max": lengths[-1],
                                  "max_new_tokens_total": sum(new for _, new in prompts)}
            bodies = victim_bodies(spec, prompts, stack.model_name)
            hostile = HostileSpec(
                base_url=stack.base_url, model_name=stack.model_name,
                bomb_item=BOMB_NAME if report["images"] else None,
                poison_limit=args.poison_limit, poison_interval=POISON_INTERVAL, bombs=args.bombs,
                bomb_interval=BOMB_INTERVAL, quitters=args.quitters, quitter_clients=2,
                quitter_interval=QUITTER_INTERVAL, health_waves=args.health_waves, health_flood=args.health_flood,
                health_interval=HEALTH_INTERVAL, big_headers=args.big_headers, burst_waves=args.burst_waves,
                burst=args.burst or 2 * args.max_queue_size, burst_tokens=args.burst_tokens,
                burst_interval=BURST_INTERVAL,
                time_limit=args.side_time_limit, request_timeout=args.request_timeout,
                prompt=" ".join(corpus_words()[:150]), kinds=tuple(args.hostile),
            )
            print("warm-up", flush=True)
            warm_up(stack, spec, bodies, args.request_timeout)
            for number in range(args.rounds):
                order = ("quiet", "hostile") if number % 2 == 0 else ("hostile", "quiet")
                sides: dict[str, Any] = {}
                report["rounds"].append(sides)
                for side in order:
                    print(f"round {number + 1}: {side}", flush=True)
                    sides[side] = run_side(side, stack, spec, bodies, hostile, args.request_timeout)
                    v = sides[side]["victims"] or {}
                    print(f"  victims: {v.get('tokens_per_s', 0):.0f} tok/s, ITL p99 {_ms(v.get('itl_p99_ms'))} ms, "
                          f"{v.get('failures', '?')} failures", flush=True)
                    if sides[side]["exited"]:
                        break
                if any(result["exited"] for result in sides.values()):
                    print("a Ferry process exited: stopping here", flush=True)
                    break
            report["peak_rss_mib"] = stack.peak_rss_mib()
    report["ratios"] = ratios(report["rounds"])
    report["hostile_totals"] = merged_tally(report["rounds"])
    report["duration_s"] = time.monotonic() - started
    (args.out / "hostile.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "hostile.md").write_text(text)
    print(text)
    print(f"\nwrote {args.out}/hostile.md and hostile.json in {report['duration_s']:.0f} s")


if __name__ == "__main__":
    main()
