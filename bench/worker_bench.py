"""The worker's share of the queue hop: the real WorkerLoop through Redis against the same engine called
directly, on the same jobs, in one process (no HTTP, no API pod, no load generator).

``.venv/bin/python bench/worker_bench.py [--concurrency 1 32] [--rounds 3]`` starts its own redis-server on
a free port. Each round, per concurrency level, runs the engine alone and then the worker loop over the
same kind of jobs (``concurrency`` queued at once, batch after batch, at least 16 per measurement; 32
prompt tokens, 64 new tokens, greedy, EOS off), and
prints both tokens/s and their ratio: what publishing every token to Redis, acknowledging jobs and
looking for new ones costs the worker per step. A thread stands in for the API pod: one pattern
subscription to the reply channels, read and dropped (a worker cancels a request whose channel has no
receiver, as it would for a pod that is gone). Rounds alternate the two, so a noisy machine shows as spread.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import keys  # noqa: E402
from common.process import freeze_startup_heap  # noqa: E402
from common.protocol import Job, SamplingParams  # noqa: E402
from common.settings import Settings, default_model_dir  # noqa: E402
from serve_bench import model_without_eos  # noqa: E402
from server.embedded import embedded_redis  # noqa: E402
from worker.main import WorkerLoop  # noqa: E402
from worker.tiny_model import ensure_tiny_model  # noqa: E402
from worker.transformers_engine import TransformersEngine  # noqa: E402

PROMPT_TOKENS = 32
NEW_TOKENS = 64
REPLY_PREFIX = "bench-reply:"


def jobs(count: int, first: int) -> list[Job]:
    return [Job(request_id=f"r{first + i}", model="bench", reply_channel=f"{REPLY_PREFIX}{first + i}",
                input_ids=[1] + [50 + (first + i) % 7] * (PROMPT_TOKENS - 1),
                params=SamplingParams(seed=1, max_new_tokens=NEW_TOKENS), enqueued_at=time.time())
            for i in range(count)]


@contextlib.contextmanager
def api_pod_stand_in(url: str) -> Iterator[None]:
    """Receive (and drop) every reply event through one pattern subscription, as an API pod does."""
    pubsub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(f"{REPLY_PREFIX}*")
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            pubsub.get_message(timeout=0.1)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield
    finally:
        done.set()
        reader.join()
        pubsub.close()


def engine_alone(engine: TransformersEngine, batches: list[list[Job]]) -> float:
    """Tokens/s of the engine's step loop over the batches, one after the other."""
    started, tokens = time.perf_counter(), 0
    for batch in batches:
        for job in batch:
            engine.add(job)
        while not engine.idle:
            tokens += len(engine.step())
    return tokens / (time.perf_counter() - started)


def through_redis(loop: WorkerLoop, batches: list[list[Job]]) -> float:
    """Tokens/s of the worker loop taking each batch from the job stream and publishing every token (the
    time to queue the jobs, an API pod's work, is not counted)."""
    elapsed = 0.0
    for batch in batches:
        for job in batch:
            loop.redis.xadd(keys.job_stream(loop.model), {keys.JOB_FIELD: job.model_dump_json()})
        started = time.perf_counter()
        loop.run_once()
        while not loop.engine.idle:
            loop.run_once()
        elapsed += time.perf_counter() - started
    return sum(map(len, batches)) * NEW_TOKENS / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ferry-bench-"))
        url = stack.enter_context(embedded_redis("redis-server"))
        stack.enter_context(api_pod_stand_in(url))
        model = model_without_eos(ensure_tiny_model(default_model_dir()), Path(scratch) / "tiny-llama-no-eos")
        settings = Settings(model_path=model, model_name="bench", redis_url=url,
                            max_batch_size=max(args.concurrency))
        engine = TransformersEngine.load(settings)
        freeze_startup_heap()  # as ferry-worker does
        loop = WorkerLoop(settings, redis.Redis.from_url(url), engine)
        loop.connect()
        print("| concurrency | round | engine alone tokens/s | worker loop via Redis tokens/s | ratio |")
        print("|---|---|---|---|---|")
        serial = 0

        def batches(concurrency: int) -> list[list[Job]]:
            """At least 16 jobs per measurement, ``concurrency`` at a time (a few seconds at concurrency 1)."""
            nonlocal serial
            made = [jobs(concurrency, serial + i * concurrency) for i in range(max(2, 16 // concurrency))]
            serial += sum(map(len, made))
            return made

        for concurrency in args.concurrency:
            for round_ in range(max(1, args.rounds) + 1):  # the first round warms up and is not shown
                alone = engine_alone(engine, batches(concurrency))
                served = through_redis(loop, batches(concurrency))
                if round_:
                    print(f"| {concurrency} | {round_} | {alone:.0f} | {served:.0f} | {served / alone:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
