"""Reliability guarantees (docs/reliability.md): failures of workers, clients, Redis and API pods.

Three layers, cheapest first:

- unit tests of the worker's queue loop over fakeredis with the real engine (abandoned jobs and
  maxDeliveries, cancel / stop control messages, deadlines) and of the API's index de-duplication;
- bad input at the protocol level through FastAPI's TestClient (no worker);
- end to end over a private ``redis-server`` with separate worker and API processes, which the tests kill,
  stop, terminate and restart: one module-scoped :class:`Cluster` (two workers and three API pods with
  different settings) shared by all of them, each test restoring what it needs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.errors import PipelineError
from api.metrics import ApiMetrics
from api.pipeline import Submission
from common import keys
from common.protocol import (
    DEFAULT_PRIORITY,
    Control,
    ErrorEvent,
    Finish,
    Job,
    SamplingParams,
    TokenEvent,
    TokenInfo,
    decode_event,
)
from common.settings import Settings
from tests.fakes import one_token_submit, patch_submit
from tests.helpers import Stack, free_port, start_stack, stop_stack, wait_for
from worker.main import WorkerLoop
from worker.transformers_engine import TransformersEngine

PROMPT = "def main("


# ============================================================================ worker loop over fakeredis

STREAM = keys.job_stream("m")  # the default priority's


@pytest.fixture(scope="module")
def base_engine(tiny_model_path: Path) -> TransformersEngine:
    return TransformersEngine.load(Settings(model_path=tiny_model_path))


def make_loop(engine: TransformersEngine, server: fakeredis.FakeServer, consumer: str, **settings: Any) -> WorkerLoop:
    """A worker with a fresh engine over the shared model (a new worker process, as far as Redis knows)."""
    config = Settings(model_path=engine.settings.model_path, model_name="m", **settings)
    loop = WorkerLoop(config, fakeredis.FakeRedis(server=server),
                      TransformersEngine(engine.model, engine.tokenizer, config))
    loop.consumer = consumer
    loop.connect()
    return loop


def queue_job(
    client: redis.Redis, request_id: str, max_new_tokens: int = 3, deadline: float | None = None,
    priority: int = DEFAULT_PRIORITY,
) -> Job:
    job = Job(
        request_id=request_id,
        model="m",
        reply_channel=f"reply:{request_id}",
        input_ids=[1, 50, 60],
        params=SamplingParams(seed=1, max_new_tokens=max_new_tokens),
        priority=priority,
        enqueued_at=time.time(),
        deadline=deadline,
    )
    client.xadd(keys.job_stream("m", priority), {keys.JOB_FIELD: job.model_dump_json()})
    return job


class Replies:
    """Every event the workers publish on ``reply:*``, by request id."""

    def __init__(self, client: redis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._pubsub.psubscribe("reply:*")
        self._pubsub.get_message(timeout=1)
        self.events: dict[str, list[TokenEvent | ErrorEvent]] = {}

    def drain(self) -> dict[str, list[TokenEvent | ErrorEvent]]:
        while (message := self._pubsub.get_message(timeout=0.05)) is not None:
            if message["type"] == "pmessage":
                request_id = message["channel"].decode().split(":", 1)[1]
                self.events.setdefault(request_id, []).append(decode_event(message["data"]))
        return self.events


def send_control(client: redis.Redis, request_id: str, action: str, publish: bool = True) -> None:
    """What an API pod does (api.pipeline.send_control): the key for late readers, the message for the rest."""
    payload = Control(request_id=request_id, action=action).model_dump_json()
    client.set(keys.control_key("m", request_id), payload, ex=60)
    if publish:
        client.publish(keys.control_channel("m"), payload)


def stream_ids(client: redis.Redis) -> list[bytes]:
    return [message_id for message_id, _ in client.xrange(STREAM)]


def test_abandoned_job_is_taken_over_and_fails_after_max_deliveries(base_engine: TransformersEngine) -> None:
    """A job whose workers keep dying is re-delivered (XAUTOCLAIM after claimIdleSeconds) to a live worker,
    which restarts it, until maxDeliveries deliveries: the next claimer fails it with an error event and
    acknowledges it, instead of crashing workers forever."""
    server = fakeredis.FakeServer()
    settings = {"claim_idle_seconds": 0.01, "max_deliveries": 3}
    first = make_loop(base_engine, server, "cpu:host:1", **settings)
    replies = Replies(first.redis)
    queue_job(first.redis, "poison", max_new_tokens=50)
    first.run_once()  # delivery 1: read and started
    assert "poison" in first._inflight and not first.engine.idle
    for delivery, consumer in ((2, "cpu:host:2"), (3, "cpu:host:3")):
        time.sleep(0.03)  # the previous worker "died": its pending job goes idle
        taker = make_loop(base_engine, server, consumer, **settings)
        taker.claim_abandoned()
        assert "poison" in taker._inflight, f"delivery {delivery} did not start the job"
        pending = taker.redis.xpending_range(STREAM, taker.group, "-", "+", 10)
        assert [(p["consumer"].decode(), p["times_delivered"]) for p in pending] == [(consumer, delivery)]
    assert not any(isinstance(e, ErrorEvent) for e in replies.drain().get("poison", []))
    time.sleep(0.03)
    last = make_loop(base_engine, server, "cpu:host:4", **settings)
    last.claim_abandoned()
    assert last.engine.idle and not last._inflight
    events = replies.drain()["poison"]
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and errors[0].error_type == "generation"
    assert "maxDeliveries 3" in errors[0].message
    assert last.redis.xpending(STREAM, last.group)["pending"] == 0 and stream_ids(last.redis) == []


def test_live_worker_keeps_its_jobs_with_heartbeats(base_engine: TransformersEngine) -> None:
    """A worker's heartbeat resets the idle time of its running jobs (XCLAIM JUSTID, in each job's priority
    stream), so a slow but live worker does not lose them to another worker's XAUTOCLAIM."""
    server = fakeredis.FakeServer()
    owner = make_loop(base_engine, server, "cpu:host:1", claim_idle_seconds=0.2)
    other = make_loop(base_engine, server, "cpu:host:2", claim_idle_seconds=0.2)
    pod = Replies(owner.redis)  # the API pod waiting for the requests
    queue_job(owner.redis, "slow", max_new_tokens=50)
    queue_job(owner.redis, "urgent", max_new_tokens=50, priority=1)
    owner.run_once()
    assert set(owner._inflight) == {"slow", "urgent"}
    for _ in range(4):
        time.sleep(0.1)
        owner.heartbeat(time.time() + 10)  # due whatever the interval
        other.claim_abandoned()
    assert not other._inflight
    time.sleep(0.25)  # no heartbeat: now they look abandoned
    other.claim_abandoned()
    assert set(other._inflight) == {"slow", "urgent"}
    assert len(pod.drain()["slow"]) == 1  # the token of the owner's first step


def run_until(loop: WorkerLoop, condition: Callable[[], bool], limit: int = 200) -> None:
    for _ in range(limit):
        if condition():
            return
        loop.run_once()
    raise AssertionError("condition not reached")


