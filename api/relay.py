"""Relays workers' per-request pub/sub events to the HTTP handlers of this API pod.

On one Redis server the pod holds ONE pattern subscription (``ferry:events:{<api_id>}:<generation>:*``) made at
start-up, instead of a subscription (and a connection) per request: it is subscribed to every request channel of
its own before any job is queued, and thousands of concurrent streams cost one Redis connection.

A Redis Cluster has no pattern subscriptions for sharded pub/sub, so there (``sharded``) the pod holds one
connection to the shard that owns its channels (they share the pod's hash tag, :mod:`common.keys`) and
SSUBSCRIBEs each request's channel before its job is queued, waiting for Redis to confirm, then SUNSUBSCRIBEs it
when the request ends: still one connection per pod, and a worker's SPUBLISH reaches no one once the client
is gone (the worker then drops the request).

When the subscription's connection breaks, or the cluster moves the pod's slot to another shard (which ends
its subscriptions), events published meanwhile are lost, so every request waiting at that moment is failed at
once with an ``unavailable`` error (never left hanging), and the subscription is made again with exponential
backoff (on the slot's current owner); requests queued after that are served normally. The new subscription is
of the next generation (:func:`common.keys.events_channel`): the channels of the requests failed then have no
subscriber any more, so a worker that still runs one drops it at its next token instead of computing it for
nobody (the pod's cancel cannot reach Redis while it is cut off).
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.client import PubSub

from common import keys
from common.connection import REDIS_ERRORS, AsyncRedis
from common.protocol import ErrorEvent

log = logging.getLogger(__name__)

RECONNECT_FIRST_DELAY = 0.1
RECONNECT_MAX_DELAY = 5.0
SUBSCRIBE_TIMEOUT_SECONDS = 5.0
_CONNECTION_LOST = ErrorEvent(
    message="lost the connection to Redis while waiting for tokens; the request may be retried",
    error_type="unavailable",
)


class SubscriptionLost(Exception):
    """The shard of the pod's channels ended a subscription the pod did not end (its slot moved)."""


class RelayUnavailable(Exception):
    """A request's channel could not be subscribed: the shard of the pod's channels is unreachable."""


