"""How every process reaches Redis: one server, or a Redis Cluster (``redisCluster``), with the same code above.

In a cluster every key of a model is in one slot and a pod's request channels in another (the hash tags of
:mod:`common.keys`), so pipelines never span slots they cannot, and pub/sub is sharded (SPUBLISH /
SSUBSCRIBE): a message goes to the one shard that owns its channel instead of being broadcast to all of them.
On one server the same channels use plain PUBLISH, which the API pods' pattern subscription receives.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from redis.exceptions import RedisClusterException, RedisError

from common.settings import Settings

REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)
"""What a Redis command can raise when Redis or a shard of it is unreachable (redis-py's cluster errors that
concern the topology, such as a slot no live node covers, are not RedisErrors)."""

SyncRedis = redis.Redis | redis.RedisCluster
AsyncRedis = redis.asyncio.Redis | redis.asyncio.RedisCluster


def sync_client(settings: Settings, **options: Any) -> SyncRedis:
    """A blocking client (workers): one connection, or one per shard in a cluster."""
    if settings.redis_cluster:
        return redis.RedisCluster.from_url(settings.redis_url, **settings.redis_options, **options)
    return redis.Redis.from_url(settings.redis_url, **settings.redis_options, **options)


def async_client(settings: Settings, max_connections: int | None = None, pool_timeout: float | None = None,
                 **options: Any) -> AsyncRedis:
    """An asyncio client (API pods, ferry-status). ``max_connections`` bounds one server's pool, where a command
    waits up to ``pool_timeout`` for a free connection instead of failing. A cluster client opens connections to
    each node as its commands need them (redis-py's cluster pool fails a command past a bound, not waits)."""
    if settings.redis_cluster:
        return redis.asyncio.RedisCluster.from_url(settings.redis_url, **settings.redis_options, **options)
    if max_connections is None:
        return redis.asyncio.Redis.from_url(settings.redis_url, **settings.redis_options, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=pool_timeout, **settings.redis_options, **options
    )
    return redis.asyncio.Redis.from_pool(pool)


def publish(client: Any, sharded: bool, channel: str, message: str) -> Any:
    """PUBLISH, or SPUBLISH in a cluster, on a client or a pipeline (whose reply, the receivers, comes later)."""
    return (client.spublish if sharded else client.publish)(channel, message)