def test_a_worker_that_loses_redis_goes_on_with_the_requests_still_its_own(base_engine: TransformersEngine) -> None:
    """What a worker does when its connection comes back (WorkerLoop.hold, then recover): it sends again the events
    it could not confirm (the pod relays each index once) and goes on with the requests still its own; one another
    worker took over meanwhile is dropped here without a word (it runs there), one whose job Redis lost fails."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    pod = Replies(loop.redis)
    for request_id in ("kept", "taken", "lost"):
        queue_job(loop.redis, request_id, max_new_tokens=30)
    run_until(loop, lambda: loop.engine.batch_size == 3)
    loop.run_once()
    loop.hold()  # the connection broke: the last step's events are not confirmed
    entries = {Job.model_validate_json(fields[keys.JOB_FIELD.encode()]).request_id: message_id
               for message_id, fields in loop.redis.xrange(STREAM)}
    loop.redis.xclaim(STREAM, loop.group, "cpu:host:2", 0, [entries["taken"]])
    loop.redis.xack(STREAM, loop.group, entries["lost"])
    loop.redis.xdel(STREAM, entries["lost"])
    loop.connect()
    assert set(loop._inflight) == {"kept"}
    run_until(loop, lambda: not loop._inflight)
    events = pod.drain()
    kept = events["kept"]
    assert all(isinstance(event, TokenEvent) for event in kept)
    assert sorted({event.index for event in kept}) == list(range(30)) and kept[-1].finish is not None
    assert len(kept) > 30  # the unconfirmed step went twice
    assert all(isinstance(event, TokenEvent) for event in events["taken"])
    failure = events["lost"][-1]
    assert isinstance(failure, ErrorEvent) and failure.error_type == "unavailable"


def test_cancel_drops_a_running_request_from_the_batch(base_engine: TransformersEngine) -> None:
    """A client that left (control message ``cancel``): its worker drops the request at the next step, the
    batch shrinks, the job is acknowledged and deleted, and no further event is published for it."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    replies = Replies(loop.redis)
    for request_id in ("a", "b", "c"):
        queue_job(loop.redis, request_id, max_new_tokens=40)
    run_until(loop, lambda: loop.engine.batch_size == 3)
    loop.run_once()
    before = len(replies.drain()["b"])
    send_control(loop.redis, "b", "cancel")
    loop.run_once()
    assert loop.engine.batch_size == 2 and set(loop._inflight) == {"a", "c"}
    assert loop.redis.xlen(STREAM) == 2 and loop.redis.xpending(STREAM, loop.group)["pending"] == 2
    run_until(loop, lambda: loop.engine.idle)
    events = replies.drain()
    assert len(events["b"]) == before and events["b"][-1].finish is None
    for request_id in ("a", "c"):
        assert [e.index for e in events[request_id]] == list(range(40))
        assert events[request_id][-1].finish.finish_reason == "length"
    assert loop.redis.xlen(STREAM) == 0


def test_cancel_of_a_queued_request_skips_it(base_engine: TransformersEngine) -> None:
    """A cancel published before any worker read the job is kept as a key: the job is acknowledged unread."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    replies = Replies(loop.redis)
    queue_job(loop.redis, "gone", max_new_tokens=40)
    send_control(loop.redis, "gone", "cancel", publish=False)  # no worker was listening
    queue_job(loop.redis, "kept")
    run_until(loop, lambda: loop.engine.idle and loop.redis.xlen(STREAM) == 0)
    events = replies.drain()
    assert "gone" not in events and events["kept"][-1].finish is not None


@pytest.mark.parametrize("queued", [False, True], ids=["running", "queued"])
def test_stop_ends_a_request_with_stop_sequence_and_its_text(base_engine: TransformersEngine, queued: bool) -> None:
    """stopInfer (control message ``stop``): the request ends at its next token with finish_reason
    ``stop_sequence`` and the text so far; it is acknowledged like any finished request."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    replies = Replies(loop.redis)
    queue_job(loop.redis, "s", max_new_tokens=40)
    if queued:
        send_control(loop.redis, "s", "stop", publish=False)
    else:
        run_until(loop, lambda: len(replies.drain().get("s", [])) >= 3)
        send_control(loop.redis, "s", "stop")
    run_until(loop, lambda: loop.engine.idle and loop.redis.xlen(STREAM) == 0)
    events = replies.drain()["s"]
    assert [e.index for e in events] == list(range(len(events))) and len(events) < 40
    finish = events[-1].finish
    assert finish.finish_reason == "stop_sequence"
    assert finish.generated_text == "".join(e.token.text for e in events)
    assert loop.redis.xlen(STREAM) == 0


def test_job_past_its_deadline_is_not_started(base_engine: TransformersEngine) -> None:
    """Nobody waits for a job whose deadline passed while it was queued: the worker publishes an
    ``incomplete_generation`` error instead of computing it, and acknowledges it."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    replies = Replies(loop.redis)
    queue_job(loop.redis, "late", max_new_tokens=40, deadline=time.time() - 1)
    loop.run_once()
    assert loop.engine.idle and not loop._inflight
    [event] = replies.drain()["late"]
    assert isinstance(event, ErrorEvent) and event.error_type == "incomplete_generation"
    assert "before a worker could start it" in event.message
    assert loop.redis.xlen(STREAM) == 0


def test_running_job_is_dropped_at_its_deadline(base_engine: TransformersEngine) -> None:
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    replies = Replies(loop.redis)
    queue_job(loop.redis, "slow", max_new_tokens=60, deadline=time.time() + 0.5)
    queue_job(loop.redis, "other", max_new_tokens=60)
    run_until(loop, lambda: loop.engine.batch_size == 2)
    time.sleep(0.6)
    loop.run_once()
    assert loop.engine.batch_size == 1 and set(loop._inflight) == {"other"}
    events = replies.drain()["slow"]
    assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "incomplete_generation"
    assert loop.redis.xlen(STREAM) == 1



def test_a_wall_clock_step_does_not_expire_a_running_job(
    base_engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads the wall clock once, when it accepts a job; an NTP step or a resumed VM after that
    moves no deadline (a CI run once saw a request time out before its e2eTimeout)."""
    server = fakeredis.FakeServer()
    loop = make_loop(base_engine, server, "cpu:host:1")
    pod = Replies(loop.redis)
    queue_job(loop.redis, "steady", max_new_tokens=60, deadline=time.time() + 30)
    run_until(loop, lambda: loop.engine.batch_size == 1)
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 60)  # the clock jumps past the deadline
    loop.run_once()
    assert set(loop._inflight) == {"steady"} and loop.engine.batch_size == 1
    assert not any(isinstance(event, ErrorEvent) for event in pod.drain()["steady"])


# ============================================================================ API: exactly-once token delivery


async def test_replayed_events_are_delivered_once(tiny_model_path: Path) -> None:
    """A re-delivered job is replayed from index 0 by its new worker: the API passes each index on once."""
    settings = Settings(model_path=tiny_model_path)
    ctx = type("Ctx", (), {"settings": settings, "metrics": ApiMetrics()})()
    job = Job(request_id="r", model="m", reply_channel="c", input_ids=[1], enqueued_at=time.time(),
              params=SamplingParams(seed=1, max_new_tokens=3), deadline=time.time() + 60)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    finish = Finish(finish_reason="length", generated_tokens=3, prompt_tokens=1, seed=1, generated_text="abc")
    for index in (0, 1, 0, 1, 2):  # the first worker died after two tokens
        token = TokenInfo(id=index, text="abc"[index], logprob=-1.0, special=False)
        event = TokenEvent(index=index, token=token, finish=finish if index == 2 else None)
        queue.put_nowait(event.model_dump_json().encode())
    events = [event async for event in Submission(ctx, job, queue, "r", time.monotonic()).events()]
    assert [e.index for e in events] == [0, 1, 2] and events[-1].finish == finish