class EventRelay:
    """Dispatches raw event payloads from the pod's subscription to one queue per request."""

    def __init__(self, redis: AsyncRedis, api_id: str, sharded: bool = False) -> None:
        self._redis = redis
        self._api_id = api_id
        self._sharded = sharded
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._pubsub: PubSub | None = None  # sharded: the connection to the shard of the pod's channels
        self._confirmations: dict[str, asyncio.Future[None]] = {}  # sharded: SSUBSCRIBEs Redis has not confirmed
        self._unsubscribing: set[asyncio.Task[None]] = set()
        # The pattern subscription's: one more each time the pod subscribes (sharded: each request's channel is
        # subscribed on its own, and the subscriptions of the requests failed when the connection broke end with it).
        self._generation = 0

    def channel(self, request_id: str) -> str:
        return keys.events_channel(self._api_id, self._generation, request_id)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    @property
    def connected(self) -> bool:
        return self._subscribed.is_set()

    async def start(self, wait: float = 10.0) -> None:
        """Start relaying; returns once the subscription (or the shard's connection) is in place, or after
        ``wait`` seconds while Redis is unreachable (the pod then starts unready and keeps trying)."""
        self._reader = asyncio.create_task(self._run(), name="event-relay")
        try:
            await asyncio.wait_for(self._subscribed.wait(), wait)
        except TimeoutError:
            log.warning("Redis unreachable at start-up; the event relay keeps trying")

    async def stop(self) -> None:
        tasks = [task for task in (self._reader, *self._unsubscribing) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def register(self, request_id: str) -> asyncio.Queue[bytes]:
        """A queue that receives the request's events until :meth:`release`. The request takes its place in
        :attr:`in_flight` before the first await; on return its channel is subscribed (raises a Redis error or
        :class:`RelayUnavailable` when it cannot be, having released the place)."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already registered")
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[request_id] = queue
        if self._sharded:
            try:
                await self._ssubscribe(self.channel(request_id))
            except (TimeoutError, *REDIS_ERRORS, OSError) as exc:
                self.release(request_id)
                raise RelayUnavailable(f"cannot subscribe to the request's channel: {exc or 'no confirmation'}") \
                    from None
            except BaseException:
                self.release(request_id)
                raise
        return queue

    def release(self, request_id: str) -> None:
        """Stop relaying the request's events (sharded: its SUNSUBSCRIBE goes out in the background, so that a
        cancelled handler can release too)."""
        if self._queues.pop(request_id, None) is None or not self._sharded or self._pubsub is None:
            return
        task = asyncio.create_task(self._sunsubscribe(self._pubsub, self.channel(request_id)))
        self._unsubscribing.add(task)
        task.add_done_callback(self._unsubscribing.discard)

    async def _ssubscribe(self, channel: str) -> None:
        pubsub = self._pubsub
        if pubsub is None:
            raise RelayUnavailable("not connected to the shard of this pod's channels")
        confirmed = asyncio.get_running_loop().create_future()
        self._confirmations[channel] = confirmed
        try:
            await pubsub.ssubscribe(channel)
            await asyncio.wait_for(confirmed, SUBSCRIBE_TIMEOUT_SECONDS)
        finally:
            self._confirmations.pop(channel, None)

    @staticmethod
    async def _sunsubscribe(pubsub: PubSub, channel: str) -> None:
        try:
            await pubsub.sunsubscribe(channel)
        except (*REDIS_ERRORS, OSError):
            pass  # the connection is gone, and its subscriptions with it

    async def _run(self) -> None:
        delay, refresh = RECONNECT_FIRST_DELAY, False
        while True:
            node_client: Redis | None = None
            pubsub: PubSub | None = None
            try:
                if self._sharded:
                    node_client = await self._shard_client(refresh)
                    pubsub = node_client.pubsub()
                    await pubsub.connect()
                    self._pubsub = pubsub
                else:
                    pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                    self._generation += 1
                    await pubsub.psubscribe(keys.events_pattern(self._api_id, self._generation))
                self._subscribed.set()
                delay = RECONNECT_FIRST_DELAY
                await self._dispatch(pubsub)
            except (*REDIS_ERRORS, OSError, SubscriptionLost) as exc:
                log.warning("event relay lost Redis (%s); reconnecting in %.1f s", exc, delay)
                refresh = True  # the shard may have moved: look it up afresh
            finally:
                self._subscribed.clear()
                self._pubsub = None
                self._fail_waiting()
                if pubsub is not None:
                    await pubsub.aclose()
                if node_client is not None:
                    await node_client.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)

    async def _shard_client(self, refresh: bool) -> Redis:
        """A client of the node that owns the pod's channels' slot; ``refresh`` first reads the cluster's slots
        again (after a failover or a slot migration the cached owner is wrong)."""
        cluster = self._redis
        assert isinstance(cluster, RedisCluster)
        if refresh:
            await cluster.nodes_manager.initialize()
        else:
            await cluster.initialize()
        node = cluster.get_node_from_key(self.channel("relay"))
        assert node is not None  # None only for replica=True; a slot no node covers raises
        return Redis.from_pool(ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs))

    async def _dispatch(self, pubsub: PubSub) -> None:
        while True:  # not listen(), which ends while nothing is subscribed (a shard's connection at first)
            message = await pubsub.get_message(timeout=None)
            if message is None:
                continue
            kind = message["type"]
            if kind in ("pmessage", "smessage"):
                queue = self._queues.get(keys.request_id_of(message["channel"].decode()))
                if queue is not None:  # events of requests no longer waited for are dropped
                    queue.put_nowait(message["data"])
            elif kind == "ssubscribe":
                confirmed = self._confirmations.get(message["channel"].decode())
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
            elif kind == "sunsubscribe" and keys.request_id_of(message["channel"].decode()) in self._queues:
                raise SubscriptionLost(f"Redis ended the subscription of {message['channel'].decode()}")

    def interrupt(self, event: ErrorEvent) -> None:
        """End every request waiting for events now with ``event`` (the pod shuts down): each gets it as its next
        event, after those already here."""
        payload = event.model_dump_json().encode()
        for queue in self._queues.values():
            queue.put_nowait(payload)

    def _fail_waiting(self) -> None:
        self.interrupt(_CONNECTION_LOST)
        for confirmed in self._confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(RelayUnavailable("lost the shard of this pod's channels"))
