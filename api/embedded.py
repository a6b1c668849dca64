"""``ferry-server``: the whole server in one command.

With no Redis URL it brings its own: a ``redis-server`` on a free local port when one is on PATH, else an
in-process fakeredis TCP server. It makes the tiny model on first start when no model path is given,
starts the worker process(es), and serves the API in the foreground; stopping it stops all of them.
With ``--redis-url`` (or REDIS_URL) it uses that Redis instead; ``ferry-api`` and ``ferry-worker`` then
scale out as separate processes against the same Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import redis

from api.main import serve
from common.logs import configure_logging
from common.settings import EngineName, settings_or_exit
from worker.tiny_model import ensure_tiny_model

log = logging.getLogger("ferry.server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_redis(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url)
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


@contextlib.contextmanager
def embedded_redis(kind: str = "auto") -> Iterator[str]:
    """A private Redis for this server's lifetime; yields its URL. ``kind``: auto, redis-server or fake."""
    binary = shutil.which("redis-server")
    if kind == "redis-server" or (kind == "auto" and binary):
        if not binary:
            raise SystemExit("--embedded-redis redis-server: no redis-server on PATH")
        port = _free_port()
        with tempfile.TemporaryDirectory(prefix="ferry-redis-") as workdir:
            proc = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", workdir],
                stdout=subprocess.DEVNULL,
            )
            url = f"redis://127.0.0.1:{port}/0"
            try:
                _wait_for_redis(url)
                log.info("embedded redis-server on %s", url)
                yield url
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        return
    from fakeredis import TcpFakeServer

    server = TcpFakeServer(("127.0.0.1", 0), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        log.info("embedded fakeredis on redis://%s:%s/0", host, port)
        yield f"redis://{host}:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def worker_processes(envs: list[dict[str, str]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start a worker process per environment; terminate them on exit (SIGTERM, then kill)."""
    procs = [subprocess.Popen([sys.executable, "-m", "worker.main"], env=env) for env in envs]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="use this Redis instead of an embedded one (env REDIS_URL)")
    parser.add_argument("--embedded-redis", choices=["auto", "redis-server", "fake"], default="auto",
                        help="which embedded Redis to start when no URL is given")
    parser.add_argument("--model-path", type=Path, help="model folder; default: the tiny model, made if missing")
    parser.add_argument("--host", help="overrides HOST")
    parser.add_argument("--port", type=int, help="overrides PORT")
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start per model")
    parser.add_argument("--engine", choices=get_args(EngineName),
                        help="the workers' engine; overrides ENGINE (default transformers; README \"Engines\")")
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in {"model_path": args.model_path, "host": args.host, "port": args.port,
                                   "engine": args.engine}.items() if v is not None}
    settings = settings_or_exit("ferry-server", **overrides)
    configure_logging(settings.log_format, settings.log_level)
    if settings.model_path is None:
        log.info("no model path given: using the tiny model at %s", ensure_tiny_model(settings.resolved_model_path))

    redis_cm = contextlib.nullcontext(args.redis_url) if args.redis_url else embedded_redis(args.embedded_redis)
    with redis_cm as redis_url:
        settings = settings.model_copy(update={"redis_url": redis_url})
        envs = [{**os.environ, "REDIS_URL": redis_url, "MODEL_PATH": str(entry.path), "MODEL_NAME": entry.name,
                 "ENGINE": settings.engine}
                for entry in settings.served_models for _ in range(args.workers)]
        with worker_processes(envs):
            serve(settings)


if __name__ == "__main__":
    main()
