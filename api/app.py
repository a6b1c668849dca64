"""The FastAPI application of an API pod: its context, lifespan and protocol routers. The one place two protocols
meet: MindIE's ``POST /generate`` gets TGI's handler for TGI's bodies here (:func:`api.mindie.routes.generate_router`).

Errors raised outside any route (an unknown path, a method the path does not take) answer in the error format
of the protocol the path belongs to, never FastAPI's ``{"detail": ...}``: OpenAI's under ``/v1``, KServe's
under ``/v2``, TGI's elsewhere (the routes themselves answer through :func:`api.errors.error_route_class`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from api import __version__, adapters, admin, ops
from api.context import ModelInfo, ServerContext
from api.errors import HeaderLimit, ProtocolError
from api.kserve import routes as kserve
from api.mindie import routes as mindie
from api.openai import routes as openai
from api.ranges import integral_bounds
from api.relay import EventRelay
from api.tgi import routes as tgi
from api.tgi_format import render_tgi_error
from common.connection import REDIS_ERRORS, AsyncRedis, async_client
from common.settings import Settings

log = logging.getLogger(__name__)

# The pod's requests share these Redis connections. redis-py's default pool fails a command with "Too many
# connections" once 100 are in use (a burst of over 100 simultaneous requests); this one waits for a free one.
REDIS_POOL_SIZE = 100
REDIS_POOL_WAIT_SECONDS = 10.0
# The error format of each protocol's path prefix; other paths are TGI's.
PATH_ERRORS: tuple[tuple[str, Callable[[ProtocolError], Response]], ...] = (
    ("/v1", openai.render_openai_error),
    ("/v2", kserve.render_kserve_error),
)


def render_for_path(path: str) -> Callable[[ProtocolError], Response]:
    """The error renderer of the protocol ``path`` belongs to."""
    return next((render for prefix, render in PATH_ERRORS if path == prefix or path.startswith(prefix + "/")),
                render_tgi_error)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """An error raised outside the routes (404 no such path, 405 wrong method) in the path's protocol format."""
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path}): no such route"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    error_type = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    response = render_for_path(request.url.path)(ProtocolError(exc.status_code, message, error_type))
    response.headers.update(exc.headers or {})
    return response


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document less the 422 ``HTTPValidationError`` answer it adds to every route that takes
    parameters: no route sends that body, each answers a bad request in its protocol's own format and status
    (TGI 422, KServe and OpenAI 400), which its router declares; with its whole bounds written as integers
    (:func:`api.ranges.integral_bounds`)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        fastapi_error = {"$ref": "#/components/schemas/HTTPValidationError"}
        for operations in document["paths"].values():
            for operation in operations.values():
                answer = operation["responses"].get("422", {})
                if answer.get("content", {}).get("application/json", {}).get("schema") == fastapi_error:
                    del operation["responses"]["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            document["components"]["schemas"].pop(name, None)
        integral_bounds(document)
        app.openapi_schema = document
    return app.openapi_schema


def create_app(settings: Settings, redis: AsyncRedis | None = None) -> FastAPI:
    """Build the app. ``redis`` may be injected (tests); by default it is made from ``settings.redis_url``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A cluster's pool cannot make a command wait: its bound is past what the pod's maxLinkNum requests hold at
        # once (each at most one connection while queued or relayed, and one to close), so a burst never fails.
        cluster_connections = 2 * settings.max_link_num + REDIS_POOL_SIZE
        client = redis if redis is not None else async_client(settings, REDIS_POOL_SIZE, REDIS_POOL_WAIT_SECONDS,
                                                              cluster_connections=cluster_connections)
        api_id = uuid.uuid4().hex[:12]
        relay = EventRelay(client, api_id, sharded=settings.redis_cluster)
        await relay.start()
        models = {entry.name: ModelInfo.load(settings, entry) for entry in settings.served_models}
        default = next(iter(models.values()))
        if settings.chat_template is not None:  # --chat-template replaces the default model's own
            default.tokenizer.chat_template = settings.chat_template
        app.state.ctx = ServerContext(
            settings=settings, redis=client, relay=relay, model=default, api_id=api_id, models=models,
        )
        try:
            await adapters.register_configured(app.state.ctx)
        except REDIS_ERRORS as exc:  # requests for them are refused until a pod registers them
            log.error("could not register the configured LoRA adapters: Redis unreachable (%s)", exc)
        try:
            yield
        finally:
            await relay.stop()
            if redis is None:
                await client.aclose()

    # /docs and /redoc load Swagger UI's and ReDoc's assets from the pod (/static-offline-docs), not a CDN: the
    # pages work on an air-gapped host
    app = FastAPIOffline(
        title="Ferry",
        version=__version__,
        summary="LLM inference: TGI-compatible, KServe v2 and OpenAI-compatible APIs over Redis Streams",
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.include_router(mindie.generate_router(tgi.generate_route))  # POST /generate: TGI's body and vLLM's
    app.include_router(mindie.router)
    app.include_router(tgi.router)
    app.include_router(kserve.router)
    app.include_router(kserve.control_router)
    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(admin.router)  # /v1/config, /stopService
    app.add_middleware(admin.PlaneMiddleware, settings=settings, render=render_for_path)  # management, metrics ports
    app.add_middleware(HeaderLimit, limit=settings.max_header_bytes, render=render_for_path)  # every port, first
    app.openapi = partial(openapi_document, app)  # type: ignore[method-assign]  # FastAPI's documented hook
    return app
