"""MindIE's administration routes and the pod's planes.

- ``GET /v1/config``: the pod's effective configuration in the config file's layout (ServerConfig, LogConfig,
  BackendConfig with ScheduleConfig and ModelDeployConfig; :func:`common.settings.effective_config`), without
  secrets (no API keys; the Redis password masked). MindIE's ``GET /v2/models/{m}/config`` is KServe's
  (api/kserve/routes.py): Triton's model configuration and MindIE's fields in one object, for both kinds of client.
- ``GET /stopService[?mode=Force]``: drains the pod. From then on the pipeline refuses every new request
  (``stopping``: 503 in each protocol's error format); once the requests in flight have finished (with
  ``Force``: after :data:`FORCE_SECONDS` at most) the pod stops the way SIGTERM stops it, by ending uvicorn's
  serve loop (``app.state.stop_server``, set by :func:`api.main.api_server`): uvicorn's graceful shutdown,
  then the lifespan's; with ``Force`` and requests still running, uvicorn does not wait for them. A GET that
  changes state, so guarded (:func:`_stop_refusal`): with API keys configured it needs one, like the POST routes;
  with neither keys nor a management port it is refused (403) unless ``allowOpenStopService``; and a browser's
  cross-site request (an ``<img>`` on a web page) is refused in every configuration.
- :class:`PlaneMiddleware`: with ``managementPort`` / ``metricsPort`` set apart from the business port
  (:attr:`common.settings.Settings.listeners`), each port serves its planes' routes only, any other path is a
  404 in its protocol's format, and ``/stopService`` is served on the management port only.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from api.context import ServerContext, get_ctx
from api.errors import ProtocolError, authorized, unauthorized
from api.mindie_format import MindIERoute
from api.tgi_format import ERROR_RESPONSES, render_tgi_error
from common.settings import Settings, effective_config

log = logging.getLogger(__name__)

FORCE_SECONDS = 5.0  # stopService?mode=Force: the longest wait for the requests in flight
DRAIN_POLL_SECONDS = 0.1
STOP_SERVICE = "/stopService"
# Sec-Fetch-Site values of a request the browser's user made on the pod's own page or address bar; a browser sends
# "cross-site" or "same-site" for a request a web page makes, and other clients (curl, kubelets) send none.
OWN_SITE = frozenset({"same-origin", "none"})
METRICS_PATHS = re.compile(r"^/(metrics|metrics-json)$")
MANAGEMENT_PATHS = re.compile(
    r"^/(health(/.*)?|v2/health/.*|v[12]/status|v2/models/[^/]+/getSlotCount|metrics|metrics-json|stopService"
    r"|v1/config)$"
)

router = APIRouter(route_class=MindIERoute, tags=["MindIE"])
Ctx = Annotated[ServerContext, Depends(get_ctx)]


class StopServiceResponse(BaseModel):
    status: Literal["stopping"]


@router.get("/v1/config", response_model=dict[str, Any],
            summary="The server's effective configuration (MindIE's config.json layout, no secrets)")
async def config(ctx: Ctx) -> dict[str, Any]:
    return effective_config(ctx.settings)


@router.get(STOP_SERVICE, response_model=StopServiceResponse,
            responses={401: ERROR_RESPONSES[422] | {"description": "API key missing or wrong"},
                       403: ERROR_RESPONSES[422] | {"description": "not served to this caller (README)"},
                       422: ERROR_RESPONSES[422]},
            summary="Drain this pod, then stop it (mode=Force: stop after 5 s even with requests in flight)")
async def stop_service(
    ctx: Ctx, http: Request, mode: Annotated[Literal["Force"] | None, Query()] = None
) -> StopServiceResponse | Response:
    if not authorized(http):
        return unauthorized(render_tgi_error)
    if (refusal := _stop_refusal(ctx.settings, http)) is not None:
        return render_tgi_error(ProtocolError(403, refusal, "forbidden"))
    loop = asyncio.get_running_loop()
    drain = ctx.drain
    if mode == "Force":
        at = loop.time() + FORCE_SECONDS
        drain.force_at = at if drain.force_at is None else min(drain.force_at, at)
    if not drain.stopping:
        drain.stopping = True
        log.warning("stopService%s: refusing new requests; %d in flight", " (Force)" if mode else "",
                    ctx.relay.in_flight)
        http.app.state.drain_task = asyncio.create_task(_drain_then_stop(ctx, http.app.state), name="stop-service")
    return StopServiceResponse(status="stopping")


def _stop_refusal(settings: Settings, http: Request) -> str | None:
    """Why ``/stopService`` is not served to this request (an authorized one), None when it is."""
    if http.headers.get("sec-fetch-site", "none") not in OWN_SITE:
        return "stopService is not served to a request a web page made (Sec-Fetch-Site: cross-site or same-site)"
    guarded = bool(settings.api_keys) or any("management" in planes for planes in settings.listeners.values())
    if not guarded and not settings.allow_open_stop_service:
        return ("stopService needs an API key (apiKeys) or a management port (managementPort) to guard it, or "
                "allowOpenStopService set to true")
    return None


async def _drain_then_stop(ctx: ServerContext, state: Any) -> None:
    """Wait for the requests in flight (until ``force_at`` when forced), then stop the server."""
    loop = asyncio.get_running_loop()
    while ctx.relay.in_flight and (ctx.drain.force_at is None or loop.time() < ctx.drain.force_at):
        await asyncio.sleep(DRAIN_POLL_SECONDS)
    left = ctx.relay.in_flight
    if left:
        log.warning("stopService: stopping with %d request(s) still in flight (Force)", left)
    else:
        log.warning("stopService: no request in flight; stopping")
    stop = getattr(state, "stop_server", None)
    if stop is not None:  # None: an app without a server of ours (tests in-process)
        stop(force=bool(left))


class PlaneMiddleware:
    """Serves each port's planes only (see the module's docstring); a no-op with one listener."""

    def __init__(self, app: ASGIApp, settings: Settings, render: Callable[[str], Callable[[ProtocolError], Response]]
                 ) -> None:
        self.app = app
        self.render = render  # the error renderer of a path's protocol
        listeners = settings.listeners
        self.split = len(listeners) > 1
        self.planes = {port: planes for (_, port), planes in listeners.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.split and scope["type"] == "http" and not self._serves(scope):
            path = scope["path"]
            message = f"Invalid URL ({scope['method']} {path}): no such route on this port"
            response = self.render(path)(ProtocolError(404, message, "not_found"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _serves(self, scope: Scope) -> bool:
        server = scope.get("server")  # (host, port); None on a Unix socket
        business = frozenset({"business"})
        planes = self.planes.get(server[1], business) if server else business
        path = scope["path"]
        if "management" in planes and MANAGEMENT_PATHS.match(path):
            return True
        if "metrics" in planes and METRICS_PATHS.match(path):
            return True
        return "business" in planes and path != STOP_SERVICE