async def test_events_that_arrive_after_the_deadline_are_not_relayed(tiny_model_path: Path) -> None:
    """Past its e2eTimeout deadline a request fails even while events keep coming in (a busy pod that is
    behind always has one queued), instead of running on to the end."""
    ctx = type("Ctx", (), {"settings": Settings(model_path=tiny_model_path), "metrics": ApiMetrics()})()
    job = Job(request_id="r", model="m", reply_channel="c", input_ids=[1], enqueued_at=time.time() - 2,
              params=SamplingParams(seed=1, max_new_tokens=3), deadline=time.time() - 1)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    finish = Finish(finish_reason="length", generated_tokens=3, prompt_tokens=1, seed=1, generated_text="aaa")
    for index in range(3):  # the whole output is already here
        token = TokenInfo(id=5, text="a", logprob=-1.0, special=False)
        queue.put_nowait(TokenEvent(index=index, token=token, finish=finish if index == 2 else None)
                         .model_dump_json().encode())
    relayed = []
    with pytest.raises(PipelineError) as caught:
        async for event in Submission(ctx, job, queue, "r", time.monotonic()).events():
            relayed.append(event)
    assert caught.value.error_type == "incomplete_generation" and "e2eTimeout" in caught.value.message
    assert relayed == []



async def test_a_wall_clock_step_does_not_expire_a_submission(tiny_model_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The API times e2eTimeout on its monotonic clock from the moment it queued the job."""
    ctx = type("Ctx", (), {"settings": Settings(model_path=tiny_model_path), "metrics": ApiMetrics()})()
    job = Job(request_id="r", model="m", reply_channel="c", input_ids=[1], enqueued_at=time.time(),
              params=SamplingParams(seed=1, max_new_tokens=1), deadline=time.time() + 30)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    submission = Submission(ctx, job, queue, "r", time.monotonic())
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 60)
    finish = Finish(finish_reason="length", generated_tokens=1, prompt_tokens=1, seed=1, generated_text="a")
    token = TokenInfo(id=5, text="a", logprob=-1.0, special=False)
    queue.put_nowait(TokenEvent(index=0, token=token, finish=finish).model_dump_json().encode())
    assert [event.index async for event in submission.events()] == [0]


def test_each_submission_of_a_request_id_is_a_job_of_its_own(tiny_model_path: Path) -> None:
    """A client's request id names its request only while it is in flight: every submission is a job of
    its own (the id plus a nonce) with its own events channel and control key, so nothing of an earlier
    request with the same id (a late event, its cancel) reaches a later one."""
    server = fakeredis.FakeServer()
    settings = Settings(model_path=tiny_model_path, token_timeout=0.3)  # no worker: each request times out
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))) as client:
        model = client.app.state.ctx.model.model_id
        for _ in range(2):
            response = client.post("/generate", json=body(3), headers={"x-request-id": "same"})
            assert response.status_code == 500 and response.json()["error_type"] == "incomplete_generation"
    redis_sync = fakeredis.FakeRedis(server=server)
    jobs = [Job.model_validate_json(fields[b"job"]) for _, fields in redis_sync.xrange(keys.job_stream(model))]
    assert len(jobs) == 2 and all(client_id(job) == "same" for job in jobs)
    assert len({job.request_id for job in jobs}) == 2 and len({job.reply_channel for job in jobs}) == 2
    for job in jobs:  # each closed request cancelled its own job only
        control = Control.model_validate_json(redis_sync.get(keys.control_key(model, job.request_id)))
        assert control == Control(request_id=job.request_id, action="cancel")
    assert not redis_sync.exists(keys.inflight_key(model, "same"))


def test_a_queued_job_is_announced_to_the_model_s_workers(tiny_model_path: Path) -> None:
    """After XADD the pod publishes a ``queued`` notice naming the job on the model's control channel: that is
    what sends a worker with a running batch to look in the job streams (worker.main.WorkerLoop.publish)."""
    server = fakeredis.FakeServer()
    redis_sync = fakeredis.FakeRedis(server=server)
    settings = Settings(model_path=tiny_model_path, token_timeout=0.3)  # no worker: the request times out
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))) as client:
        model = client.app.state.ctx.model.model_id
        listener = redis_sync.pubsub()
        listener.subscribe(keys.control_channel(model))
        client.post("/generate", json=body(3))
        messages = iter(lambda: listener.get_message(timeout=0.2), None)
        notices = [Control.model_validate_json(message["data"]) for message in messages
                   if message["type"] == "message"]
    (_, fields), = redis_sync.xrange(keys.job_stream(model))
    job = Job.model_validate_json(fields[b"job"])
    assert notices[0] == Control(request_id=job.request_id, action="queued")
    assert [notice.action for notice in notices] == ["queued", "cancel"]  # then its timeout cancelled it


# ============================================================================ bad input at the protocol level

TGI_ROUTES = ["/", "/generate", "/generate_stream"]
KSERVE_ROUTES = ["infer", "generate", "generate_stream", "stopInfer"]


@pytest.fixture(scope="module")
def small_body_client(tiny_model_path: Path) -> Iterator[TestClient]:
    """An app with maxRequestLength 1 MB over fakeredis; no worker (accepted requests get a stand-in)."""
    settings = Settings(model_path=tiny_model_path, max_request_length=1)
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis()), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_submit(monkeypatch, one_token_submit)


def routes(client: TestClient) -> list[tuple[str, str]]:
    """(protocol, path) of every POST route that takes a JSON body."""
    model = client.app.state.ctx.model.model_id
    return [("tgi", route) for route in TGI_ROUTES] + [
        ("stop" if route == "stopInfer" else "kserve", f"/v2/models/{model}/{route}") for route in KSERVE_ROUTES
    ]


def assert_protocol_error(response: httpx.Response, protocol: str, statuses: set[int]) -> None:
    """A clear 4xx in the route's own format: TGI ``{"error", "error_type"}``, KServe ``{"error"}``."""
    assert response.status_code in statuses, (response.status_code, response.text)
    body = response.json()
    assert set(body) == ({"error", "error_type"} if protocol == "tgi" else {"error"}), body
    assert isinstance(body["error"], str) and body["error"]


VALIDATION = {"tgi": 422, "kserve": 400, "stop": 422}
BAD_BODIES = {
    "malformed-json": b'{"inputs": "hi", ',
    "not-an-object": b'[1, 2, 3]',
    "non-utf8": b'{"inputs": "\xff\xfe hi", "id": "\xff"}',
    "deep-json": b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "wrong-types": b'{"inputs": 5, "parameters": [], "id": 7, "text_input": {}, "outputs": "x"}',
    "empty": b"",
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_bodies_get_a_clear_4xx_in_the_protocol_format(small_body_client: TestClient, stand_in, name: str) -> None:
    for protocol, path in routes(small_body_client):
        response = small_body_client.post(path, content=BAD_BODIES[name], headers={"content-type": "application/json"})
        assert_protocol_error(response, protocol, {VALIDATION[protocol]})


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_max_request_length_is_413(small_body_client: TestClient, stand_in, chunked: bool) -> None:
    raw = json.dumps({"inputs": "a" * (1024 * 1024), "text_input": "a", "id": "x"}).encode()
    for protocol, path in routes(small_body_client):
        content = iter([raw[:1000], raw[1000:]]) if chunked else raw
        response = small_body_client.post(path, content=content, headers={"content-type": "application/json"})
        assert_protocol_error(response, protocol, {413})


@pytest.mark.parametrize("headers", [{"x-big": "a" * 1024 * 1024}, {f"x-h{i}": "a" * 10_000 for i in range(100)}],
                         ids=["one-of-1MB", "100-of-10kB"])
def test_headers_over_max_header_bytes_are_431(small_body_client: TestClient, stand_in,
                                               headers: dict[str, str]) -> None:
    """uvicorn's httptools parser takes headers of any size: the app bounds them (maxHeaderBytes, 32 KB)."""
    for protocol, path in routes(small_body_client):
        response = small_body_client.post(path, json={"inputs": "hi"}, headers=headers)
        assert_protocol_error(response, protocol, {431})
    openai = small_body_client.get("/v1/models", headers=headers)
    assert openai.status_code == 431 and openai.json()["error"]["code"] == "headers_too_large"
    assert small_body_client.get("/v1/models", headers={"x-fine": "a" * 30_000}).status_code == 200


def test_wrong_content_type(small_body_client: TestClient, stand_in) -> None:
    """TGI routes and stopInfer require JSON (415, as TGI). KServe routes also take binary tensors, so a body
    they cannot read is their 400, never a 5xx."""
    raw = json.dumps({"inputs": "hi"}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for protocol, path in routes(small_body_client):
            response = small_body_client.post(path, content=raw, headers={"content-type": content_type})
            assert_protocol_error(response, protocol, {400} if protocol == "kserve" else {415})


# ============================================================================ end to end: the cluster


class RedisServer:
    """A private redis-server without persistence (a restart loses everything), on a fixed port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 10, "redis-server to answer")
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


class Cluster:
    """A stack (workers and the main API pod) of one model plus extra API pods, over a private Redis.

    ``main``: the stack's pod (maxQueueSize 8, shutdownGraceSeconds 10, maxIterTimes 2000). ``strict``: the same
    model with e2eTimeout 1.5 s. ``idle``: a model no worker serves, with tokenTimeout 3 s, maxLinkNum 3,
    maxQueueSize 4. Tests that kill or stop processes put back what the next test needs.
    """

    IDLE_MODEL = "nobody-serves-this"

    def __init__(self, server: RedisServer, model_path: Path, log_dir: Path) -> None:
        self.server = server
        self.log_dir = log_dir
        # maxIterTimes above the default 512, so that requests meant to outlast a deadline or a disconnect
        # are not cut short by it.
        env = {"CLAIM_IDLE_SECONDS": "2", "MAX_QUEUE_SIZE": "8", "SHUTDOWN_GRACE_SECONDS": "10",
               "MAX_ITER_TIMES": "2000", "OMP_NUM_THREADS": "1"}
        self.stack: Stack = start_stack(server.url, model_path, log_dir, env, workers=2)
        self.main = self.stack.processes[-1]
        self.main_url = self.stack.base_url
        self.redis = redis.Redis.from_url(server.url)
        self.pods: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self._spawn_pod("strict", {"E2E_TIMEOUT": "1.5"})
        self._spawn_pod("idle", {"MODEL_NAME": self.IDLE_MODEL, "TOKEN_TIMEOUT": "3", "MAX_LINK_NUM": "3",
                                 "MAX_QUEUE_SIZE": "4"})

    @property
    def model(self) -> str:
        return self.stack.model_name

    def _spawn(self, module: str, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child has its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=log, stderr=log)
        self.stack.processes.insert(0 if module == "worker.main" else len(self.stack.processes), proc)
        return proc

    def _spawn_pod(self, name: str, overrides: dict[str, str]) -> None:
        port = free_port()
        proc = self._spawn("api.main", f"api-{name}", {**self.stack.env, "PORT": str(port), **overrides})
        self.pods[name] = (proc, f"http://127.0.0.1:{port}")

    def pod(self, name: str) -> str:
        """The base URL of an extra pod, once it serves HTTP."""
        proc, url = self.pods[name]

        def live() -> bool:
            assert proc.poll() is None, f"API pod {name} exited with {proc.returncode}"
            try:
                return httpx.get(f"{url}/v2/health/live", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(live, 90, f"API pod {name}", 0.2)
        return url

    def workers(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.stack.processes if p.args[-1] == "worker.main" and p.poll() is None]

    def consumer_of(self, proc: subprocess.Popen[bytes]) -> str:
        return keys.consumer_name("cpu", socket.gethostname(), proc.pid)

    def spawn_worker(self) -> subprocess.Popen[bytes]:
        proc = self._spawn("worker.main", f"worker-{len(self.stack.processes)}", self.stack.env)
        consumer = self.consumer_of(proc)

        def beating() -> bool:
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
            return self.redis.zscore(keys.heartbeats(self.model), consumer) is not None

        wait_for(beating, 90, "the new worker's heartbeat", 0.2)
        return proc

    def ensure_workers(self, count: int) -> list[subprocess.Popen[bytes]]:
        while len(self.workers()) < count:
            self.spawn_worker()
        return self.workers()

    def pending(self, request_id: str, model: str | None = None) -> dict[str, Any] | None:
        """The pending entry (consumer, times_delivered) of a request's job, None when no worker holds it."""
        model = model or self.model
        stream = keys.job_stream(model)
        for entry in self.redis.xpending_range(stream, keys.worker_group(model), "-", "+", 100):
            for _, fields in self.redis.xrange(stream, entry["message_id"], entry["message_id"]):
                if client_id(Job.model_validate_json(fields[keys.JOB_FIELD.encode()])) == request_id:
                    return entry
        return None

    def job_queued(self, request_id: str, model: str | None = None) -> bool:
        """Whether the request's job is still in the model's stream (queued or running)."""
        for _, fields in self.redis.xrange(keys.job_stream(model or self.model)):
            if client_id(Job.model_validate_json(fields[keys.JOB_FIELD.encode()])) == request_id:
                return True
        return False

    def control(self, request_id: str) -> Control | None:
        """The control message kept for the request's job, if any."""
        for key in self.redis.scan_iter(match=keys.control_key(self.model, f"{request_id}.*")):
            return Control.model_validate_json(self.redis.get(key))
        return None

    def holder(self, request_id: str) -> subprocess.Popen[bytes]:
        """The worker process running the request (consumer names end with the pid)."""
        entry = wait_for(lambda: self.pending(request_id), 30, f"a worker to take {request_id}")
        pid = int(entry["consumer"].decode().rsplit(":", 1)[1])
        [proc] = [p for p in self.workers() if p.pid == pid]
        return proc


def client_id(job: Job) -> str:
    """The client's request id of a job (the job's own id adds a nonce: api.pipeline.submit)."""
    return job.request_id.rsplit(".", 1)[0]


class RawEvents:
    """Watches what the workers publish for one request id, on any pod's channel (before de-duplication)."""

    def __init__(self, client: redis.Redis, request_id: str) -> None:
        self._pubsub = client.pubsub()
        self._pubsub.psubscribe(keys.events_channel("*", "*", f"{request_id}.*"))
        self._pubsub.get_message(timeout=1)
        self.events: list[TokenEvent | ErrorEvent] = []

    def drain(self, quiet: float = 0.05) -> list[TokenEvent | ErrorEvent]:
        """Every event so far: read until none came for ``quiet`` seconds."""
        while (message := self._pubsub.get_message(timeout=quiet)) is not None:
            if message["type"] == "pmessage":
                self.events.append(decode_event(message["data"]))
        return self.events

    def wait(self, count: int, timeout: float = 30) -> None:
        """Return as soon as ``count`` events came."""
        deadline = time.monotonic() + timeout
        while len(self.events) < count:
            assert time.monotonic() < deadline, f"only {len(self.events)} events after {timeout} s"
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None and message["type"] == "pmessage":
                self.events.append(decode_event(message["data"]))

    def close(self) -> None:
        self._pubsub.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not on PATH")
        pytest.skip("redis-server is not on PATH")
    server = RedisServer(tmp_path_factory.mktemp("redis-own"))
    server.start()
    running = None
    try:
        running = Cluster(server, tiny_model_path, tmp_path_factory.mktemp("cluster"))
        yield running
    finally:
        if running is not None:
            for proc in running.stack.processes:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
            if server.proc is not None and server.proc.poll() is not None:
                server.start()
            stop_stack(running.stack)
        server.kill()


def body(max_new_tokens: int, **parameters: Any) -> dict[str, Any]:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False, **parameters}}


class SSE:
    """A streaming TGI request read event by event (``data:`` lines), with a read timeout (never a hang)."""

    def __init__(self, url: str, payload: dict[str, Any], request_id: str | None = None, timeout: float = 30) -> None:
        headers = {"x-request-id": request_id} if request_id else {}
        self._client = httpx.Client(timeout=timeout)
        self.response = self._client.send(
            self._client.build_request("POST", url, json=payload, headers=headers), stream=True
        )
        if self.response.status_code != 200:
            self.response.read()
            raise AssertionError(f"stream refused: {self.response.status_code} {self.response.text}")
        self._lines = self.response.iter_lines()
        self.events: list[dict[str, Any]] = []

    def next(self) -> dict[str, Any] | None:
        """The next event, or None at the end of the stream."""
        for line in self._lines:
            if line.startswith("data:"):
                event = json.loads(line[len("data:"):])
                self.events.append(event)
                return event
        return None

    def read(self, count: int) -> None:
        for _ in range(count):
            assert self.next() is not None

    def rest(self) -> list[dict[str, Any]]:
        while self.next() is not None:
            pass
        self.close()
        return self.events

    def close(self) -> None:
        self.response.close()
        self._client.close()


def tokens_of(events: list[dict[str, Any]]) -> list[int]:
    return [e["token"]["id"] for e in events if "token" in e]


def uninterrupted(cluster: Cluster, max_new_tokens: int) -> dict[str, Any]:
    response = httpx.post(f"{cluster.main_url}/generate", json=body(max_new_tokens, details=True), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------------------- worker crash


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_worker_killed_mid_stream_the_stream_completes_exactly_once(cluster: Cluster) -> None:
    """kill -9 the worker running a stream: after claimIdleSeconds the other worker takes the job over and
    replays it from the start; the client sees every index once and the uninterrupted output."""
    cluster.ensure_workers(2)
    raw = RawEvents(cluster.redis, "crash-1")
    stream = SSE(f"{cluster.main_url}/generate_stream", body(200, details=True), "crash-1", timeout=60)
    stream.read(5)
    victim = cluster.holder("crash-1")
    victim.kill()
    victim.wait()
    events = stream.rest()
    wait_for(lambda: not cluster.job_queued("crash-1"), 10, "the job to be acknowledged")
    published = [e.index for e in raw.drain() if isinstance(e, TokenEvent)]
    raw.close()
    assert Counter(published)[0] == 2, "the job was not replayed by a second worker"
    assert sorted(set(published)) == list(range(200))
    reference = uninterrupted(cluster, 200)
    assert "error" not in events[-1], events[-1]
    assert len(events) == 200 and tokens_of(events) == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1]["generated_text"] == reference["generated_text"]
    assert events[-1]["details"]["generated_tokens"] == 200
    assert "".join(e["token"]["text"] for e in events) == reference["generated_text"]


# ---------------------------------------------------------------------------- client disconnect, stopInfer


def assert_cancelled(cluster: Cluster, request_id: str, raw: RawEvents, max_new_tokens: int) -> None:
    """The API published a cancel for the request and its worker dropped it long before it could finish."""
    wait_for(lambda: not cluster.job_queued(request_id), 10, "the job to be acknowledged and deleted")
    control = cluster.control(request_id)
    assert control is not None and control.action == "cancel"
    assert not cluster.redis.exists(keys.inflight_key(cluster.model, request_id))
    time.sleep(0.3)
    published = raw.drain()
    raw.close()
    assert published and all(isinstance(e, TokenEvent) and e.finish is None for e in published)
    # Both routes learn of the disconnect from the server at once (no polling): a handful of steps pass
    # (about 5 when the machine is quiet; the bound leaves room for a loaded CI machine).
    assert len(published) < max_new_tokens / 6, f"{len(published)} tokens were computed"


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_stream_client_disconnect_cancels_the_job(cluster: Cluster) -> None:
    cluster.ensure_workers(1)
    raw = RawEvents(cluster.redis, "gone-stream")
    stream = SSE(f"{cluster.main_url}/generate_stream", body(1000), "gone-stream")
    stream.read(3)
    stream.close()
    assert_cancelled(cluster, "gone-stream", raw, 1000)


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_non_stream_client_disconnect_cancels_the_job(cluster: Cluster) -> None:
    cluster.ensure_workers(1)
    raw = RawEvents(cluster.redis, "gone-plain")
    payload = json.dumps(body(1000)).encode()
    port = int(cluster.main_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-request-id: gone-plain\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        raw.wait(3)
    assert_cancelled(cluster, "gone-plain", raw, 1000)


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_request_id_is_unique_while_in_flight_and_reusable_after(cluster: Cluster) -> None:
    """A second request with an id in flight is a validation error; once it ended (here: its client left
    and it was cancelled, or stopped) the id can be used again and the new request runs in full."""
    cluster.ensure_workers(1)
    stream = SSE(f"{cluster.main_url}/generate_stream", body(200), "same-id")
    stream.read(1)
    duplicate = httpx.post(f"{cluster.main_url}/generate", json=body(2), headers={"x-request-id": "same-id"})
    assert duplicate.status_code == 422 and duplicate.json()["error_type"] == "validation"
    stream.close()
    wait_for(lambda: not cluster.redis.exists(keys.inflight_key(cluster.model, "same-id")), 10, "the id's release")
    again = httpx.post(f"{cluster.main_url}/generate", json=body(12, details=True),
                       headers={"x-request-id": "same-id"}, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["details"]["generated_tokens"] == 12  # the old request's cancel does not apply


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_stop_infer_on_a_tgi_stream(cluster: Cluster) -> None:
    """``POST /v2/models/{m}/stopInfer`` with a TGI request's ``x-request-id``: 200 echo, and the stream
    ends with finish_reason ``stop_sequence`` and the text so far; unknown ids are 404, malformed 422."""
    cluster.ensure_workers(1)
    stop_url = f"{cluster.main_url}/v2/models/{cluster.model}/stopInfer"
    stream = SSE(f"{cluster.main_url}/generate_stream", body(400, details=True), "stop-me")
    stream.read(3)
    response = httpx.post(stop_url, json={"id": "stop-me"})
    assert response.status_code == 200 and response.json() == {"id": "stop-me"}
    events = stream.rest()
    last = events[-1]
    assert last["details"]["finish_reason"] == "stop_sequence", last
    assert 3 <= last["details"]["generated_tokens"] == len(events) < 400
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    unknown = httpx.post(stop_url, json={"id": "stop-me"})  # finished: no longer in flight
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    for bad in ({"id": "no spaces!"}, {"id": ""}, {"id": "x" * 257}, {"id": 5}, {}):
        malformed = httpx.post(stop_url, json=bad)
        assert malformed.status_code == 422 and set(malformed.json()) == {"error"}, (bad, malformed.text)
    assert httpx.post(f"{cluster.main_url}/v2/models/other/stopInfer", json={"id": "a"}).status_code == 404


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_stop_infer_on_a_kserve_infer_request(cluster: Cluster) -> None:
    """The KServe body's ``id`` names the request: a stopped infer answers 200 with the tokens so far."""
    cluster.ensure_workers(1)
    raw = RawEvents(cluster.redis, "k-stop")
    infer = {"id": "k-stop", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 50, 60],
                                         "parameters": {"max_new_tokens": 400}}], "outputs": [{"name": "output0"}]}
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{cluster.main_url}/v2/models/{cluster.model}/infer", json=infer, timeout=60)))
    thread.start()
    raw.wait(3)
    stop = httpx.post(f"{cluster.main_url}/v2/models/{cluster.model}/stopInfer", json={"id": "k-stop"})
    assert stop.status_code == 200
    thread.join(60)
    raw.close()
    response = result["r"]
    assert response.status_code == 200, response.text
    data = response.json()["outputs"][0]["data"]
    assert data[:3] == [1, 50, 60] and 3 + 3 <= len(data) < 3 + 400


