"""The API pod under a burst of concurrent requests: its Redis client (found by bench/serve_bench.py: redis-py's
default pool answered the 101st simultaneous command with "Too many connections", a 424 to the client) and
its maxLinkNum limit (found by a CI run: requests arriving together all passed the check)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path

import fakeredis
import httpx
import pytest

from api.app import REDIS_POOL_SIZE, REDIS_POOL_WAIT_SECONDS, create_app
from common import keys
from common.connection import async_client
from common.settings import Settings

pytestmark = pytest.mark.integration  # every test here runs on a real Redis and a Redis Cluster


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


@pytest.mark.parametrize("redis_fixture", ["redis_url", "redis_cluster_url"])
async def test_a_burst_admits_exactly_max_queue_size(tiny_model_path: Path, redis_fixture: str,
                                                     request: pytest.FixtureRequest) -> None:
    """300 requests at once with maxQueueSize 32, no worker: exactly 32 jobs are queued (they time out), the rest
    are refused with 429. Admission reads the depth and adds the job in one step of Redis (api/pipeline.py): with a
    read and a later XADD, 101 of them got in."""
    url = request.getfixturevalue(redis_fixture)
    model = f"burst-{uuid.uuid4().hex[:8]}"
    settings = Settings(model_path=tiny_model_path, model_name=model, redis_url=url, max_queue_size=32,
                        max_link_num=1000, token_timeout=2.0, redis_cluster=redis_fixture == "redis_cluster_url")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            body = {"inputs": "def main(", "parameters": {"max_new_tokens": 2}}
            responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(300)))
        redis = app.state.ctx.redis
        depth = sum([await redis.xlen(stream) for stream in keys.job_streams(model)])
        for stream in keys.job_streams(model):
            await redis.delete(stream)
    statuses = Counter(response.status_code for response in responses)
    assert depth == 32
    assert statuses[429] == 268, (statuses, {r.text for r in responses if r.status_code == 424})
    refusal = next(r.json() for r in responses if r.status_code == 429)
    assert refusal["error_type"] == "overloaded" and "maxQueueSize 32" in refusal["error"]
