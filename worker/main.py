"""``ferry-worker``: the queue loop of one worker process (one device).

It reads jobs of its model from the job streams through the model's consumer group, the most urgent
priority's first (first come, first served within one), hands them to the engine (any
:class:`worker.engine.Engine`: the loop does not know which), publishes every token event to the job's reply
channel and XACKs (and XDELs) a job once its last event is published. A step's events go out while the engine
computes the next step; a worker with a running batch looks for new jobs when an API pod's ``queued`` notice says
one came. Run N processes (same MODEL_NAME, any hosts) for a pool. What it promises under failures is in
docs/reliability.md:

- a job stays pending in the group until its last event is out; while it runs, its worker keeps it fresh
  (XCLAIM JUSTID on every heartbeat), so only a dead worker's jobs go idle, and live workers take those
  over after ``claimIdleSeconds`` (XAUTOCLAIM); after ``maxDeliveries`` deliveries a job fails instead;
- control messages (``cancel`` for a client that left, ``stop`` for stopInfer) reach running and queued
  requests; jobs past their deadline are not started, and running ones are dropped when it passes;
- a lost Redis connection (or, in a Redis Cluster, a shard of the model's that fails) pauses the running batch:
  the loop reconnects with backoff, sends again what it sent and could not confirm, and carries on with the
  requests whose jobs are still its own (those another worker took over meanwhile are its now; those Redis lost
  are failed); after claimIdleSeconds without Redis it lets them go, as when it stops; SIGTERM stops taking
  jobs, finishes the running batch, then exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

from pydantic import ValidationError
from redis.client import PubSub
from redis.exceptions import ClusterError, RedisClusterException, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.connection import REDIS_ERRORS, Outbox, SyncRedis, publish, publish_command, sync_client
from common.logs import configure_logging
from common.look_alikes import warn_look_alikes
from common.process import command_parser, freeze_startup_heap
from common.protocol import Control, ErrorEvent, Job, WorkerStatus
from common.settings import EngineName, Settings, settings_or_exit
from worker.cpu_threads import place_worker_threads
from worker.engine import Engine, EngineLoadError, PreparedJob, RequestRefused, StepOutput, load_engine
from worker.metrics import WorkerMetrics

if TYPE_CHECKING:  # redis-py's reply types, in its newer releases only
    from redis.typing import StreamIdT, XReadGroupResponse

log = logging.getLogger("ferry.worker")

HEARTBEAT_TTL_SECONDS = 10.0
IDLE_BLOCK_MS = 1000
LOOK_EVERY_SECONDS = 1.0
"""A running worker with room looks for queued jobs when an API pod's ``queued`` notice says one came, and at
least this often anyway (a notice is lost with the control subscription, and an older pod sends none)."""
MEDIA_THREADS = 2
"""Jobs whose media are prepared at once, beside the steps (:meth:`worker.engine.Engine.prepare`): each holds a
core and up to 3 x maxImagePixels bytes per image while it decodes, so a few."""
MEDIA_WAIT_SECONDS = 0.05
"""How long an otherwise idle worker waits for media being prepared before it reads controls and deadlines again."""
RECONNECT_FIRST_DELAY = 0.1
RECONNECT_MAX_DELAY = 5.0
# What losing Redis (or the shard of the model's keys) raises: the loop reconnects instead of crashing. NOGROUP
# is a Redis that came back empty (the group is made again); other refusals (WRONGTYPE, NOPERM) are bugs or
# misconfiguration and stop the worker.
LOST_REDIS = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException, TryAgainError)


class Entry(NamedTuple):
    """A job's entry: the job stream it is in (its priority's) and its id there."""

    stream: str
    message_id: bytes


def by_stream(entries: Iterable[Entry]) -> dict[str, list[StreamIdT]]:
    """The entries' ids per stream, for the commands that take the ids of one stream."""
    grouped: dict[str, list[StreamIdT]] = {}
    for stream, message_id in entries:
        grouped.setdefault(stream, []).append(message_id)
    return grouped