# ---------------------------------------------------------------------------- timeouts


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_token_timeout_without_a_worker(cluster: Cluster) -> None:
    """No worker serves the model: after tokenTimeout a non-stream request is 500 incomplete_generation
    (TGI) or 500 (KServe), a stream gets a final SSE error event. Nothing hangs."""
    url = cluster.pod("idle")
    cluster.redis.delete(keys.job_stream(Cluster.IDLE_MODEL))
    infer = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 5]}],
             "outputs": [{"name": "output0"}]}

    async def run() -> tuple[httpx.Response, httpx.Response, list[dict[str, Any]], float]:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            async def stream() -> list[dict[str, Any]]:
                async with client.stream("POST", "/generate_stream", json=body(5)) as response:
                    assert response.status_code == 200
                    return [json.loads(line[5:]) async for line in response.aiter_lines() if line.startswith("data:")]

            started = time.monotonic()
            tgi, kserve, events = await asyncio.gather(
                client.post("/generate", json=body(5)),
                client.post(f"/v2/models/{Cluster.IDLE_MODEL}/infer", json=infer),
                stream(),
            )
            return tgi, kserve, events, time.monotonic() - started

    tgi, kserve, events, elapsed = asyncio.run(run())
    assert 2.5 < elapsed < 10
    assert tgi.status_code == 500 and tgi.json()["error_type"] == "incomplete_generation", tgi.text
    assert "tokenTimeout" in tgi.json()["error"]
    assert kserve.status_code == 500 and set(kserve.json()) == {"error"}, kserve.text
    assert len(events) == 1 and events[0]["error_type"] == "incomplete_generation", events
    cluster.redis.delete(keys.job_stream(Cluster.IDLE_MODEL))


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_e2e_timeout_mid_stream_and_the_worker_drops_the_request(cluster: Cluster) -> None:
    """e2eTimeout 1.5 s on a stream that needs longer: tokens, then a final error event; the worker stops
    computing it (cancelled by the API, or dropped at its deadline) and acknowledges the job."""
    cluster.ensure_workers(1)
    url = cluster.pod("strict")
    raw = RawEvents(cluster.redis, "e2e-1")
    started = time.monotonic()
    events = SSE(f"{url}/generate_stream", body(1500), "e2e-1").rest()  # several seconds of work
    elapsed = time.monotonic() - started
    assert 1.4 < elapsed < 6, elapsed
    assert events[-1]["error_type"] == "incomplete_generation" and "e2eTimeout" in events[-1]["error"]
    assert len(events) > 1, "no token arrived before the deadline"
    wait_for(lambda: not cluster.job_queued("e2e-1"), 5, "the job to be dropped")
    published = raw.drain(quiet=0.3)
    raw.close()
    assert not any(isinstance(e, TokenEvent) and e.finish is not None for e in published)


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_job_that_waited_past_its_deadline_is_not_started(cluster: Cluster) -> None:
    """While every worker is stopped (SIGSTOP) a request times out (500); when they resume, the job is
    acknowledged with an error event instead of being computed."""
    workers = cluster.ensure_workers(1)
    url = cluster.pod("strict")
    raw = RawEvents(cluster.redis, "late-1")
    for proc in workers:
        proc.send_signal(signal.SIGSTOP)
    try:
        response = httpx.post(f"{url}/generate", json=body(5), headers={"x-request-id": "late-1"}, timeout=20)
        assert response.status_code == 500 and response.json()["error_type"] == "incomplete_generation"
        assert cluster.job_queued("late-1")
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGCONT)
    wait_for(lambda: not cluster.job_queued("late-1"), 15, "the late job to be acknowledged")
    published = raw.drain(quiet=0.3)
    raw.close()
    assert len(published) == 1 and isinstance(published[0], ErrorEvent), published
    assert "before a worker could start it" in published[0].message


