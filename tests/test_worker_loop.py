"""The worker's queue loop over fakeredis with the real engine: jobs in, events out, acknowledged."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import fakeredis
import pytest

from common import keys
from common.protocol import (
    DEFAULT_PRIORITY,
    Control,
    ErrorEvent,
    Job,
    MediaRef,
    SamplingParams,
    TokenEvent,
    decode_event,
)
from common.settings import Settings
from worker.engine import PreparedJob, RequestRefused
from worker.main import WorkerLoop
from worker.transformers_engine import TransformersEngine

STREAM = keys.job_stream("m")  # the default priority's

@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> TransformersEngine:
    return TransformersEngine.load(Settings(model_path=tiny_model_path, max_seq_len=64))


@pytest.fixture
def loop(engine: TransformersEngine, tiny_model_path: Path) -> WorkerLoop:
    settings = Settings(model_path=tiny_model_path, model_name="m")
    worker = WorkerLoop(settings, fakeredis.FakeRedis(), engine)
    worker.connect()
    return worker


@pytest.fixture
def single(engine: TransformersEngine, tiny_model_path: Path) -> WorkerLoop:
    """A worker whose batch holds one request (maxBatchSize 1): the jobs behind it wait in the job streams."""
    settings = Settings(model_path=tiny_model_path, model_name="m", max_batch_size=1)
    worker = WorkerLoop(settings, fakeredis.FakeRedis(), TransformersEngine(engine.model, engine.tokenizer, settings))
    worker.connect()
    return worker


def queue_job(loop: WorkerLoop, request_id: str, input_ids: list[int], max_new_tokens: int = 3,
              priority: int = DEFAULT_PRIORITY) -> Job:
    """XADD a job as an API pod does: to its priority's stream."""
    job = Job(
        request_id=request_id,
        model="m",
        reply_channel=f"reply:{request_id}",
        input_ids=input_ids,
        params=SamplingParams(seed=1, max_new_tokens=max_new_tokens),
        priority=priority,
        enqueued_at=time.time(),
    )
    loop.redis.xadd(keys.job_stream("m", priority), {keys.JOB_FIELD: job.model_dump_json()})
    return job


def run_until_idle(loop: WorkerLoop, subscriber) -> list[TokenEvent | ErrorEvent]:
    """Run the loop until nothing is left, and return the events published meanwhile."""
    return [event for _, event in run_until_idle_by_request(loop, subscriber)]


def run_until_idle_by_request(loop: WorkerLoop, subscriber) -> list[tuple[str, TokenEvent | ErrorEvent]]:
    """Run the loop until nothing is left, and return the events published meanwhile with their request ids."""
    loop.run_once()
    while not loop.engine.idle:
        loop.run_once()
    loop.settle()
    events = []
    while (message := subscriber.get_message(timeout=0.1)) is not None:
        if message["type"] == "pmessage":
            events.append((message["channel"].decode().removeprefix("reply:"), decode_event(message["data"])))
    return events


def subscribe(loop: WorkerLoop):
    pubsub = loop.redis.pubsub()
    pubsub.psubscribe("reply:*")
    pubsub.get_message(timeout=1)  # the psubscribe confirmation
    return pubsub


def test_job_is_generated_published_and_acknowledged(loop: WorkerLoop) -> None:
    subscriber = subscribe(loop)
    queue_job(loop, "a", [1, 50, 60], max_new_tokens=3)
    events = run_until_idle(loop, subscriber)
    assert [e.index for e in events] == [0, 1, 2]
    assert events[-1].finish is not None and events[-1].finish.finish_reason == "length"
    assert loop.redis.xpending(STREAM, loop.group)["pending"] == 0


def test_job_that_cannot_fit_gets_an_error_and_is_acknowledged(loop: WorkerLoop) -> None:
    subscriber = subscribe(loop)
    queue_job(loop, "too-long", [5] * 100)  # engine max_seq_len is 64
    queue_job(loop, "fine", [1, 7])
    events = run_until_idle(loop, subscriber)
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and "does not fit" in errors[0].message
    assert any(isinstance(e, TokenEvent) and e.finish is not None for e in events)
    assert loop.redis.xpending(STREAM, loop.group)["pending"] == 0