class Running(NamedTuple):
    """A job this worker has accepted and not yet acknowledged."""

    entry: Entry
    job: Job
    expires_at: float  # its deadline on this process's monotonic clock (Job.local_deadline)


@dataclass
class Preparing:
    """A job whose media the engine prepares on the media threads, and whether a stop order came meanwhile (it
    applies once the job is added)."""

    future: Future[PreparedJob]
    stopping: bool = False


class WorkerLoop:
    """Moves jobs between Redis and the engine. All state of the worker lives here."""

    def __init__(
        self, settings: Settings, redis: SyncRedis, engine: Engine, metrics: WorkerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.engine = engine
        self.model = settings.served_model_name
        self.metrics = metrics or WorkerMetrics(self.model, engine.kv_budget_tokens)
        self.streams = keys.job_streams(self.model)  # the most urgent first
        self.group = keys.worker_group(self.model)
        self.consumer = keys.consumer_name(settings.worker_pool, socket.gethostname(), os.getpid())
        self._inflight: dict[str, Running] = {}  # by request id
        # Accepted jobs (in _inflight) whose media are being prepared, by request id; the threads that prepare them.
        self._preparing: dict[str, Preparing] = {}
        self._media_threads = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="ferry-media")
        self._control: PubSub | None = None
        self._outbox = Outbox(redis)  # each step's events and acknowledgements
        self._sent: list[StepOutput] = []  # the step whose events are in the outbox
        # Commands not confirmed sent, kept while Redis is lost and sent again on reconnect (a step's events, its
        # acknowledgements): an event sent twice is relayed once (API pods drop an index they have), an XACK is
        # idempotent.
        self._held: list[tuple[Any, ...]] = []
        self._look_due = True  # jobs may be queued that this worker has not looked for
        self._next_look = 0.0  # monotonic
        self._running = True
        # Heartbeats also keep this worker's pending jobs fresh: well within the idle time that lets
        # another worker claim them.
        self._heartbeat_every = min(2.0, settings.claim_idle_seconds / 3)
        self._next_heartbeat = 0.0
        self._next_claim = 0.0

    # -- set-up ------------------------------------------------------------------------------------

    def connect(self) -> None:
        """Create the consumer group on each job stream if needed and subscribe to the model's control channel."""
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self._control is not None:
            self._control.close()
        self._control = self.redis.pubsub(ignore_subscribe_messages=True)
        if self.settings.redis_cluster:  # sharded: the model's shard, where the API pods SPUBLISH
            self._control.ssubscribe(keys.control_channel(self.model))
        else:
            self._control.subscribe(keys.control_channel(self.model))
        self._look_due = True  # notices may have been missed meanwhile
        self.recover()

    def recover(self) -> None:
        """After a reconnect: send again what was not confirmed sent, then keep the running requests whose jobs are
        still this worker's, drop those another worker took over meanwhile (they run there now, and their clients
        get each token once) and fail those whose jobs Redis lost (a restart without persistence)."""
        if self._held:
            held, self._held = self._held, []  # the outbox has them now (hold)
            self._outbox.send(held)
        inflight = list(self._inflight.items())
        if not inflight:
            return
        pipe = self.redis.pipeline(transaction=False)
        for _, (entry, _, _) in inflight:
            pipe.xpending_range(entry.stream, self.group, entry.message_id, entry.message_id, 1)
        owners = [pending[0]["consumer"].decode() if pending else None for pending in pipe.execute()]
        gone = {request_id: owner for (request_id, _), owner in zip(inflight, owners, strict=True)
                if owner != self.consumer}
        for request_id in gone:
            self.engine.cancel(request_id)
        lost = [self._inflight[request_id].job for request_id, owner in gone.items() if owner is None]
        if gone:
            log.warning("after the reconnect: %d requests were taken over by other workers, %d lost with Redis's data",
                        len(gone) - len(lost), len(lost))
        if lost:
            self.fail(lost, "the request's job was lost with Redis's data; it may be retried", "unavailable")
        for request_id in gone:
            del self._inflight[request_id]

    def stop(self) -> None:
        """Stop taking jobs; the running batch is finished and acknowledged before :meth:`run` returns."""
        self._running = False

    def run(self) -> None:
        log.info("worker %s serving %s from %s", self.consumer, self.model, ", ".join(self.streams))
        delay = RECONNECT_FIRST_DELAY
        connected = False
        lost_at: float | None = None  # monotonic time the connection was lost, while it is
        try:
            while self._running or not self.engine.idle or self._preparing:
                try:
                    if not connected:
                        self.connect()
                        connected, delay, lost_at = True, RECONNECT_FIRST_DELAY, None
                    self.run_once()
                except (*LOST_REDIS, ResponseError) as exc:
                    if not isinstance(exc, LOST_REDIS) and "NOGROUP" not in str(exc):
                        raise
                    lost_at = time.monotonic() if lost_at is None else lost_at
                    # Past claimIdleSeconds without a heartbeat other workers may take the jobs over anyway.
                    if self._running and time.monotonic() - lost_at < self.settings.claim_idle_seconds:
                        log.warning("lost Redis (%s); holding %d running requests, retrying in %.1f s",
                                    exc, len(self._inflight), delay)
                        self.hold()
                    else:
                        if self._inflight:
                            log.warning("lost Redis (%s) for %.1f s%s; leaving %d running requests to other "
                                        "workers", exc, time.monotonic() - lost_at,
                                        "" if self._running else " while stopping", len(self._inflight))
                        self.drop_all(exc)
                        if not self._running:
                            break
                    connected = False
                    time.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_DELAY)
        finally:
            self._running = False
            try:
                self.settle()  # the last step's events and acknowledgements
                self.redis.zrem(keys.heartbeats(self.model), self.consumer)
                self.redis.delete(keys.worker_status(self.model, self.consumer))
            except (*REDIS_ERRORS, OSError):
                pass
        log.info("worker %s stopped", self.consumer)

    # -- one iteration -----------------------------------------------------------------------------

    def run_once(self) -> None:
        """Apply control messages and deadlines, hand the engine the jobs whose media are ready, take new jobs
        while it has room, run one step."""
        now = time.time()
        self.heartbeat(now)
        self.apply_controls()
        self.expire()
        if self._running and now >= self._next_claim:
            self._next_claim = now + self.settings.claim_idle_seconds / 2
            self.claim_abandoned()
        self._add_prepared()
        if self.engine.idle:  # nothing to compute: wait for a job (a running batch looks in publish)
            self.settle()
            if self._preparing:
                self._wait_for_media()
            else:
                self.take_jobs(IDLE_BLOCK_MS)
        if not self.engine.idle:
            self.step()

    def take_jobs(self, block: int | None = None) -> None:
        """Look which job streams hold jobs no worker has taken and accept as many as the engine has room for,
        in one read per stream, the most urgent stream first. When none does, wait up to ``block`` ms for a
        job to come to any stream."""
        if not self._running or not (room := self._room()):
            return
        self._look_due, self._next_look = False, time.monotonic() + LOOK_EVERY_SECONDS
        taken = False
        for stream in self._queued():  # another worker may have taken a stream's jobs since the look
            entries = self.redis.xreadgroup(self.group, self.consumer, {stream: ">"}, count=room)
            taken = self._accept_read(entries) or taken
            if not (room := self._room()):
                self._look_due = True  # the streams may hold more: look again once there is room
                return
        if not taken and block is not None:
            # One read of every stream takes one job from each that has one: only jobs that came to
            # several streams since the look, a rare race (the engine orders what it holds by priority).
            entries = self.redis.xreadgroup(self.group, self.consumer, dict.fromkeys(self.streams, ">"),
                                            count=1, block=block)
            if self._accept_read(entries):
                self.take_jobs()  # the first job of a burst woke the worker: take the rest of it

    def _accept_read(self, entries: XReadGroupResponse | None) -> bool:
        """Accept what XREADGROUP answered (in RESP2, the protocol of Ferry's clients: [stream, messages] per
        stream; None when a blocking read found nothing); whether it held any job."""
        assert not isinstance(entries, dict), "a RESP3 reply"
        read = [(Entry(stream.decode(), message_id), fields) for stream, messages in entries or []
                for message_id, fields in messages]
        self.accept(read)
        return bool(read)

    def _queued(self) -> list[str]:
        """The streams holding jobs no worker has taken, the most urgent first: a look that takes nothing (one
        XREADGROUP of several streams would take a job from each). A stream holds a job until it is done (XACK
        and XDEL), so its entries not pending are those."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, self.group)
        replies = pipe.execute()
        lengths, pending = replies[::2], replies[1::2]
        return [stream for stream, length, held in zip(self.streams, lengths, pending, strict=True)
                if length > held["pending"]]

    def heartbeat(self, now: float) -> None:
        if now < self._next_heartbeat:
            return
        beats = keys.heartbeats(self.model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(beats, {self.consumer: now + HEARTBEAT_TTL_SECONDS})
        pipe.zremrangebyscore(beats, "-inf", now)
        pipe.set(keys.worker_status(self.model, self.consumer), self.status().model_dump_json(),
                 px=int(HEARTBEAT_TTL_SECONDS * 1000))
        # Reset the idle time of our pending jobs: they are alive, not abandoned.
        for stream, ids in by_stream(running.entry for running in self._inflight.values()).items():
            pipe.xclaim(stream, self.group, self.consumer, 0, ids, justid=True)
        pipe.execute()
        self.metrics.compiled.set(self.engine.compiled)
        self._next_heartbeat = now + self._heartbeat_every

    def status(self) -> WorkerStatus:
        """What the heartbeat publishes for the API's metrics and ferry-status (they cannot ask the engine)."""
        engine = self.engine
        return WorkerStatus(
            device=self.settings.device,
            batch_size=engine.batch_size,
            waiting=engine.waiting + len(self._preparing),
            kv_reserved_tokens=engine.reserved_tokens,
            kv_budget_tokens=engine.kv_budget_tokens,
            max_batch_size=self.settings.max_batch_size,
        )

    def apply_controls(self) -> None:
        assert self._control is not None
        read = self._control.get_sharded_message if self.settings.redis_cluster else self._control.get_message
        while (message := read(timeout=0.0)) is not None:
            if message["type"] not in ("message", "smessage"):
                continue
            try:
                control = Control.model_validate_json(message["data"])
            except ValidationError:
                log.error("ignoring malformed control message %r", message["data"])
                continue
            self.apply_control(control)

    def apply_control(self, control: Control) -> None:
        if control.action == "queued":
            self._look_due = True
            return
        if control.action == "unload_adapter":  # request_id names the adapter
            self.engine.unload_adapter(control.request_id)
            return
        if control.request_id not in self._inflight:
            return  # another worker's request, or one this worker has not read yet (see accept)
        if control.action == "stop":
            if (preparing := self._preparing.get(control.request_id)) is not None:
                preparing.stopping = True
            else:
                self.engine.stop(control.request_id)
        else:
            self.engine.cancel(control.request_id)
            self.ack([control.request_id])

    def expire(self) -> None:
        """Drop running requests whose deadline passed: their clients have been answered already."""
        now = time.monotonic()
        expired = [running.job for running in self._inflight.values() if running.expires_at < now]
        for job in expired:
            self.engine.cancel(job.request_id)
        if expired:
            self.fail(expired, "request timed out (e2eTimeout) while generating", "incomplete_generation")
            self.ack([job.request_id for job in expired])

    def claim_abandoned(self) -> None:
        """Take over jobs a dead worker left pending, the most urgent first; fail those tried too often."""
        min_idle = int(self.settings.claim_idle_seconds * 1000)
        for stream in self.streams:
            _, claimed, _ = self.redis.xautoclaim(stream, self.group, self.consumer, min_idle, count=8)
            retried: list[tuple[Entry, dict[bytes, bytes]]] = []
            for message_id, fields in claimed:
                pending = self.redis.xpending_range(stream, self.group, message_id, message_id, 1)
                deliveries = int(pending[0]["times_delivered"]) if pending else 1
                log.warning("claimed abandoned job %s (delivery %d)", message_id, deliveries)
                entry = Entry(stream, message_id)
                if deliveries > self.settings.max_deliveries:
                    job = self._parse(message_id, fields)
                    if job is not None:
                        self.fail([job], f"the request failed on {deliveries - 1} workers in a row (maxDeliveries "
                                         f"{self.settings.max_deliveries}); giving up", "generation")
                    self._ack_ids([entry])
                else:
                    retried.append((entry, fields))
            self.accept(retried)

    def _parse(self, message_id: bytes, fields: dict[bytes, bytes]) -> Job | None:
        """The entry's job; None for one this worker cannot take (an older or newer API pod's, whose parameters
        this worker's rules refuse), whose client is told why where its reply channel can be read."""
        raw = fields.get(keys.JOB_FIELD.encode(), b"")
        try:
            return Job.model_validate_json(raw)
        except ValidationError as exc:
            log.error("dropping malformed job %s: %s", message_id, exc)
            try:
                channel = json.loads(raw).get("reply_channel")
            except (ValueError, AttributeError):
                channel = None
            if isinstance(channel, str):
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                event = ErrorEvent(message=f"the request cannot run on this worker: {where}: {first['msg']}",
                                   error_type="validation")
                publish(self.redis, self.settings.redis_cluster, channel, event.model_dump_json())
            return None

    def accept(self, read: list[tuple[Entry, dict[bytes, bytes]]]) -> None:
        """Hand jobs read from the streams to the engine, with their control messages (a client may have left,
        or stopped them, before they were read: one round trip for all) and their media; answer the jobs that
        cannot run with an error."""
        jobs: list[tuple[Entry, Job, float]] = []
        for entry, fields in read:
            job = self._parse(entry.message_id, fields)
            if job is None:  # answered where it could be (_parse): drop it, loudly
                self._ack_ids([entry])
            elif job.request_id in self._inflight:  # re-claimed while still running here
                continue
            elif (expires_at := job.local_deadline()) < time.monotonic():
                self.fail([job], "request timed out (e2eTimeout) before a worker could start it",
                          "incomplete_generation")
                self._ack_ids([entry])
            elif (reason := self.engine.refusal(job)) is not None:
                self.fail([job], f"request does not fit this worker: {reason}", "generation")
                self._ack_ids([entry])
            else:
                jobs.append((entry, job, expires_at))
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)  # GETs, not MGET: a cluster keeps them on several slots
        for _, job, _ in jobs:
            pipe.get(keys.control_key(self.model, job.request_id))
        for (entry, job, expires_at), raw_control in zip(jobs, pipe.execute(), strict=True):
            control = Control.model_validate_json(raw_control) if raw_control else None
            if control is not None and control.action == "cancel":
                self._ack_ids([entry])
            elif self._add(entry, job, expires_at) and control is not None:
                self.apply_control(control)

    def _add(self, entry: Entry, job: Job, expires_at: float) -> bool:
        """Hand one job to the engine; whether it was taken (else its client got an error). A job with media
        reaches the engine once the media threads have prepared them (:meth:`_add_prepared`): decoding an image
        never holds up the steps of the others. Meanwhile it is in ``_inflight``, so controls, deadlines and
        heartbeats apply to it as to a running one."""
        if job.media:
            stored = self.redis.mget([ref.key for ref in job.media])
            media = [data for data in stored if isinstance(data, bytes)]  # None: the key expired or was deleted
            if len(media) != len(stored):
                self.fail([job], "the request's media are no longer in Redis (its API pod ended it)", "generation")
                self._ack_ids([entry])
                return False
            self._preparing[job.request_id] = Preparing(self._media_threads.submit(self.engine.prepare, job, media))
        else:
            try:
                self.engine.add(job)
            except RequestRefused as exc:
                self._refuse(entry, job, exc)
                return False
        self._inflight[job.request_id] = Running(entry, job, expires_at)
        return True

    def _add_prepared(self) -> None:
        """Hand the engine the jobs whose media are ready, without waiting for the others; forget those that
        ended meanwhile (cancelled, expired or dropped: no longer in ``_inflight``)."""
        for request_id, preparing in list(self._preparing.items()):
            running = self._inflight.get(request_id)
            if running is not None and not preparing.future.done():
                continue
            del self._preparing[request_id]
            if running is None:
                preparing.future.cancel()  # not prepared at all if its turn had not come
                continue
            try:
                self.engine.add(preparing.future.result())
            except RequestRefused as exc:
                self._refuse(running.entry, running.job, exc)
            except Exception as exc:  # the model's processor failed on this request's media: the others go on
                log.exception("preparing the media failed", extra={"request_id": request_id})
                self.fail([running.job], f"preparing the request's media failed: {exc}", "generation")
                self.ack([request_id])
            else:
                if preparing.stopping:
                    self.engine.stop(request_id)

    def _wait_for_media(self) -> None:
        """With nothing to compute but media being prepared: look for jobs when told to, then wait a moment for
        the first media to be ready."""
        if self._look_due or time.monotonic() >= self._next_look:
            self.take_jobs()
        if self.engine.idle:
            wait([preparing.future for preparing in self._preparing.values()], MEDIA_WAIT_SECONDS, FIRST_COMPLETED)

    def _room(self) -> int:
        """The engine's room less the jobs being prepared for it (each takes a place once added)."""
        return max(0, self.engine.room() - len(self._preparing))

    def _refuse(self, entry: Entry, job: Job, exc: RequestRefused) -> None:
        """Answer a job the engine refused with a validation error, and be done with it."""
        self.fail([job], f"request does not fit this worker: {exc}", "validation")
        self._inflight.pop(job.request_id, None)
        self._ack_ids([entry])

    def step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a model-level failure: fail the batch's jobs, keep serving
            log.exception("engine step failed")
            jobs = [running.job for rid, running in self._inflight.items() if rid not in self._preparing]
            for job in jobs:
                self.engine.cancel(job.request_id)
            self.fail(jobs, f"generation failed: {exc}", "generation")
            self.ack([job.request_id for job in jobs])
            return
        self.metrics.observe_step(self.engine, outputs, time.perf_counter() - started)
        self.publish(outputs)

    def publish(self, outputs: list[StepOutput]) -> None:
        """Send the step's events, then the acknowledgement of the jobs that just finished (after their last
        event), in one round trip that goes on while the engine computes the next step (its replies are read
        by :meth:`settle`); then, when the batch has room and a job may be queued, take new jobs.

        PUBLISH answers how many subscribers got the event. The pod that queued a job subscribed to its
        channel before queueing it (one pattern subscription per pod, for the pod's lifetime), so no
        receiver means that pod is gone (killed, or cut off from Redis, which fails its requests): the
        request is cancelled instead of being computed for nobody."""
        commands: list[tuple[Any, ...]] = [
            publish_command(self.settings.redis_cluster, out.job.reply_channel, out.event.model_dump_json())
            for out in outputs
        ]
        finished = [self._inflight.pop(out.job.request_id).entry for out in outputs
                    if out.finished and out.job.request_id in self._inflight]
        commands += self._ack_commands(finished)
        self._held = commands  # until the outbox has them (hold)
        self.settle()  # the previous step's events go out first
        self._held = []
        self._outbox.send(commands)
        self._sent = outputs
        self.apply_controls()  # the notices of jobs queued during the step
        if self._look_due or time.monotonic() >= self._next_look:
            self.take_jobs()

    def settle(self) -> None:
        """Read the replies of the last step's events and cancel the requests they reached no one for. Called
        before the next step's are sent, before anything else this worker publishes (a request's events keep
        their order) and before waiting idle."""
        outputs, self._sent = self._sent, []
        replies = self._outbox.replies()
        # the replies of the acknowledgements sent after the events follow theirs
        orphans = [out.job.request_id for out, receivers in zip(outputs, replies, strict=False)
                   if receivers == 0 and not out.finished and out.job.request_id in self._inflight]
        if orphans:
            log.warning("dropping %d requests whose API pod is gone", len(orphans))
            for request_id in orphans:
                self.engine.cancel(request_id)
            self.ack(orphans)

    def fail(self, jobs: list[Job], message: str, error_type: str) -> None:
        self.settle()
        self.metrics.observe_errors(len(jobs))
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            log.warning("request failed (%s): %s", error_type, message, extra={"request_id": job.request_id})
            publish(pipe, self.settings.redis_cluster, job.reply_channel,
                    ErrorEvent(message=message, error_type=error_type).model_dump_json())
        pipe.execute()

    def ack(self, request_ids: list[str]) -> None:
        self._ack_ids([self._inflight.pop(rid).entry for rid in request_ids if rid in self._inflight])

    def _ack_ids(self, entries: list[Entry]) -> None:
        if entries:
            pipe = self.redis.pipeline(transaction=False)
            for command in self._ack_commands(entries):
                pipe.execute_command(*command)
            pipe.execute()

    def _ack_commands(self, entries: list[Entry]) -> list[tuple[Any, ...]]:
        """Done with these entries: acknowledge and delete them (the streams' lengths are the queue depth)."""
        return [command for stream, ids in by_stream(entries).items()
                for command in (("XACK", stream, self.group, *ids), ("XDEL", stream, *ids))]

    def hold(self) -> None:
        """Keep every running request after losing Redis, with the commands sent and not confirmed and those not
        sent yet, for :meth:`recover`."""
        self._held = self._outbox.discard() + self._held
        self._sent = []

    def drop_all(self, cause: Exception) -> None:
        """Forget every running request after losing Redis for claimIdleSeconds, or while stopping: their jobs stay
        pending for other workers. On one server their pods' relays lost Redis too and answered them; in a cluster
        the shard of their channels may still be up, so they are told there."""
        self._outbox.discard()  # its replies, if any come, are about requests dropped here
        self._sent, self._held = [], []
        jobs = [running.job for running in self._inflight.values()]
        for job in jobs:
            self.engine.cancel(job.request_id)
        self._inflight.clear()
        if self.settings.redis_cluster and jobs:
            with contextlib.suppress(*REDIS_ERRORS):
                self.fail(jobs, f"the worker lost the Redis shard of its job queue ({cause}); the request may be "
                                "retried", "unavailable")


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ferry-worker", __doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model-path", help="model folder or Hugging Face model id; overrides MODEL_PATH")
    parser.add_argument("--model-name",
                        help="the model to serve, one of the config's ModelConfig; overrides MODEL_NAME")
    parser.add_argument("--device", help="cpu, cuda[:n] or npu[:n]; overrides DEVICE")
    parser.add_argument("--engine", choices=get_args(EngineName), help="overrides ENGINE (default transformers)")
    args = parser.parse_args(argv)
    settings = settings_or_exit("ferry-worker", **{k: v for k, v in vars(args).items() if v is not None})
    configure_logging(settings.log_format, settings.log_level)
    warn_look_alikes(os.environ)
    try:
        claim = place_worker_threads(settings)  # auto: its cores stay claimed until it stops
    except ValueError as exc:
        print(f"ferry-worker: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        engine = load_engine(settings)
    except EngineLoadError as exc:
        print(f"ferry-worker: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        freeze_startup_heap()
        loop = WorkerLoop(settings, sync_client(settings), engine)
        host, port = settings.worker_metrics_host, settings.worker_metrics_port
        if port:
            try:
                loop.metrics.serve(port, host)
            except OSError as exc:  # the port is taken, or the address is not one of this host
                print(f"ferry-worker: cannot serve metrics on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
                raise SystemExit(1) from None
        signal.signal(signal.SIGTERM, lambda *_: loop.stop())
        loop.run()
    finally:
        engine.close()
        if claim is not None:
            claim.close()


if __name__ == "__main__":
    main()
