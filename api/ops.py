"""Operations routes: ``GET /metrics`` (Prometheus). Open to everyone, like the health routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.context import ServerContext, get_ctx
from api.health import model_states

router = APIRouter(tags=["Operations"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(ctx: Annotated[ServerContext, Depends(get_ctx)]) -> Response:
    """The pod's request metrics and the cluster gauges, read from Redis now (kept from the last scrape
    when Redis does not answer)."""
    states = await model_states(ctx)
    if states is not None:
        ctx.metrics.observe_cluster(states)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