# ---------------------------------------------------------------------------- backpressure


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_full_queue_is_429_on_tgi_routes_and_503_on_kserve(cluster: Cluster) -> None:
    """maxQueueSize counts the model's jobs queued or running, from every pod: past it, requests are
    refused at once, before any stream starts."""
    url = cluster.pod("idle")
    stream_key = keys.job_stream(Cluster.IDLE_MODEL)
    cluster.redis.delete(stream_key)
    for _ in range(4):  # four jobs queued by other pods
        cluster.redis.xadd(stream_key, {keys.JOB_FIELD: "{}"})
    infer = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 5]}],
             "outputs": [{"name": "output0"}]}
    try:
        for route in ("/", "/generate", "/generate_stream"):
            started = time.monotonic()
            response = httpx.post(f"{url}{route}", json={**body(5), "stream": route == "/"}, timeout=10)
            assert time.monotonic() - started < 2
            assert response.status_code == 429, response.text
            assert response.json()["error_type"] == "overloaded" and "maxQueueSize" in response.json()["error"]
        for route, payload in (("infer", infer), ("generate", {"text_input": "hi"})):
            response = httpx.post(f"{url}/v2/models/{Cluster.IDLE_MODEL}/{route}", json=payload, timeout=10)
            assert response.status_code == 503 and set(response.json()) == {"error"}, response.text
    finally:
        cluster.redis.delete(stream_key)


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_max_link_num_per_pod_is_429(cluster: Cluster) -> None:
    """maxLinkNum 3: a fourth concurrent request on the pod is refused at once; finished requests free their
    place (the three waiting ones time out after tokenTimeout 3 s, then a request is accepted again)."""
    url = cluster.pod("idle")
    cluster.redis.delete(keys.job_stream(Cluster.IDLE_MODEL))

    async def run() -> tuple[list[int], httpx.Response, int]:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            waiting = [asyncio.create_task(client.post("/generate", json=body(5))) for _ in range(3)]
            await asyncio.sleep(1.0)
            refused = await client.post("/generate", json=body(5))
            statuses = [r.status_code for r in await asyncio.gather(*waiting)]
            again = await client.post("/generate", json=body(5))
            return statuses, refused, again.status_code

    statuses, refused, again = asyncio.run(run())
    assert refused.status_code == 429 and "maxLinkNum" in refused.json()["error"], refused.text
    assert statuses == [500, 500, 500] and again == 500  # accepted, then timed out: nobody serves this model
    cluster.redis.delete(keys.job_stream(Cluster.IDLE_MODEL))


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


