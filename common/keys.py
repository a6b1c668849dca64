"""Every Redis key and channel name the system uses, in one place.

The braces are Redis Cluster hash tags: every key of a model hashes by the model's name alone, so they all sit
in one slot (one shard), multi-key commands and pipelines on them stay on one node, and different models
spread over the shards. A pod's request channels hash by the pod's id, so each pod's events go to one shard.

- ``ferry:{<model>}:jobs:<priority>`` (priority 1 to 4) and ``ferry:{<model>}:jobs`` (5, the default): the model's
  job streams, one per :data:`common.protocol.PRIORITIES` level. Each entry has one field, ``job``, the JSON of a
  :class:`common.protocol.Job`. Workers XACK and XDEL an entry when the request is done, so the streams'
  lengths sum to the number of requests queued or running (the API's queue bound), and a stream's entries
  that are not pending in the group are its jobs no worker has taken yet. Workers take a job from the most
  urgent stream holding one (:func:`job_streams`' order).
- ``ferry:{<model>}:workers``: the consumer group all workers of that model read from, on each job stream. A
  pool (cpu, cuda, npu) is a set of consumers in that group: a second group on the same stream would receive
  every job a second time, so pools of one model share the group and differ only in consumer names.
- ``ferry:{<model>}:heartbeats``: sorted set of the model's worker consumers, scored by the unix time
  their heartbeat expires; a worker is alive while its score is in the future.
- ``ferry:{<model>}:worker:{consumer}``: the JSON of a :class:`common.protocol.WorkerStatus` (batch size, KV
  budget used, ...), rewritten by the worker with every heartbeat and expiring with it; read by the API's
  metrics and ``ferry-status``.
- ``ferry:{<model>}:control``: pub/sub channel every worker of the model listens to for
  :class:`common.protocol.Control` messages (cancel a request whose client left, stop one on request).
- ``ferry:{<model>}:control:{request_id}``: the same control message kept as a key (with a TTL), for a
  worker that reads the job from the stream only after the message was published.
- ``ferry:{<model>}:inflight:{request_id}``: exists while the request is in flight (SET NX by the API
  pod that took it, with a TTL): client-chosen request ids are unique while in flight, and a stop
  request for an unknown id is answered 404. Its value is the job's id (the ``request_id`` of the
  :class:`common.protocol.Job`, which the control key, the control messages and the events channel use):
  the client's id plus a nonce, so nothing of an earlier request with the same client id reaches a new one.
- ``ferry:{<model>}:adapters``: hash of the model's LoRA adapters, name -> folder: the configured ones
  (``loraModules``, written by every API pod at start-up) and those loaded at run time
  (``/v1/load_lora_adapter``). API pods accept a request for an adapter only while it is here; workers load
  an adapter from the folder its job names the first time they see it, and free it after an
  ``unload_adapter`` control message once no running request uses it.
- ``ferry:{<model>}:unloaded-adapters``: set of the names of the model's adapters unloaded at run time: with
  one model served, the OpenAI routes take an unknown ``model`` for that model, but refuse one of these (404)
  while it is not in ``adapters`` again, so that a request for an unloaded adapter is not answered by the
  model without it.
- ``ferry:{<model>}:media:{request_id}:{n}``: the bytes of the request's n-th media item (multimodal list
  input), SET by the API pod before it queues the job (whose :class:`common.protocol.MediaRef` names the key)
  and deleted by that pod when the request ends; its TTL (e2eTimeout + 60 s) removes it if the pod dies first.
  Media never travels inside the job stream entry.
- ``ferry:events:{<api_id>}:<generation>:<request_id>``: the per-request pub/sub channel. Each API pod
  pattern-subscribes to ``ferry:events:{<api_id>}:<generation>:*`` when it connects, so it is subscribed to a
  request's channel before it queues the request's job and no first token can be missed. The generation counts
  the pod's subscriptions: when one breaks the pod fails every request waiting under it and subscribes anew under
  the next, so a worker's PUBLISH for a request the pod gave up on reaches no subscriber, whatever reconnects, and
  the worker drops it. In a Redis Cluster, where sharded pub/sub has no patterns, the pod SSUBSCRIBEs each
  request's channel (confirmed) before queueing its job instead (:mod:`api.relay`).
"""

