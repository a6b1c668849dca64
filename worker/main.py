"""``ferry-worker``: the queue loop of one worker process (one device).

It reads jobs of its model from the job stream through the model's consumer group, hands them to the
continuous-batching :class:`worker.engine.Engine`, publishes every token event to the job's reply channel
and XACKs a job once its last event is published. Run N processes (same MODEL_NAME, any hosts) for a pool.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import ResponseError

from common import keys
from common.protocol import ErrorEvent, Job
from common.settings import Settings
from worker.engine import Engine, StepOutput

log = logging.getLogger("ferry.worker")

HEARTBEAT_SECONDS = 2.0
HEARTBEAT_TTL_SECONDS = 10.0
IDLE_BLOCK_MS = 1000


class WorkerLoop:
    """Moves jobs between Redis and the engine. All state of the worker lives here."""

    def __init__(self, settings: Settings, redis: Redis, engine: Engine) -> None:
        self.settings = settings
        self.redis = redis
        self.engine = engine
        self.model = settings.served_model_name
        self.stream = keys.job_stream(self.model)
        self.group = keys.worker_group(self.model)
        self.consumer = keys.consumer_name(settings.worker_pool, socket.gethostname(), os.getpid())
        self._inflight: dict[str, tuple[bytes, Job]] = {}  # request id -> (stream entry id, job)
        self._running = True
        self._next_heartbeat = 0.0

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def heartbeat(self, now: float) -> None:
        if now >= self._next_heartbeat:
            beats = keys.heartbeats(self.model)
            pipe = self.redis.pipeline(transaction=False)
            pipe.zadd(beats, {self.consumer: now + HEARTBEAT_TTL_SECONDS})
            pipe.zremrangebyscore(beats, "-inf", now)
            pipe.execute()
            self._next_heartbeat = now + HEARTBEAT_SECONDS

    def stop(self) -> None:
        """Stop taking jobs; the running batch is finished and acknowledged before :meth:`run` returns."""
        self._running = False

    def run(self) -> None:
        self.ensure_group()
        log.info("worker %s serving %s from %s", self.consumer, self.model, self.stream)
        try:
            while self._running or not self.engine.idle:
                self.run_once()
        finally:
            self.redis.zrem(keys.heartbeats(self.model), self.consumer)

    def run_once(self) -> None:
        """Take new jobs while the engine has room, then run one engine step."""
        self.heartbeat(time.time())
        while self._running and self.engine.has_room():
            # Block only when there is nothing to compute; otherwise poll and go on stepping.
            block = IDLE_BLOCK_MS if self.engine.idle else None
            entries = self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=1, block=block)
            if not entries:
                break
            for message_id, fields in entries[0][1]:
                self.accept(message_id, fields)
        if not self.engine.idle:
            self.step()

    def accept(self, message_id: bytes, fields: dict[bytes, bytes]) -> None:
        raw = fields.get(keys.JOB_FIELD.encode(), b"")
        try:
            job = Job.model_validate_json(raw)
        except ValidationError as exc:
            # Nobody can be answered without a valid reply channel: drop it, loudly.
            log.error("dropping malformed job %s: %s", message_id, exc)
            self.redis.xack(self.stream, self.group, message_id)
            return
        if not self.engine.fits(job):
            self.fail([job], f"request does not fit this worker's limits ({len(job.input_ids)} prompt tokens)")
            self.redis.xack(self.stream, self.group, message_id)
            return
        self._inflight[job.request_id] = (message_id, job)
        self.engine.add(job)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a model-level failure: fail the batch's jobs, keep serving
            log.exception("engine step failed")
            jobs = [job for _, job in self._inflight.values()]
            for job in jobs:
                self.engine.cancel(job.request_id)
            self.fail(jobs, f"generation failed: {exc}")
            self.ack([job.request_id for job in jobs])
            return
        self.publish(outputs)

    def publish(self, outputs: list[StepOutput]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        finished = []
        for out in outputs:
            pipe.publish(out.job.reply_channel, out.event.model_dump_json())
            if out.finished:
                finished.append(out.job.request_id)
        pipe.execute()
        self.ack(finished)

    def fail(self, jobs: list[Job], message: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.publish(job.reply_channel, ErrorEvent(message=message).model_dump_json())
        pipe.execute()

    def ack(self, request_ids: list[str]) -> None:
        ids = [self._inflight.pop(rid)[0] for rid in request_ids if rid in self._inflight]
        if ids:
            self.redis.xack(self.stream, self.group, *ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model-path", help="overrides MODEL_PATH")
    parser.add_argument("--model-name", help="overrides MODEL_NAME")
    parser.add_argument("--device", help="cpu, cuda[:n] or npu[:n]; overrides DEVICE")
    args = parser.parse_args(argv)
    settings = Settings(**{k: v for k, v in vars(args).items() if v is not None})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine.load(settings)
    loop = WorkerLoop(settings, Redis.from_url(settings.redis_url), engine)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    loop.run()


if __name__ == "__main__":
    main()
