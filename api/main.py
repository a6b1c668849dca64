"""``ferry-api``: run one API pod against the Redis named by REDIS_URL (scale by running more)."""

from __future__ import annotations

import argparse
import ssl
from typing import Any

import uvicorn

from api.app import create_app
from common.logs import configure_logging
from common.process import freeze_startup_heap
from common.settings import Settings, settings_or_exit


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's TLS options: none without httpsEnabled; with tlsCaCerts, clients must present a certificate
    signed by one of those CAs (mutual TLS)."""
    if not settings.https_enabled:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_pk)}
    if settings.tls_ca_certs is not None:
        options.update(ssl_ca_certs=str(settings.tls_ca_certs), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def serve(settings: Settings) -> None:
    """Serve the API app in the foreground until SIGINT/SIGTERM, then drain gracefully."""
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # uvicorn's records go through configure_logging's handler (LOG_FORMAT)
        # Open streams get shutdownGraceSeconds to finish (api/sse.py), then a little for the rest.
        timeout_graceful_shutdown=settings.shutdown_grace_seconds + 5,
        **tls_options(settings),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model-path", help="model folder (tokenizer and config.json); overrides MODEL_PATH")
    parser.add_argument("--host", help="overrides HOST")
    parser.add_argument("--port", type=int, help="overrides PORT")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    serve(settings_or_exit("ferry-api", **overrides))


if __name__ == "__main__":
    main()
