"""``ferry-api``: run one API pod against the Redis named by REDIS_URL (scale by running more)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from api.app import create_app
from common.logs import configure_logging
from common.look_alikes import warn_look_alikes
from common.model_files import ModelUnavailable, model_file
from common.process import command_parser, freeze_startup_heap
from common.protocol import ErrorEvent
from common.settings import Settings, settings_or_exit

SHUTDOWN_MARGIN_SECONDS = 5.0
"""What a graceful shutdown gives requests past shutdownGraceSeconds, for the error that ends them to be written:
more than a stream's :data:`api.sse.SHUTDOWN_WRITE_SECONDS`."""


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's TLS options: none without httpsEnabled; with tlsCaCerts, clients must present a certificate
    signed by one of those CAs (mutual TLS)."""
    if not settings.https_enabled:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_pk)}
    if settings.tls_ca_certs is not None:
        options.update(ssl_ca_certs=str(settings.tls_ca_certs), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def check_models(settings: Settings, prog: str) -> None:
    """Stop the command with one line when a served model's files cannot be had (a missing folder, a hub id
    not cached while offline): the app's start-up would fail on it with a traceback instead."""
    for entry in settings.served_models:
        try:
            model_file(entry.path, "config.json")
        except ModelUnavailable as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


class PodServer(uvicorn.Server):
    """uvicorn's server on the pod's listening sockets: the business port, and the management and metrics
    ports when they are set apart (one server, one app, several sockets; :class:`api.admin.PlaneMiddleware`
    tells the ports apart). With one listener it binds as uvicorn does.

    Its graceful shutdown gives the requests still open ``grace`` seconds (shutdownGraceSeconds), then calls
    ``cut``, which ends each of them with an error in its protocol's format, so that no client takes a stream cut
    at shutdown for a complete one; uvicorn's own timeout, a little later, is for what is left."""

    def __init__(self, config: uvicorn.Config, listeners: list[uvicorn.Config], grace: float,
                 cut: Callable[[], None]) -> None:
        super().__init__(config)
        self.listeners = listeners
        self.grace = grace
        self.cut = cut

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cutting = asyncio.get_running_loop().call_later(self.grace, self.cut)
        try:
            await super().shutdown(sockets)
        finally:
            cutting.cancel()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None and self.listeners:
            sockets = [listener.bind_socket() for listener in self.listeners]  # each logs its address
        await super().serve(sockets)

    def stop(self, force: bool = False) -> None:
        """Stop as SIGTERM does (uvicorn's graceful shutdown, then the lifespan's); ``force``: without waiting
        for the connections still open."""
        self.should_exit = True
        if force:
            self.force_exit = True


def api_server(settings: Settings, prog: str) -> uvicorn.Server:
    """The API app under uvicorn, for :func:`run_server`; ``server.should_exit = True`` stops it from any
    thread, as does ``GET /stopService`` (through ``app.state.stop_server``)."""
    configure_logging(settings.log_format, settings.log_level)
    warn_look_alikes(os.environ)
    check_models(settings, prog)
    app = create_app(settings)
    freeze_startup_heap()
    options: dict[str, Any] = dict(
        log_config=None,  # uvicorn's records go through configure_logging's handler (LOG_FORMAT)
        # Open requests get shutdownGraceSeconds to finish (PodServer), then a little for the rest.
        timeout_graceful_shutdown=settings.shutdown_grace_seconds + SHUTDOWN_MARGIN_SECONDS,
        **tls_options(settings),
    )
    config = uvicorn.Config(app, host=settings.host, port=settings.port, **options)
    addresses = list(settings.listeners)
    listeners = [uvicorn.Config(app, host=host, port=port, **options) for host, port in addresses]
    grace = settings.shutdown_grace_seconds
    cut = ErrorEvent(message=f"the server shut down before the request finished (shutdownGraceSeconds {grace:g} s); "
                             "it may be retried on another server", error_type="stopping")
    server = PodServer(config, listeners if len(listeners) > 1 else [], grace,
                       lambda: app.state.ctx.relay.interrupt(cut))
    app.state.stop_server = server.stop
    return server


def run_server(server: uvicorn.Server) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, then drain gracefully; exit status 3 when the app did not
    start (uvicorn logged why). As in ``uvicorn.run``: uvicorn re-raises the signal once drained, and SIGINT's
    KeyboardInterrupt ends the run quietly (SIGTERM's default action ends the process)."""
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(3)


def serve(settings: Settings) -> None:
    """``ferry-api``'s pod in the foreground."""
    run_server(api_server(settings, "ferry-api"))


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ferry-api", __doc__)
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model-path", help="model folder or Hugging Face model id (its tokenizer and "
                        "config.json); overrides MODEL_PATH")
    parser.add_argument("--host", help="overrides HOST")
    parser.add_argument("--port", type=int, help="overrides PORT")
    parser.add_argument("--chat-template", help="chat template file or inline Jinja for /v1/chat/completions; "
                        "overrides CHAT_TEMPLATE")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    serve(settings_or_exit("ferry-api", **overrides))


if __name__ == "__main__":
    main()