from __future__ import annotations

from common.protocol import DEFAULT_PRIORITY, PRIORITIES

PREFIX = "ferry"
JOB_FIELD = "job"
# The least an ACL user of API pods, workers and ferry-status needs (README "Redis: TLS and ACL users"): the keys
# above, and the commands they run on them. Channels: all (&*), since Redis lets a client PSUBSCRIBE only a
# pattern an ACL channel pattern matches literally, and each pod's pattern names the pod (events_pattern). In a
# Redis Cluster the clients also read the slots (CLUSTER SLOTS) and the commands' key positions (COMMAND), and
# pub/sub is sharded (SPUBLISH, SSUBSCRIBE, SUNSUBSCRIBE).
ACL_RULES = (
    f"~{PREFIX}:* &* -@all +ping "
    "+eval +get +set +mget +del +exists +scan +hset +hsetnx +hget +hgetall +hexists +hdel +sadd +sismember "
    "+xadd +xlen +xreadgroup +xack +xdel +xgroup|create +xclaim +xautoclaim +xpending "
    "+zadd +zrem +zcount +zrangebyscore +zremrangebyscore "
    "+publish +subscribe +unsubscribe +psubscribe +punsubscribe +spublish +ssubscribe +sunsubscribe "
    "+cluster|slots +command"
)


def _model(model: str) -> str:
    """The prefix of a model's keys, hash-tagged by the model's name (a name holds no brace: Settings)."""
    return f"{PREFIX}:{{{model}}}"


def job_stream(model: str, priority: int = DEFAULT_PRIORITY) -> str:
    """The stream of the model's jobs of one priority."""
    stream = f"{_model(model)}:jobs"
    return stream if priority == DEFAULT_PRIORITY else f"{stream}:{priority}"


def job_streams(model: str) -> list[str]:
    """The model's job streams, the most urgent first (the order workers take jobs in)."""
    return [job_stream(model, priority) for priority in PRIORITIES]


def worker_group(model: str) -> str:
    return f"{_model(model)}:workers"


def consumer_name(pool: str, host: str, pid: int) -> str:
    return f"{pool}:{host}:{pid}"


def parse_consumer_name(consumer: str) -> tuple[str, str, int]:
    """(pool, host, pid) of a consumer name made by :func:`consumer_name` (a host name has no colon)."""
    pool, host, pid = consumer.rsplit(":", 2)
    return pool, host, int(pid)


def heartbeats(model: str) -> str:
    return f"{_model(model)}:heartbeats"


def worker_status(model: str, consumer: str) -> str:
    return f"{_model(model)}:worker:{consumer}"


def model_in_key(key: str) -> str:
    """The model in a :func:`job_stream` or :func:`heartbeats` key name (to discover a Redis's models)."""
    return key.removeprefix(f"{PREFIX}:{{").rsplit("}:", 1)[0]


def control_channel(model: str) -> str:
    return f"{_model(model)}:control"


def control_key(model: str, request_id: str) -> str:
    return f"{_model(model)}:control:{request_id}"


def inflight_key(model: str, request_id: str) -> str:
    return f"{_model(model)}:inflight:{request_id}"


def adapters_key(model: str) -> str:
    return f"{_model(model)}:adapters"


def unloaded_adapters_key(model: str) -> str:
    return f"{_model(model)}:unloaded-adapters"


def media_key(model: str, request_id: str, index: int) -> str:
    return f"{_model(model)}:media:{request_id}:{index}"


def events_pattern(api_id: str, generation: int | str) -> str:
    """The channels of one subscription of a pod (``generation`` "*": of all, for tools and tests)."""
    return f"{PREFIX}:events:{{{api_id}}}:{generation}:*"


def events_channel(api_id: str, generation: int | str, request_id: str) -> str:
    return f"{PREFIX}:events:{{{api_id}}}:{generation}:{request_id}"


def request_id_of(channel: str) -> str:
    """The request id at the end of an events channel name."""
    return channel.rsplit(":", 1)[1]