FLOOD_REQUESTS = 2000
FLOOD_CONCURRENCY = 200


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_flood_is_answered_with_200_or_429_and_bounded_memory(cluster: Cluster) -> None:
    """Thousands of requests at once against one pod with maxQueueSize 8: every one is answered, 200 or
    429, none 5xx, none hangs; the processes' peak memory stays bounded."""
    workers = cluster.ensure_workers(1)

    async def run() -> tuple[Counter[Any], float]:
        # A connection per request: a reused keep-alive connection can be closed by the server's keep-alive
        # timeout just as the next request goes out, a client-side race that is no answer of the server's.
        limits = httpx.Limits(max_connections=FLOOD_CONCURRENCY, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=cluster.main_url, timeout=30, limits=limits,
                                     headers={"connection": "close"}) as client:
            gate = asyncio.Semaphore(FLOOD_CONCURRENCY)

            async def one(i: int) -> Any:
                async with gate:
                    try:
                        response = await client.post("/generate", json={"inputs": f"flood {i}",
                                                                          "parameters": {"max_new_tokens": 1}})
                        return response.status_code
                    except httpx.HTTPError as exc:
                        return type(exc).__name__

            started = time.monotonic()
            statuses = Counter(await asyncio.gather(*(one(i) for i in range(FLOOD_REQUESTS))))
            return statuses, time.monotonic() - started

    statuses, elapsed = asyncio.run(run())
    api_rss = peak_rss_mib(cluster.main.pid)
    worker_rss = max(peak_rss_mib(p.pid) for p in workers)
    print(f"\nflood: {FLOOD_REQUESTS} requests, {FLOOD_CONCURRENCY} concurrent, {elapsed:.1f} s, "
          f"statuses {dict(statuses)}; peak RSS: API {api_rss:.0f} MiB, worker {worker_rss:.0f} MiB")
    assert sum(statuses.values()) == FLOOD_REQUESTS
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 0 and statuses[429] > 0
    assert elapsed < 90
    assert api_rss < 1024 and worker_rss < 2048
    assert httpx.post(f"{cluster.main_url}/generate", json=body(3), timeout=30).status_code == 200


