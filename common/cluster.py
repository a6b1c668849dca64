"""What Redis tells about a deployment: per model, its live workers (with what each reports) and its queue.

One reader for the API's ``/health`` and ``/metrics`` and for ``ferry-status``, so they never disagree.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, Field, ValidationError, computed_field

from common import keys
from common.connection import AsyncRedis
from common.protocol import WorkerStatus


class WorkerView(BaseModel):
    """A live worker: its consumer name's parts and its last reported status (None before the first)."""

    consumer: str
    pool: str
    host: str
    pid: int
    heartbeat_expires_in: float = Field(description="seconds until the worker counts as dead")
    status: WorkerStatus | None


class ModelState(BaseModel):
    model: str
    queue_depth: int = Field(description="jobs queued or running (the XLEN of its job streams, summed)")
    workers: list[WorkerView]

    # computed_field over property: mypy refuses any decorator on a property; pydantic documents this ignore
    @computed_field  # type: ignore[prop-decorator]
    @property
    def pools(self) -> dict[str, int]:
        """Live workers per pool."""
        return dict(Counter(worker.pool for worker in self.workers))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def batch_size(self) -> int:
        """Requests running, summed over the live workers' last reports."""
        return sum(worker.status.batch_size for worker in self.workers if worker.status is not None)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kv_reserved_tokens(self) -> int:
        """KV budget held by running requests, summed over the live workers' last reports."""
        return sum(worker.status.kv_reserved_tokens for worker in self.workers if worker.status is not None)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kv_budget_tokens(self) -> int:
        """KV budget (maxBatchTotalTokens), summed over the live workers' last reports."""
        return sum(worker.status.kv_budget_tokens for worker in self.workers if worker.status is not None)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def waiting(self) -> int:
        """Requests queued and not running: the jobs of the streams less those the workers report running (a
        stream holds a job until it ends; a worker's report may be up to a heartbeat old, hence the floor)."""
        return max(self.queue_depth - self.batch_size, 0)


async def live_workers(redis: AsyncRedis, model: str, now: float) -> int:
    """Workers whose heartbeat has not expired (see :func:`common.keys.heartbeats`): the pipeline's readiness
    check, cheaper than :func:`read_model_state`."""
    return await redis.zcount(keys.heartbeats(model), now, "+inf")


async def read_model_state(redis: AsyncRedis, model: str, now: float) -> ModelState:
    """The model's live workers and queue depth (raises RedisError when Redis is unreachable)."""
    pipe = redis.pipeline(transaction=False)
    pipe.zrangebyscore(keys.heartbeats(model), now, "+inf", withscores=True)
    for stream in keys.job_streams(model):
        pipe.xlen(stream)
    beats, *depths = await pipe.execute()
    consumers = [(member.decode() if isinstance(member, bytes) else member, score) for member, score in beats]
    raw = await redis.mget([keys.worker_status(model, consumer) for consumer, _ in consumers]) if consumers else []
    workers = []
    for (consumer, expires), status in zip(consumers, raw, strict=True):
        try:
            pool, host, pid = keys.parse_consumer_name(consumer)
        except ValueError:
            continue  # not a worker's consumer name
        workers.append(WorkerView(
            consumer=consumer, pool=pool, host=host, pid=pid, heartbeat_expires_in=expires - now,
            status=_status(status),
        ))
    return ModelState(model=model, queue_depth=sum(depths), workers=workers)


def _status(raw: bytes | str | None) -> WorkerStatus | None:
    if raw is None:
        return None
    try:
        return WorkerStatus.model_validate_json(raw)
    except ValidationError:  # a worker of another version
        return None


async def discover_models(redis: AsyncRedis) -> list[str]:
    """Every model with a job stream or workers' heartbeats in this Redis."""
    found = set()
    for pattern in (*keys.job_streams("*"), keys.heartbeats("*")):
        async for key in redis.scan_iter(match=pattern):
            found.add(keys.model_in_key(key.decode() if isinstance(key, bytes) else key))
    return sorted(found)
