"""Relays workers' per-request pub/sub events to the HTTP handlers of this API pod.

The pod holds ONE pattern subscription (``ferry:events:{api_id}:*``) made at start-up, instead of a
subscription (and a connection) per request: it is subscribed to every request channel of its own before
any job is queued, and thousands of concurrent streams cost one Redis connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from common import keys

log = logging.getLogger(__name__)


class DuplicateRequestId(Exception):
    """A request with the same id is already in flight on this pod."""


class EventRelay:
    """Dispatches raw event payloads from the pod's pattern subscription to one queue per request."""

    def __init__(self, redis: Redis, api_id: str) -> None:
        self._redis = redis
        self._api_id = api_id
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None

    def channel(self, request_id: str) -> str:
        return keys.events_channel(self._api_id, request_id)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def start(self) -> None:
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.psubscribe(keys.events_pattern(self._api_id))
        self._reader = asyncio.create_task(self._read(self._pubsub), name="event-relay")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._pubsub is not None:
            await self._pubsub.aclose()

    async def _read(self, pubsub: PubSub) -> None:
        async for message in pubsub.listen():
            if message["type"] != "pmessage":
                continue
            queue = self._queues.get(keys.request_id_of(message["channel"].decode()))
            if queue is not None:  # events of requests no longer waited for are dropped
                queue.put_nowait(message["data"])

    @asynccontextmanager
    async def subscription(self, request_id: str) -> AsyncIterator[asyncio.Queue[bytes]]:
        """A queue receiving the request's events while the context is open."""
        if request_id in self._queues:
            raise DuplicateRequestId(request_id)
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            yield queue
        finally:
            del self._queues[request_id]