# ---------------------------------------------------------------------------- graceful shutdown of a worker


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_sigterm_worker_finishes_its_request_and_takes_no_new_one(cluster: Cluster) -> None:
    """SIGTERM to the worker running a stream: it takes no new job, finishes the stream (complete output),
    acknowledges it and exits 0; the job queued meanwhile waits for another worker."""
    for extra in cluster.workers()[1:]:
        extra.terminate()
        extra.wait(30)
    [worker] = cluster.ensure_workers(1)
    reference = uninterrupted(cluster, 120)
    stream = SSE(f"{cluster.main_url}/generate_stream", body(120, details=True), "term-1", timeout=60)
    stream.read(3)
    assert cluster.holder("term-1") is worker
    worker.terminate()
    time.sleep(0.3)
    later: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: later.update(r=httpx.post(
        f"{cluster.main_url}/generate", json=body(4), headers={"x-request-id": "term-2"}, timeout=120)))
    thread.start()
    events = stream.rest()
    assert worker.wait(30) == 0
    assert tokens_of(events) == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1]["generated_text"] == reference["generated_text"]
    assert not cluster.job_queued("term-1")
    # the request may reach the queue only after the stream ended (the pod was busy relaying it)
    wait_for(lambda: cluster.job_queued("term-2"), 10, "term-2 to be queued")
    assert cluster.pending("term-2") is None, "the stopping worker took a job"
    cluster.spawn_worker()
    thread.join(60)
    assert later["r"].status_code == 200 and later["r"].json()["generated_text"] is not None


