"""Liveness of the model's workers, read from the heartbeats they keep in Redis."""

from __future__ import annotations

from redis.asyncio import Redis

from common import keys


async def live_workers(redis: Redis, model: str, now: float) -> int:
    """Workers whose heartbeat has not expired (see :func:`common.keys.heartbeats`)."""
    return await redis.zcount(keys.heartbeats(model), now, "+inf")
