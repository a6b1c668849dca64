"""Relays workers' per-request pub/sub events to the HTTP handlers of this API pod.

The pod holds ONE pattern subscription (``ferry:events:{api_id}:*``) made at start-up, instead of a
subscription (and a connection) per request: it is subscribed to every request channel of its own before
any job is queued, and thousands of concurrent streams cost one Redis connection.

When the subscription's connection breaks, events published meanwhile are lost, so every request waiting
at that moment is failed at once with an ``unavailable`` error (never left hanging), and the subscription is
made again with exponential backoff; requests queued after that are served normally.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.protocol import ErrorEvent

log = logging.getLogger(__name__)

RECONNECT_FIRST_DELAY = 0.1
RECONNECT_MAX_DELAY = 5.0
_CONNECTION_LOST = ErrorEvent(
    message="lost the connection to Redis while waiting for tokens; the request may be retried",
    error_type="unavailable",
).model_dump_json().encode()


class EventRelay:
    """Dispatches raw event payloads from the pod's pattern subscription to one queue per request."""

    def __init__(self, redis: Redis, api_id: str) -> None:
        self._redis = redis
        self._api_id = api_id
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    def channel(self, request_id: str) -> str:
        return keys.events_channel(self._api_id, request_id)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    @property
    def connected(self) -> bool:
        return self._subscribed.is_set()

    async def start(self, wait: float = 10.0) -> None:
        """Start relaying; returns once the pattern subscription is in place, or after ``wait`` seconds
        while Redis is unreachable (the pod then starts unready and keeps trying)."""
        self._reader = asyncio.create_task(self._run(), name="event-relay")
        try:
            await asyncio.wait_for(self._subscribed.wait(), wait)
        except asyncio.TimeoutError:
            log.warning("Redis unreachable at start-up; the event relay keeps trying")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def register(self, request_id: str) -> asyncio.Queue[bytes]:
        """A queue that receives the request's events until :meth:`release`."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already registered")
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _run(self) -> None:
        delay = RECONNECT_FIRST_DELAY
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(keys.events_pattern(self._api_id))
                self._subscribed.set()
                delay = RECONNECT_FIRST_DELAY
                await self._dispatch(pubsub)
            except (RedisError, OSError) as exc:
                log.warning("event relay lost Redis (%s); reconnecting in %.1f s", exc, delay)
            finally:
                self._subscribed.clear()
                self._fail_waiting()
                await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)

    async def _dispatch(self, pubsub) -> None:
        async for message in pubsub.listen():
            if message["type"] != "pmessage":
                continue
            queue = self._queues.get(keys.request_id_of(message["channel"].decode()))
            if queue is not None:  # events of requests no longer waited for are dropped
                queue.put_nowait(message["data"])

    def _fail_waiting(self) -> None:
        for queue in self._queues.values():
            queue.put_nowait(_CONNECTION_LOST)
