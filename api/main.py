"""``ferry-api``: run one API pod against the Redis named by REDIS_URL (scale by running more)."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from api.app import create_app
from common.settings import Settings


def serve(settings: Settings) -> None:
    """Serve the API app in the foreground until SIGINT/SIGTERM, then drain gracefully."""
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        # Open streams get shutdownGraceSeconds to finish (api/sse.py), then a little for the rest.
        timeout_graceful_shutdown=settings.shutdown_grace_seconds + 5,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model-path", help="model folder (tokenizer and config.json); overrides MODEL_PATH")
    parser.add_argument("--host", help="overrides HOST")
    parser.add_argument("--port", type=int, help="overrides PORT")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings)


if __name__ == "__main__":
    main()
