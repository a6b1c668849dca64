"""The served models' workers and queues, and the health report of ``GET /health``, read from Redis."""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, Field

from api.context import ServerContext
from common.cluster import ModelState, read_model_state
from common.connection import REDIS_ERRORS

log = logging.getLogger(__name__)


async def model_states(ctx: ServerContext) -> list[ModelState] | None:
    """Workers and queue of every model the pod serves; None when Redis is unreachable."""
    now = time.time()
    try:
        return [await read_model_state(ctx.redis, model, now) for model in ctx.models]
    except (*REDIS_ERRORS, OSError) as exc:
        log.warning("cannot read the models' state from Redis: %s", exc)
        return None


class ModelHealth(BaseModel):
    live_workers: int
    pools: dict[str, int] = Field(description="live workers per pool")
    queue_depth: int = Field(description="jobs queued or running")


class HealthResponse(BaseModel):
    """``/health``'s body: 200 with status ok, or 503 with TGI's error fields; the models when Redis answers."""

    status: str = Field(description="ok or unhealthy")
    error: str | None = None
    error_type: str | None = None
    models: dict[str, ModelHealth] = Field(default_factory=dict)


def health_response(reason: str | None, states: list[ModelState] | None) -> HealthResponse:
    models = {
        state.model: ModelHealth(live_workers=len(state.workers), pools=state.pools, queue_depth=state.queue_depth)
        for state in states or []
    }
    if reason is None:
        return HealthResponse(status="ok", models=models)
    return HealthResponse(status="unhealthy", error=reason, error_type="unhealthy", models=models)
