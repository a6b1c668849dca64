"""The API pod under a burst of concurrent requests: its Redis client (found by bench/serve_bench.py: redis-py's
default pool answered the 101st simultaneous command with "Too many connections", a 424 to the client) and
its maxLinkNum limit (found by a CI run: requests arriving together all passed the check)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import fakeredis
import httpx

from api.app import REDIS_POOL_SIZE, REDIS_POOL_WAIT_SECONDS, create_app
from common.connection import async_client
from common.settings import Settings


async def test_commands_past_the_pool_size_wait_for_a_connection_instead_of_failing(redis_url: str) -> None:
    client = async_client(Settings(model_path=Path("unused"), redis_url=redis_url), REDIS_POOL_SIZE,
                          REDIS_POOL_WAIT_SECONDS)
    key = f"ferry-test:{uuid.uuid4().hex}"
    try:
        # Each BLPOP holds its connection for 0.2 s: three times the pool's size in flight at once.
        results = await asyncio.gather(*(client.blpop([key], timeout=0.2) for _ in range(3 * REDIS_POOL_SIZE)))
    finally:
        await client.aclose()
    assert results == [None] * (3 * REDIS_POOL_SIZE)


async def test_max_link_num_holds_for_requests_arriving_together(tiny_model_path: Path) -> None:
    """Requests that pass the maxLinkNum check at the same moment cannot all take a place: exactly
    maxLinkNum of them are queued (and time out, as no worker runs), the rest are refused at once."""
    settings = Settings(model_path=tiny_model_path, max_link_num=2, token_timeout=1.0)
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            body = {"inputs": "def main(", "parameters": {"max_new_tokens": 2}}
            responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(5)))
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [429, 429, 429, 500, 500], [r.text for r in responses]
