"""The API pod's Redis client under a burst of concurrent requests (found by bench/serve_bench.py: redis-py's
default pool answered the 101st simultaneous command with "Too many connections", a 424 to the client)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from api.app import REDIS_POOL_SIZE, redis_client
from common.settings import Settings


async def test_commands_past_the_pool_size_wait_for_a_connection_instead_of_failing(redis_url: str) -> None:
    client = redis_client(Settings(model_path=Path("unused"), redis_url=redis_url))
    key = f"ferry-test:{uuid.uuid4().hex}"
    try:
        # Each BLPOP holds its connection for 0.2 s: three times the pool's size in flight at once.
        results = await asyncio.gather(*(client.blpop([key], timeout=0.2) for _ in range(3 * REDIS_POOL_SIZE)))
    finally:
        await client.aclose()
    assert results == [None] * (3 * REDIS_POOL_SIZE)
