"""Ferry on a Redis Cluster (``redisCluster``) of three masters (:mod:`tests.redis_cluster`; the integration
suites also run on one: conftest's ``stack`` fixture).

Every protocol, a stop order, the LoRA registry and ``ferry-status`` run there; a worker killed mid-stream is
taken over by the other; a slot migration and a master killed mid-load end the requests they cut off with an
``unavailable`` error at once, and service resumes on the new topology.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.crc import key_slot

from common import keys
from common.settings import Settings
from tests.helpers import Stack, start_stack, stop_stack, wait_for
from tests.redis_cluster import ThreeMasters
from tests.redis_cluster import three_masters as make_three_masters
from tests.stack_checks import check_every_protocol, check_ferry_status, check_stop_order_and_lora_registry

pytestmark = pytest.mark.integration  # the servers and Redis here run as processes


@pytest.fixture(scope="module")
def three_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeMasters]:
    """A cluster of this module's own: its tests kill masters and move slots."""
    with make_three_masters(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster_stack(three_masters: ThreeMasters, tiny_model_path: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"REDIS_CLUSTER": "true", "CLAIM_IDLE_SECONDS": "2", "MAX_ITER_TIMES": "2000",
           "LORA_ADAPTER_ROOTS": str(tmp_path_factory.getbasetemp())}  # the tests' adapters (stack_checks)
    running = start_stack(three_masters.url, tiny_model_path, tmp_path_factory.mktemp("cluster-stack"), env, workers=2)
    yield running
    stop_stack(running)


def generate(stack: Stack, max_new_tokens: int, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/generate", timeout=timeout,
                      json={"inputs": "def main(", "parameters": {"max_new_tokens": max_new_tokens, "details": True}})


class Stream:
    """A TGI stream read event by event in the test's thread."""

    def __init__(self, stack: Stack, max_new_tokens: int, request_id: str) -> None:
        self._client = httpx.Client(timeout=30)
        self._response = self._client.send(self._client.build_request(
            "POST", f"{stack.base_url}/generate_stream", headers={"x-request-id": request_id},
            json={"inputs": "def main(", "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
        ), stream=True)
        assert self._response.status_code == 200
        self._lines = self._response.iter_lines()
        self.events: list[dict[str, Any]] = []

    def read(self, count: int | None = None) -> list[dict[str, Any]]:
        """``count`` more events, or all of them to the end of the stream."""
        for line in self._lines:
            if line.startswith("data:"):
                self.events.append(json.loads(line[len("data:"):]))
                if count is not None and len(self.events) >= count:
                    return self.events
        self._response.close()
        self._client.close()
        return self.events


def pod_channels_owner(three_masters: ThreeMasters) -> int:
    """The port of the master holding the API pod's request channels (found while a request is in flight)."""
    for port in three_masters.ports:
        if redis.Redis(port=port).pubsub_shardchannels("ferry:events:*"):
            return port
    raise AssertionError("no shard holds the pod's request channel")


def test_a_model_s_keys_share_one_slot_and_a_pod_s_channels_another() -> None:
    model = "org/llama-7b"
    names = [*keys.job_streams(model), keys.worker_group(model), keys.heartbeats(model), keys.worker_status(model, "c"),
             keys.control_channel(model), keys.control_key(model, "r"), keys.inflight_key(model, "r"),
             keys.adapters_key(model), keys.media_key(model, "r", 0)]
    assert {key_slot(name.encode()) for name in names} == {key_slot(b"org/llama-7b")}
    assert {keys.model_in_key(stream) for stream in keys.job_streams(model)} == {model}
    channels = [keys.events_channel("pod1", 1, f"req{i}") for i in range(20)]
    assert {key_slot(name.encode()) for name in channels} == {key_slot(b"pod1")}
    with pytest.raises(ValueError, match="must not contain braces"):
        Settings(model_path=Path("unused"), model_name="a{b}")


def test_every_protocol_on_a_cluster(cluster_stack: Stack) -> None:
    check_every_protocol(cluster_stack)


def test_a_stop_order_and_the_lora_registry_on_a_cluster(cluster_stack: Stack, tiny_model_path: Path,
                                                         tmp_path: Path) -> None:
    check_stop_order_and_lora_registry(cluster_stack, tiny_model_path, tmp_path)


def test_ferry_status_on_a_cluster(cluster_stack: Stack) -> None:
    check_ferry_status(cluster_stack.env, cluster_stack.model_name, workers=2)


def test_worker_killed_mid_stream_is_taken_over_on_a_cluster(cluster_stack: Stack,
                                                             three_masters: ThreeMasters) -> None:
    """kill -9 the worker running a stream: after claimIdleSeconds the other worker takes the job over from the
    model's shard and replays it; the client gets the uninterrupted output, each token once."""
    reference = generate(cluster_stack, 120).json()
    stream = Stream(cluster_stack, 120, "cluster-crash")
    stream.read(5)
    client = three_masters.client()
    pending = client.xpending_range(keys.job_stream(cluster_stack.model_name),
                                    keys.worker_group(cluster_stack.model_name), "-", "+", 10)
    _, _, pid = keys.parse_consumer_name(pending[0]["consumer"].decode())
    victim = next(proc for proc in cluster_stack.processes if proc.pid == pid)
    victim.kill()
    victim.wait()
    events = stream.read()
    assert "error" not in events[-1], events[-1]
    assert [event["token"]["id"] for event in events] == [token["id"] for token in reference["details"]["tokens"]]
    assert events[-1]["generated_text"] == reference["generated_text"]
    cluster_stack.processes.remove(victim)


def test_a_slot_migration_ends_the_requests_it_cuts_off_then_service_resumes(
        cluster_stack: Stack, three_masters: ThreeMasters) -> None:
    """Moving the slot of the pod's request channels to another master ends their subscriptions (Redis says so):
    the stream in flight ends with ``unavailable``, and the pod subscribes on the slot's new owner."""
    stream = Stream(cluster_stack, 1500, "cluster-migrate")
    stream.read(3)
    source = pod_channels_owner(three_masters)
    target = next(port for port in three_masters.ports if port != source)
    channel = redis.Redis(port=source).pubsub_shardchannels("ferry:events:*")[0]
    slot = key_slot(channel)
    target_id = redis.Redis(port=target).cluster("myid")
    for port in (target, source, *three_masters.ports):  # the new owner first, as redis-cli --cluster reshard does
        redis.Redis(port=port).cluster("setslot", slot, "node", target_id)
    events = stream.read()
    assert events[-1].get("error_type") == "unavailable", events[-1]
    answer = wait_for(lambda: generate(cluster_stack, 4).status_code == 200, 30, "the pod to serve again")
    assert answer
    assert three_masters.owner(channel.decode()) == target


def test_a_master_killed_mid_load_fails_its_requests_then_service_resumes(
        cluster_stack: Stack, three_masters: ThreeMasters) -> None:
    """kill -9 the master of the model's keys with a stream and a plain request running: both end at once with
    ``unavailable`` (from the worker, through the shard of the pod's channels, or from the pod's relay when that
    is the shard that died), new requests get a 424 ``unavailable``; the master restarted, empty, rejoins with its
    slots, the workers make their consumer group again, and requests are served."""
    victim = three_masters.owner(keys.job_stream(cluster_stack.model_name))
    stream = Stream(cluster_stack, 1500, "cluster-kill")
    stream.read(3)
    plain: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: plain.update(r=generate(cluster_stack, 1500)))
    thread.start()
    wait_for(lambda: redis.Redis(port=victim).xlen(keys.job_stream(cluster_stack.model_name)) == 2, 30,
             "both requests to be queued")
    three_masters.kill(victim)
    killed = time.monotonic()
    events = stream.read()
    thread.join(30)
    assert events[-1].get("error_type") == "unavailable", events[-1]
    assert plain["r"].status_code == 424 and plain["r"].json()["error_type"] == "unavailable", plain["r"].text
    assert time.monotonic() - killed < 15
    refused = generate(cluster_stack, 4, timeout=30)
    assert refused.status_code in (424, 503) and refused.json()["error_type"] == "unavailable", refused.text
    three_masters.start(victim)
    wait_for(three_masters.healthy, 30, "the master to rejoin")
    wait_for(lambda: generate(cluster_stack, 4).status_code == 200, 60, "the stack to serve again")
    check_every_protocol(cluster_stack)
