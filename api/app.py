"""The FastAPI application of an API pod: its context, lifespan and protocol routers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis.asyncio import Redis

from api import __version__, kserve, openai, ops, tgi
from api.context import ModelInfo, ServerContext
from api.relay import EventRelay
from common.settings import Settings


def create_app(settings: Settings, redis: Redis | None = None) -> FastAPI:
    """Build the app. ``redis`` may be injected (tests); by default it is made from ``settings.redis_url``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis if redis is not None else Redis.from_url(settings.redis_url)
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
