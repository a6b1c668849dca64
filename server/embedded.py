"""``ferry-server``: the whole server in one command.

With no Redis URL it brings its own: a ``redis-server`` on a free local port (``--redis-port`` picks it) when
one is on PATH, else an in-process fakeredis TCP server. It makes the tiny model on first start when no model
path is given, starts the worker process(es), and serves the API in the foreground. SIGINT and SIGTERM stop
all of it, the API first (open streams drain), then the workers, then Redis; a worker that exits on its own
(a model that cannot load, a crash) stops all of it too, with exit status 1. Its child processes die with it
even when it is killed outright (:func:`common.process.child_process`).
With ``--redis-url`` (or REDIS_URL) it uses that Redis instead; ``ferry-api`` and ``ferry-worker`` then
scale out as separate processes against the same Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

import redis

from api.main import api_server, run_server
from common.logs import configure_logging
from common.process import child_process, command_parser, stop_processes
from common.run_files import server_run_file
from common.settings import EngineName, Settings, settings_or_exit
from worker.cpu_threads import launched_worker_cores
from worker.tiny_model import ensure_tiny_model

log = logging.getLogger("ferry.server")

REDIS_START_SECONDS = 10.0
REDIS_STOP_SECONDS = 10.0
WATCH_INTERVAL_SECONDS = 0.2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tcp_port(value: str) -> int:
    """argparse type of a TCP port number."""
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (1-65535)")
    return int(value)


def _wait_for_redis(url: str, proc: subprocess.Popen[bytes], logfile: Path) -> None:
    """Wait until the redis-server ``proc`` answers at ``url`` (it, not another Redis on that port); stop the
    command with its last log lines if it exits first (e.g. its port is taken)."""
    deadline = time.monotonic() + REDIS_START_SECONDS
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    try:
        while True:
            with contextlib.suppress(redis.RedisError):  # not listening yet, or another server on the port
                if client.info("server")["process_id"] == proc.pid:
                    return
            if proc.poll() is not None:
                log_text = logfile.read_text(errors="replace") if logfile.exists() else ""
                warnings = [line.split(" # ", 1)[1] for line in log_text.splitlines() if " # " in line]
                reason = "; ".join(warnings[-2:]) or f"exit status {proc.returncode}"
                raise SystemExit(f"ferry-server: the embedded redis-server did not start: {reason}")
            if time.monotonic() > deadline:
                raise SystemExit(f"ferry-server: the embedded redis-server did not answer at {url} within "
                                 f"{REDIS_START_SECONDS:.0f} s")
            time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def embedded_redis(kind: str = "auto", port: int | None = None) -> Iterator[str]:
    """A private Redis for this server's lifetime, on ``port`` (default: a free one); yields its URL.
    ``kind``: auto, redis-server or fake."""
    binary = shutil.which("redis-server")
    if kind == "redis-server" or (kind == "auto" and binary):
        if not binary:
            raise SystemExit("ferry-server: --embedded-redis redis-server: no redis-server on PATH")
        port = port or _free_port()
        with tempfile.TemporaryDirectory(prefix="ferry-redis-") as workdir:
            logfile = Path(workdir) / "redis.log"
            proc = child_process(
                [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", workdir, "--logfile", str(logfile)],
            )
            url = f"redis://127.0.0.1:{port}/0"
            try:
                _wait_for_redis(url, proc, logfile)
                log.info("embedded redis-server on %s", url)
                yield url
            finally:
                stop_processes([proc], REDIS_STOP_SECONDS)
        return
    from fakeredis import TcpFakeServer

    try:
        server = TcpFakeServer(("127.0.0.1", port or 0), server_type="redis")
    except OSError as exc:
        raise SystemExit(f"ferry-server: the embedded fakeredis cannot listen on 127.0.0.1:{port}: "
                         f"{exc.strerror}") from None
    thread = threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        log.info("embedded fakeredis on redis://%s:%s/0", host, port)
        yield f"redis://{host}:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


class WorkerProcesses:
    """The server's worker processes, one per environment: children that die with it, watched from a thread
    so that one exiting while the server runs calls ``on_exit`` (and :attr:`failure` says which), and stopped
    on leaving: SIGTERM (a worker finishes its running batch), SIGKILL after ``grace`` seconds."""

    def __init__(self, envs: list[dict[str, str]], grace: float, on_exit: Callable[[], None]) -> None:
        self._envs = envs
        self._grace = grace
        self._on_exit = on_exit
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stopping = threading.Event()
        self.failure: str | None = None

    def __enter__(self) -> "WorkerProcesses":
        self._procs = [child_process([sys.executable, "-m", "worker.main"], env=env) for env in self._envs]
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_SECONDS):
            for env, proc in zip(self._envs, self._procs):
                # poll first: an exit seen after the stop began is one the stop caused
                if (code := proc.poll()) is not None and not self._stopping.is_set():
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    self.failure = f"a worker of model {env['MODEL_NAME']} ({env['MODEL_PATH']}) {how}"
                    self._on_exit()
                    return

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        stop_processes(self._procs, self._grace)


def serve_all(settings: Settings, redis_url: str | None, redis_kind: str, redis_port: int | None,
              workers: int) -> str | None:
    """Run Redis (unless ``redis_url``), the workers and the API until a signal or a worker's exit stops them;
    returns what stopped them when it was a worker, else None. An embedded Redis is recorded in the run dir
    (common/run_files.py), for ``ferry-status``; CPU workers get their cores (worker/cpu_threads.py)."""
    with contextlib.ExitStack() as stack:
        if not redis_url:
            redis_url = stack.enter_context(embedded_redis(redis_kind, redis_port))
            log.info("ferry-status finds this Redis through %s", stack.enter_context(server_run_file(redis_url)))
        settings = settings.model_copy(update={"redis_url": redis_url})
        server = api_server(settings, "ferry-server")

        def stop_server() -> None:
            server.should_exit = True

        models = [entry for entry in settings.served_models for _ in range(workers)]
        try:
            binds = stack.enter_context(launched_worker_cores(settings, [entry.name for entry in models]))
        except ValueError as exc:
            raise SystemExit(f"ferry-server: {exc}") from None
        envs = [{**os.environ, "REDIS_URL": redis_url, "MODEL_PATH": str(entry.path), "MODEL_NAME": entry.name,
                 "ENGINE": settings.engine, **({"CPU_THREADS_BIND": bind} if bind else {})}
                for entry, bind in zip(models, binds)]
        with WorkerProcesses(envs, settings.shutdown_grace_seconds, stop_server) as procs:
            run_server(server)
        return procs.failure


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ferry-server", __doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="use this Redis instead of an embedded one (env REDIS_URL)")
    parser.add_argument("--embedded-redis", choices=["auto", "redis-server", "fake"], default="auto",
                        help="which embedded Redis to start when no URL is given")
    parser.add_argument("--redis-port", type=_tcp_port, help="port of the embedded Redis; default: a free one")
    parser.add_argument("--model-path", type=Path, help="model folder or Hugging Face model id; default: the tiny "
                        "model, made if missing")
    parser.add_argument("--host", help="overrides HOST")
    parser.add_argument("--port", type=int, help="overrides PORT")
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start per model")
    parser.add_argument("--engine", choices=get_args(EngineName),
                        help="the workers' engine; overrides ENGINE (default transformers; README \"Engines\")")
    args = parser.parse_args(argv)
    if args.redis_url and args.redis_port:
        parser.error("--redis-port is the embedded Redis's port: it does not go with --redis-url or REDIS_URL")

    overrides = {k: v for k, v in {"model_path": args.model_path, "host": args.host, "port": args.port,
                                   "engine": args.engine}.items() if v is not None}
    settings = settings_or_exit("ferry-server", **overrides)
    configure_logging(settings.log_format, settings.log_level)
    # SIGTERM (kill, systemd, supervisors, timeout) stops the server as Ctrl-C does. While the API runs,
    # uvicorn takes both signals, drains, then raises the signal again: by default SIGTERM would then end
    # this process before it stops its workers and Redis; as KeyboardInterrupt it unwinds through them.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if settings.model_path is None:
            log.info("no model path given: using the tiny model at %s", ensure_tiny_model(settings.resolved_model_path))
        failure = serve_all(settings, args.redis_url, args.embedded_redis, args.redis_port, args.workers)
    except KeyboardInterrupt:  # a stop asked outside the API's run (which ends quietly on it)
        failure = None
    if failure is not None:
        raise SystemExit(f"ferry-server: {failure}; stopped")
    log.info("ferry-server stopped")


if __name__ == "__main__":
    main()