def test_malformed_job_is_dropped_and_others_still_served(loop: WorkerLoop) -> None:
    subscriber = subscribe(loop)
    loop.redis.xadd(STREAM, {keys.JOB_FIELD: b"{not json"})
    queue_job(loop, "ok", [1, 9])
    events = run_until_idle(loop, subscriber)
    assert events[-1].finish is not None
    assert loop.redis.xpending(STREAM, loop.group)["pending"] == 0


def test_a_job_this_worker_cannot_take_is_answered_where_its_reply_channel_reads(loop: WorkerLoop) -> None:
    """A job whose parameters this worker's rules refuse (an older API pod's, during a rolling upgrade) is not
    dropped in silence: its client gets a validation error instead of waiting for its timeout."""
    subscriber = subscribe(loop)
    job = json.loads(Job(request_id="old-pod", model="m", reply_channel="reply:old-pod", input_ids=[1, 9],
                         params=SamplingParams(seed=1, max_new_tokens=3), enqueued_at=time.time()).model_dump_json())
    job["params"]["repetition_penalty"] = 5e-324
    loop.redis.xadd(STREAM, {keys.JOB_FIELD: json.dumps(job)})
    [(request_id, event)] = run_until_idle_by_request(loop, subscriber)
    assert request_id == "old-pod" and isinstance(event, ErrorEvent) and event.error_type == "validation"
    assert "repetition_penalty" in event.message
    assert loop.redis.xlen(STREAM) == 0


