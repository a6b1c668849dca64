"""The FastAPI application of an API pod: its context, lifespan and protocol routers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool, Redis

from api import __version__, kserve, openai, ops, tgi
from api.context import ModelInfo, ServerContext
from api.relay import EventRelay
from common.settings import Settings

# The pod's requests share these Redis connections. redis-py's default pool fails a command with "Too many
# connections" once 100 are in use (a burst of over 100 simultaneous requests); this one waits for a free one.
REDIS_POOL_SIZE = 100
REDIS_POOL_WAIT_SECONDS = 10.0


def redis_client(settings: Settings) -> Redis:
    """The pod's Redis client: a bounded pool that makes a command wait for a connection, not fail."""
    pool = BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=REDIS_POOL_SIZE, timeout=REDIS_POOL_WAIT_SECONDS
    )
    return Redis.from_pool(pool)


def create_app(settings: Settings, redis: Redis | None = None) -> FastAPI:
    """Build the app. ``redis`` may be injected (tests); by default it is made from ``settings.redis_url``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis if redis is not None else redis_client(settings)
        api_id = uuid.uuid4().hex[:12]
        relay = EventRelay(client, api_id)
        await relay.start()
        models = {entry.name: ModelInfo.load(settings, entry) for entry in settings.served_models}
        app.state.ctx = ServerContext(
            settings=settings, redis=client, relay=relay, model=next(iter(models.values())), api_id=api_id,
            models=models,
        )
        try:
            yield
        finally:
            await relay.stop()
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="Ferry",
        version=__version__,
        summary="LLM inference: TGI-compatible, KServe v2 and OpenAI-compatible APIs over Redis Streams",
        lifespan=lifespan,
    )
    app.include_router(tgi.router)
    app.include_router(kserve.router)
    app.include_router(kserve.control_router)
    app.include_router(openai.router)
    app.include_router(ops.router)
    return app