# ---------------------------------------------------------------------------- Redis restart


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_redis_restart_fails_in_flight_requests_then_service_resumes(cluster: Cluster) -> None:
    """Redis dies mid-request: a stream ends with an error event, a non-stream request gets an error
    status, promptly. Redis comes back empty on the same port: the relay and the workers reconnect (and
    recreate the consumer group) with backoff, and new requests are served."""
    cluster.ensure_workers(1)
    plain: dict[str, Any] = {}

    def post() -> None:
        started = time.monotonic()
        plain["r"] = httpx.post(f"{cluster.main_url}/generate", json=body(400), timeout=60)
        plain["elapsed"] = time.monotonic() - started

    stream = SSE(f"{cluster.main_url}/generate_stream", body(400), "redis-1", timeout=30)
    thread = threading.Thread(target=post)
    thread.start()
    stream.read(3)
    wait_for(lambda: cluster.redis.xpending(keys.job_stream(cluster.model), keys.worker_group(cluster.model))
             ["pending"] == 2, 30, "both jobs to run")
    cluster.server.kill()
    killed = time.monotonic()
    events = stream.rest()
    stream_elapsed = time.monotonic() - killed
    thread.join(30)
    assert events[-1].get("error_type") == "unavailable", events[-1]
    assert stream_elapsed < 5, f"the stream took {stream_elapsed:.1f} s to end"
    assert plain["r"].status_code == 424 and plain["r"].json()["error_type"] == "unavailable", plain["r"].text
    cluster.server.start()

    restarted = time.monotonic()

    def served(url: str) -> bool:
        try:
            return httpx.post(f"{url}/generate", json=body(3), timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    for url in (cluster.main_url, cluster.pod("strict")):  # every pod's relay, and the worker, reconnect
        wait_for(functools.partial(served, url), 30, f"{url} to serve again", 0.5)
    print(f"\nserved again {time.monotonic() - restarted:.1f} s after Redis restarted")
    reference = uninterrupted(cluster, 16)
    events = SSE(f"{cluster.main_url}/generate_stream", body(16), "redis-2").rest()
    assert tokens_of(events) == [t["id"] for t in reference["details"]["tokens"]]
    wait_for(lambda: cluster.redis.xlen(keys.job_stream(cluster.model)) == 0, 10, "every job to be acknowledged")


class Publishes:
    """Counts what the workers PUBLISH to one request's channels, watched with MONITOR: a subscription would be a
    receiver, and a worker goes on computing a request whose events someone receives."""

    def __init__(self, url: str, request_id: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._monitor = self._client.monitor().__enter__()
        self._needle = f":{request_id}."
        self.count = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for command in self._monitor.listen():
                words = command["command"].split(" ", 2)
                if words[0] == "PUBLISH" and self._needle in words[1]:
                    self.count += 1
        except (redis.ConnectionError, OSError, ValueError):
            pass  # closed

    def close(self) -> None:
        self._monitor.connection.disconnect()
        self._reader.join(5)
        self._client.close()


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_a_request_the_pod_gave_up_on_is_not_computed_when_redis_comes_back(cluster: Cluster) -> None:
    """Redis restarts with its data (AOF, a failover, a network blip): the pod fails its stream at once and cannot
    cancel the job while Redis is away. When everything reconnects the pod subscribes under a new generation, so
    the worker's next PUBLISH of that job reaches nobody and it drops the job: a handful of tokens, not the 1900
    the job asked for (before: the pod re-subscribed the same pattern and the job ran to its end)."""
    cluster.ensure_workers(1)
    stream = SSE(f"{cluster.main_url}/generate_stream", body(1900), "given-up", timeout=30)
    stream.read(3)
    wait_for(lambda: cluster.pending("given-up"), 10, "the job to run")
    cluster.redis.shutdown(save=True)  # keeps the data: streams, the consumer group, the pending job
    assert cluster.server.proc is not None
    cluster.server.proc.wait(10)
    events = stream.rest()
    assert events[-1].get("error_type") == "unavailable", events[-1]
    time.sleep(2)  # the pod's clean-up (the cancel) finds no Redis
    try:
        cluster.server.start()
        assert cluster.job_queued("given-up")  # the data came back
        publishes = Publishes(cluster.server.url, "given-up")
        try:
            wait_for(lambda: not cluster.job_queued("given-up"), 30, "the worker to drop the job nobody waits for")
            time.sleep(0.5)
            assert publishes.count < 20, f"{publishes.count} tokens were computed for nobody"
        finally:
            publishes.close()
        assert httpx.post(f"{cluster.main_url}/generate", json=body(3), timeout=30).status_code == 200
    finally:
        (cluster.server.workdir / "dump.rdb").unlink(missing_ok=True)  # later restarts come back empty


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_a_worker_keeps_its_requests_through_a_redis_freeze(cluster: Cluster) -> None:
    """Redis stops answering for 6 s mid-stream (SIGSTOP) and comes back: the worker neither drops nor silently
    abandons its running request: the stream goes on and ends exactly as an uninterrupted run."""
    cluster.ensure_workers(1)
    reference = uninterrupted(cluster, 120)
    stream = SSE(f"{cluster.main_url}/generate_stream", body(120), "frozen", timeout=60)
    stream.read(3)
    assert cluster.server.proc is not None
    cluster.server.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(6)
    finally:
        cluster.server.proc.send_signal(signal.SIGCONT)
    events = stream.rest()
    assert "error" not in events[-1], events[-1]
    assert tokens_of(events) == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1]["generated_text"] == reference["generated_text"]


# ---------------------------------------------------------------------------- API pods dying


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_api_pod_killed_its_requests_are_dropped_at_once(cluster: Cluster) -> None:
    """kill -9 an API pod with 10 open streams of 1900 tokens: its clients lose their streams, and the worker,
    whose PUBLISHes reach nobody any more, drops the 10 requests at once (acknowledged, out of the stream)
    instead of computing some 19,000 tokens for nobody. A pod started again (a new pod id) brings none of
    them back; the other pods are unaffected."""
    cluster.ensure_workers(1)
    cluster._spawn_pod("doomed", {"MAX_QUEUE_SIZE": "32"})
    url = cluster.pod("doomed")
    ids = [f"orphan-{i}" for i in range(10)]
    streams = [SSE(f"{url}/generate_stream", body(1900), request_id) for request_id in ids]
    for stream in streams:
        stream.read(1)
    proc, _ = cluster.pods.pop("doomed")
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    for stream in streams:
        with pytest.raises(httpx.HTTPError):
            stream.rest()
    wait_for(lambda: not any(cluster.job_queued(request_id) for request_id in ids), 10, "the orphaned jobs to end")
    assert time.monotonic() - killed < 3, "the worker went on computing for the killed pod"
    cluster._spawn_pod("doomed", {})
    cluster.pod("doomed")
    assert not any(cluster.job_queued(request_id) for request_id in ids)
    assert httpx.post(f"{cluster.main_url}/generate", json=body(3), timeout=30).status_code == 200


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_streams_cut_at_shutdown_end_with_an_error_event(cluster: Cluster) -> None:
    """SIGTERM to a pod with shutdownGraceSeconds 2 and streams that need far longer: when the grace runs out each
    stream's last event is an error (``stopping``), never a clean end that looks complete, a non-stream request gets
    an error status, and the worker drops their jobs."""
    cluster.ensure_workers(1)
    cluster._spawn_pod("short-grace", {"SHUTDOWN_GRACE_SECONDS": "2", "MAX_QUEUE_SIZE": "32"})
    url = cluster.pod("short-grace")
    streams = [SSE(f"{url}/generate_stream", body(1900), f"cut-{i}", timeout=30) for i in range(3)]
    plain: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: plain.update(r=httpx.post(
        f"{url}/generate", json=body(1900), headers={"x-request-id": "cut-plain"}, timeout=30)))
    thread.start()
    for stream in streams:
        stream.read(2)
    wait_for(lambda: cluster.pending("cut-plain"), 10, "the non-stream request to run")
    proc, _ = cluster.pods.pop("short-grace")
    proc.terminate()
    started = time.monotonic()
    for stream in streams:
        events = stream.rest()
        assert events[-1].get("error_type") == "stopping", events[-1]
        assert "shutdownGraceSeconds 2" in events[-1]["error"]
    thread.join(30)
    assert plain["r"].json()["error_type"] == "stopping", plain["r"].text
    assert time.monotonic() - started < 2 + 3
    assert proc.wait(20) in (0, -signal.SIGTERM)
    ids = ["cut-plain", *(f"cut-{i}" for i in range(3))]
    wait_for(lambda: not any(cluster.job_queued(request_id) for request_id in ids), 10, "the cut jobs to end")


@pytest.mark.integration  # a stack of processes on a Redis of its own
def test_sigterm_api_pod_finishes_open_streams_then_exits(cluster: Cluster) -> None:
    """SIGTERM to the API pod with an open stream: the stream runs to its end (within
    shutdownGraceSeconds) and the process exits 0. Runs last: the pod is gone afterwards."""
    cluster.ensure_workers(1)
    reference = uninterrupted(cluster, 100)
    stream = SSE(f"{cluster.main_url}/generate_stream", body(100), "api-term", timeout=30)
    stream.read(3)
    cluster.main.terminate()
    started = time.monotonic()
    events = stream.rest()
    assert tokens_of(events) == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1]["generated_text"] == reference["generated_text"]
    # uvicorn re-raises the signal once it has shut down gracefully: the exit status is SIGTERM's.
    assert cluster.main.wait(20) in (0, -signal.SIGTERM)
    assert time.monotonic() - started < 10 + 5
    assert "Application shutdown complete" in (cluster.log_dir / "api.log").read_text()