def test_engine_failure_fails_the_batch_and_the_loop_keeps_serving(
    loop: WorkerLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    subscriber = subscribe(loop)
    queue_job(loop, "x", [1, 11], max_new_tokens=5)
    queue_job(loop, "y", [1, 12], max_new_tokens=5)
    original_step = loop.engine.step

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(loop.engine, "step", broken_step)
    loop.run_once()
    monkeypatch.setattr(loop.engine, "step", original_step)
    events = run_until_idle(loop, subscriber)
    assert sorted(e.message for e in events if isinstance(e, ErrorEvent)) == ["generation failed: device lost"] * 2
    assert loop.engine.idle and loop.redis.xpending(STREAM, loop.group)["pending"] == 0
    queue_job(loop, "z", [1, 13])
    assert run_until_idle(loop, subscriber)[-1].finish is not None


def test_heartbeat_marks_the_worker_alive(loop: WorkerLoop) -> None:
    now = time.time()
    loop.heartbeat(now)
    assert loop.redis.zcount(keys.heartbeats("m"), now, "+inf") == 1


def test_a_request_nobody_listens_to_is_dropped_at_its_first_token(loop: WorkerLoop) -> None:
    """PUBLISH reaching no subscriber means the pod that queued the job is gone: the worker cancels the
    request and acknowledges it after one step, while a request with a listener runs to its end."""
    subscriber = loop.redis.pubsub()
    subscriber.psubscribe("reply:heard*")
    subscriber.get_message(timeout=1)
    queue_job(loop, "unheard", [1, 50, 60], max_new_tokens=40)
    queue_job(loop, "heard", [1, 50, 61], max_new_tokens=5)
    loop.run_once()
    loop.run_once()
    assert set(loop._inflight) == {"heard"}
    events = run_until_idle(loop, subscriber)
    assert len(events) == 5 and events[-1].finish is not None
    assert loop.redis.xpending(STREAM, loop.group)["pending"] == 0 and loop.redis.xlen(STREAM) == 0


def test_queued_jobs_start_most_urgent_first_then_in_arrival_order(single: WorkerLoop) -> None:
    """Behind a full batch, jobs wait in their priority's stream; each time the batch has room (the poll of
    the step that ends a request), the worker takes the oldest job of the most urgent priority that has one.
    Every entry is acknowledged and deleted from its own stream."""
    subscriber = subscribe(single)
    queue_job(single, "running", [1, 50, 60], max_new_tokens=8)
    single.run_once()
    assert set(single._inflight) == {"running"}
    for request_id, priority in (("a", 5), ("b", 3), ("c", 5), ("d", 1), ("e", 3), ("f", 1)):
        queue_job(single, request_id, [1, 50, 60], priority=priority)
    events = run_until_idle_by_request(single, subscriber)
    started = [request_id for request_id, event in events if event.index == 0]
    assert started == ["running", "d", "f", "b", "e", "a", "c"]
    assert all(isinstance(event, TokenEvent) for _, event in events)
    for stream in single.streams:
        assert single.redis.xlen(stream) == 0 and single.redis.xpending(stream, single.group)["pending"] == 0


def test_a_burst_of_jobs_is_taken_in_one_read_and_prefilled_together(loop: WorkerLoop) -> None:
    """Jobs queued together are read together (up to the engine's room) with their control messages in one
    round trip, so they share one prefill pass; one whose client left before it was read is dropped."""
    subscriber = subscribe(loop)
    for request_id in "abcde":
        queue_job(loop, request_id, [1, 50, 60], max_new_tokens=2)
    loop.redis.set(keys.control_key("m", "c"), Control(action="cancel", request_id="c").model_dump_json())
    room = loop.engine.room()
    reads: list[int] = []
    xreadgroup = loop.redis.xreadgroup
    loop.redis.xreadgroup = lambda *args, **kwargs: reads.append(kwargs["count"]) or xreadgroup(*args, **kwargs)
    loop.take_jobs()
    assert reads == [room] and room >= 5 and set(loop._inflight) == {"a", "b", "d", "e"}
    loop.step()
    assert loop.engine.batch_size == 4  # one prefill pass for the four
    events = run_until_idle_by_request(loop, subscriber)
    assert sorted({request_id for request_id, _ in events}) == ["a", "b", "d", "e"]
    assert loop.redis.xlen(STREAM) == 0 and loop.redis.xpending(STREAM, loop.group)["pending"] == 0


def test_a_running_worker_looks_for_jobs_when_told_one_was_queued(loop: WorkerLoop) -> None:
    """A worker with a running batch does not look in the job streams at every step: an API pod's ``queued``
    notice on the control channel sends it there after the step it comes in, and without one it looks once
    every LOOK_EVERY_SECONDS (a notice lost, or a pod that sends none)."""
    subscriber = subscribe(loop)
    queue_job(loop, "long", [1, 50, 60], max_new_tokens=40)
    loop.run_once()
    assert set(loop._inflight) == {"long"}
    queue_job(loop, "silent", [1, 50, 61])  # no notice
    for _ in range(3):
        loop.run_once()
    assert set(loop._inflight) == {"long"}
    queue_job(loop, "told", [1, 50, 62])
    loop.redis.publish(keys.control_channel("m"), Control(request_id="told", action="queued").model_dump_json())
    loop.run_once()
    assert set(loop._inflight) == {"long", "silent", "told"}  # one look finds both
    queue_job(loop, "late", [1, 50, 63])  # again without a notice
    loop._next_look = 0.0  # as if LOOK_EVERY_SECONDS had passed
    loop.run_once()
    assert "late" in loop._inflight
    started = {request_id for request_id, _ in run_until_idle_by_request(loop, subscriber)}
    assert started == {"long", "silent", "told", "late"}


def test_an_idle_worker_wakes_for_a_job_of_any_priority(loop: WorkerLoop) -> None:
    """An idle worker blocks on every job stream at once: a job queued meanwhile, at any priority, is taken
    as soon as it comes."""
    subscriber = subscribe(loop)
    threading.Timer(0.2, queue_job, (loop, "late", [1, 7]), {"priority": 2}).start()
    loop.take_jobs(block=5000)
    assert set(loop._inflight) == {"late"}
    assert run_until_idle(loop, subscriber)[-1].finish is not None


def test_the_bench_s_fake_token_source_keeps_the_engine_contract() -> None:
    """bench/fake_token_worker.py (the fan-out benchmark's worker) is an Engine: instantiable, refusing what it
    cannot do, and emitting max_new_tokens tokens then a finish."""
    from bench.fake_token_worker import FakeTokenEngine

    engine = FakeTokenEngine(Settings(model_path=Path("unused")), interval=0.0)
    job = Job(request_id="fake-1", model="m", reply_channel="c", input_ids=[1, 2],
              params=SamplingParams(seed=1, max_new_tokens=3), enqueued_at=time.time(), deadline=time.time() + 60)
    assert engine.refusal(job.model_copy(update={"adapter": "a", "adapter_path": "/x"})) is not None
    assert engine.refusal(job) is None
    engine.add(job)
    events = [out.event for _ in range(3) for out in engine.step()]
    assert [event.index for event in events] == [0, 1, 2] and events[-1].finish is not None
    assert engine.idle


class SlowMedia:
    """A stand-in for ``Engine.prepare`` that holds each job until released (as decoding a large image does)
    and records the thread it runs on."""

    def __init__(self, outcome: Exception | None = None) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[int] = []
        self.outcome = outcome

    def __call__(self, job: Job, media: list[bytes]) -> PreparedJob:
        self.threads.append(threading.get_ident())
        self.started.set()
        assert self.release.wait(timeout=30) and media == [b"picture"]
        if self.outcome is not None:
            raise self.outcome
        return PreparedJob(job, {})


def queue_media_job(loop: WorkerLoop, request_id: str, max_new_tokens: int = 3) -> Job:
    """A job with one media item, its bytes in Redis as an API pod leaves them."""
    key = keys.media_key("m", request_id, 0)
    loop.redis.set(key, b"picture")
    job = Job(request_id=request_id, model="m", reply_channel=f"reply:{request_id}", input_ids=[1, 50, 60],
              params=SamplingParams(seed=1, max_new_tokens=max_new_tokens), enqueued_at=time.time(),
              media=[MediaRef(kind="image", key=key, size=7)])
    loop.redis.xadd(STREAM, {keys.JOB_FIELD: job.model_dump_json()})
    return job


def events_by_request(subscriber) -> dict[str, list[TokenEvent | ErrorEvent]]:
    events: dict[str, list[TokenEvent | ErrorEvent]] = {}
    while (message := subscriber.get_message(timeout=0.1)) is not None:
        if message["type"] == "pmessage":
            request_id = message["channel"].decode().removeprefix("reply:")
            events.setdefault(request_id, []).append(decode_event(message["data"]))
    return events


def test_media_are_prepared_beside_the_steps(loop: WorkerLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a job's media are being prepared (held here until released), the loop keeps stepping: a text job
    runs to its end meanwhile. The job waiting for its media is the worker's (heartbeats keep it, it takes a place
    in the batch); once its media are ready, the engine takes it."""
    prepare = SlowMedia()
    monkeypatch.setattr(loop.engine, "prepare", prepare)
    subscriber = subscribe(loop)
    queue_media_job(loop, "picture")
    queue_job(loop, "text", [1, 50, 61], max_new_tokens=6)
    loop.run_once()
    assert prepare.started.wait(timeout=10) and prepare.threads != [threading.get_ident()]
    while loop.engine.batch_size:
        loop.run_once()
    assert set(loop._inflight) == {"picture"} and loop.status().waiting == 1
    events = events_by_request(subscriber)
    assert [event.index for event in events["text"]] == list(range(6)) and "picture" not in events
    prepare.release.set()
    events = run_until_idle(loop, subscriber)  # the first iteration waits for the media, the next adds the job
    while loop._inflight:
        events += run_until_idle(loop, subscriber)
    assert [event.index for event in events] == [0, 1, 2] and events[-1].finish is not None
    assert loop.redis.xlen(STREAM) == 0 and loop.redis.xpending(STREAM, loop.group)["pending"] == 0


@pytest.mark.parametrize("action", ["cancel", "stop", "refused", "failed"])
def test_a_job_waiting_for_its_media(loop: WorkerLoop, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    """Controls reach a job whose media are being prepared: cancelled, it never reaches the engine; stopped, it
    ends at its first token. Media the engine refuses are a validation error, a processor that fails a
    generation error; either way the job is acknowledged and the worker goes on."""
    outcome = {"refused": RequestRefused("media item 0 is too large"), "failed": RuntimeError("boom")}.get(action)
    prepare = SlowMedia(outcome)
    monkeypatch.setattr(loop.engine, "prepare", prepare)
    subscriber = subscribe(loop)
    queue_media_job(loop, "picture", max_new_tokens=5)
    loop.run_once()
    assert prepare.started.wait(timeout=10) and set(loop._inflight) == {"picture"}
    if action in ("cancel", "stop"):
        loop.apply_control(Control(action=action, request_id="picture"))
    prepare.release.set()
    events = []
    for _ in range(200):
        events += run_until_idle(loop, subscriber)
        if not loop._inflight:
            break
    expected = {
        "cancel": [],
        "stop": ["stop_sequence"],
        "refused": ["request does not fit this worker: media item 0 is too large"],
        "failed": ["preparing the request's media failed: boom"],
    }[action]
    assert [e.message if isinstance(e, ErrorEvent) else e.finish.finish_reason for e in events] == expected
    assert loop.engine.idle and not loop._preparing
    assert loop.redis.xlen(STREAM) == 0 and loop.redis.xpending(STREAM, loop.group)["pending"] == 0
