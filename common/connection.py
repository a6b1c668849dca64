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
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from common.settings import Settings

REDIS_ERRORS = (RedisError, RedisClusterException)  # a tuple of known length: mypy checks `except (*REDIS_ERRORS, X)`
"""What a Redis command can raise when Redis or a shard of it is unreachable (redis-py's cluster errors that
concern the topology, such as a slot no live node covers, are not RedisErrors)."""

def as_text(reply: bytes | str) -> str:
    """A string reply as text: Ferry's clients get bytes (they do not set ``decode_responses``), which
    redis-py's types cannot tell from a client's options."""
    return reply.decode() if isinstance(reply, bytes) else reply


SyncRedis = redis.Redis | redis.RedisCluster
AsyncRedis = redis.asyncio.Redis | redis.asyncio.RedisCluster


def sync_client(settings: Settings, **options: Any) -> SyncRedis:
    """A blocking client (workers): one connection, or one per shard in a cluster."""
    if settings.redis_cluster:
        return redis.RedisCluster.from_url(settings.redis_url, **settings.redis_options, **options)
    return redis.Redis.from_url(settings.redis_url, **settings.redis_options, **options)


def async_client(settings: Settings, max_connections: int | None = None, pool_timeout: float | None = None,
                 cluster_connections: int | None = None, **options: Any) -> AsyncRedis:
    """An asyncio client (API pods, ferry-status). ``max_connections`` bounds one server's pool, where a command
    waits up to ``pool_timeout`` for a free connection instead of failing. A cluster client opens connections to
    each node as its commands need them, and redis-py's cluster pool fails a command past its bound instead of
    waiting: ``cluster_connections`` sets that bound (per node) where it is given."""
    if settings.redis_cluster:
        if cluster_connections is not None:
            options["max_connections"] = cluster_connections
        return redis.asyncio.RedisCluster.from_url(settings.redis_url, **settings.redis_options, **options)
    if max_connections is None:
        return redis.asyncio.Redis.from_url(settings.redis_url, **settings.redis_options, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=pool_timeout, **settings.redis_options, **options
    )
    return redis.asyncio.Redis.from_pool(pool)


def publish_command(sharded: bool, channel: str, message: str) -> tuple[str, str, str]:
    """PUBLISH, or SPUBLISH in a cluster: the command's words."""
    return ("SPUBLISH" if sharded else "PUBLISH", channel, message)


def publish(client: Any, sharded: bool, channel: str, message: str) -> Any:
    """:func:`publish_command` on a client or a pipeline (whose reply, the receivers, comes later)."""
    return client.execute_command(*publish_command(sharded, channel, message))


class Outbox:
    """Commands sent now whose replies are read later, so that the sender computes instead of waiting a round
    trip (a worker sends a step's events and reads how many received each after its next step).

    On one server they go out on a connection of the outbox's own and their replies wait in its socket. A
    cluster client sends commands to several shards and its pipeline has no separate send, so there they run
    as a pipeline at once and the replies are kept."""

    def __init__(self, client: SyncRedis) -> None:
        self._client = client
        self._connection: Any = None
        self._unread = 0  # replies waiting on the connection
        self._replies: list[Any] = []  # a cluster's, already read
        self._commands: list[tuple[Any, ...]] = []  # the last send's, until its replies are read

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        """Send ``commands`` (each a command's words) in one write; the replies of the previous send must have
        been read (:meth:`replies`)."""
        assert not self._unread and not self._replies, "the previous send's replies are unread"
        self._commands = commands
        if isinstance(self._client, redis.RedisCluster):
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            self._replies = pipe.execute()
            return
        if self._connection is None:
            self._connection = self._client.connection_pool.get_connection()
        try:
            self._connection.send_packed_command(self._connection.pack_commands(commands))
        except BaseException:
            self._disconnect()
            raise
        self._unread = len(commands)

    def replies(self) -> list[Any]:
        """The last send's replies, in order (waiting for those not in yet); [] once read. A refused command
        raises its error after all the replies are read."""
        replies, self._replies = self._replies, []
        try:
            while self._unread:
                try:
                    replies.append(self._connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
                self._unread -= 1
        except BaseException:
            self._disconnect()
            raise
        self._commands = []
        if errors := [reply for reply in replies if isinstance(reply, ResponseError)]:
            raise errors[0]
        return replies

    def discard(self) -> list[tuple[Any, ...]]:
        """Forget what was sent and not read (after losing Redis): the connection is closed, a later send opens
        it again. Returns the commands of the last send whose replies were not read: they may or may not have
        run."""
        commands, self._commands = self._commands, []
        self._disconnect()
        return commands

    def _disconnect(self) -> None:
        self._unread, self._replies = 0, []
        if self._connection is not None:
            self._connection.disconnect()
