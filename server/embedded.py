"""``ferry-server``: the whole server in one command.

With no Redis URL it brings its own: a ``redis-server`` on a free local port (``--redis-port`` picks it) when
one is on PATH, else an in-process fakeredis TCP server. It makes the tiny model on first start when no model
path is given, starts the worker process(es), and serves the API in the foreground. SIGINT and SIGTERM stop
all of it, the API first (open streams drain), then the workers, then Redis; a worker that exits on its own
(a model that cannot load, a crash) stops all of it too, with exit status 1. Its child processes die with it
even when it is killed outright (:func:`common.process.child_process`). It takes ``vllm serve``'s and TGI's
options for the settings they share with Ferry (README "Coming from vLLM or TGI"); the settings given as
options reach its workers through their env vars.
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
from typing import Any, get_args

import redis

from api.main import api_server, run_server
from common.logs import configure_logging
from common.process import child_process, command_parser, stop_processes
from common.run_files import server_run_file
from common.settings import DTYPE_ALIASES, DtypeName, EngineName, Settings, settings_env, settings_or_exit
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
    host, port = "127.0.0.1", server.server_address[1]  # the port the system chose when given 0
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

    def __enter__(self) -> WorkerProcesses:
        self._procs = [child_process([sys.executable, "-m", "worker.main"], env=env) for env in self._envs]
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_SECONDS):
            for env, proc in zip(self._envs, self._procs, strict=True):
                # poll first: an exit seen after the stop began is one the stop caused
                if (code := proc.poll()) is not None and not self._stopping.is_set():
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    self.failure = f"a worker of model {env['MODEL_NAME']} ({env['MODEL_PATH']}) {how}"
                    self._on_exit()
                    return

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        stop_processes(self._procs, self._grace)


def serve_all(settings: Settings, given: dict[str, Any], redis_url: str | None, redis_kind: str,
              redis_port: int | None, workers: int) -> str | None:
    """Run Redis (unless ``redis_url``), the workers and the API until a signal or a worker's exit stops them;
    returns what stopped them when it was a worker, else None. ``given``: the settings set on the command line,
    which reach the workers through their env vars, as the rest of their settings do. An embedded Redis is
    recorded in the run dir (common/run_files.py), for ``ferry-status``; CPU workers get their cores
    (worker/cpu_threads.py)."""
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
        envs = [settings_env(os.environ, {**given, "redis_url": redis_url, "model_path": entry.path,
                                          "model_name": entry.name, "engine": settings.engine,
                                          **({"cpu_threads_bind": bind} if bind else {})})
                for entry, bind in zip(models, binds, strict=True)]
        with WorkerProcesses(envs, settings.shutdown_grace_seconds, stop_server) as procs:
            run_server(server)
        return procs.failure


# ferry-server's options for settings: flags, setting, add_argument's options. vLLM's (`vllm serve`) and TGI's
# (`text-generation-launcher`) names are beside Ferry's where they mean the same (README "Coming from vLLM or
# TGI"); the flags of one setting may be given more than once, all with one value.
SETTING_OPTIONS: tuple[tuple[tuple[str, ...], str, dict[str, Any]], ...] = (
    (("--model", "--model-path", "--model-id"), "model_path",
     {"metavar": "MODEL", "help": "the same as MODEL (vLLM's --model, TGI's --model-id); overrides MODEL_PATH"}),
    (("--served-model-name",), "model_name",
     {"metavar": "NAME", "nargs": "+", "action": "extend",
      "help": "the name clients give for the model (one); overrides MODEL_NAME; default: the model folder's name"}),
    (("--host", "--hostname"), "host", {"help": "overrides HOST"}),
    (("--port",), "port", {"type": int, "help": "overrides PORT"}),
    (("--max-model-len", "--max-total-tokens"), "max_seq_len",
     {"type": int, "metavar": "N", "help": "prompt + generated tokens per request; overrides MAX_SEQ_LEN"}),
    (("--max-input-tokens", "--max-input-length"), "max_input_token_len",
     {"type": int, "metavar": "N", "help": "prompt tokens per request; overrides MAX_INPUT_TOKEN_LEN"}),
    (("--max-num-seqs", "--max-batch-size"), "max_batch_size",
     {"type": int, "metavar": "N", "help": "running requests per worker; overrides MAX_BATCH_SIZE"}),
    (("--max-batch-prefill-tokens",), "max_prefill_tokens",
     {"type": int, "metavar": "N", "help": "prompt tokens per prefill pass; overrides MAX_PREFILL_TOKENS"}),
    (("--max-batch-total-tokens",), "max_batch_total_tokens",
     {"type": int, "metavar": "N", "help": "KV budget per worker; overrides MAX_BATCH_TOTAL_TOKENS"}),
    (("--max-concurrent-requests",), "max_link_num",
     {"type": int, "metavar": "N", "help": "concurrent requests of the API; overrides MAX_LINK_NUM"}),
    (("--chat-template",), "chat_template",
     {"help": "chat template file or inline Jinja for /v1/chat/completions; overrides CHAT_TEMPLATE"}),
    (("--dtype",), "dtype",
     {"choices": [*get_args(DtypeName), *DTYPE_ALIASES], "help": "overrides DTYPE"}),
    (("--trust-remote-code",), "trust_remote_code",
     {"action": "store_const", "const": True, "help": "run the model folder's own code; overrides TRUST_REMOTE_CODE"}),
    (("--engine",), "engine",
     {"choices": get_args(EngineName), "help": "the workers' engine; overrides ENGINE (default transformers; "
      "README \"Engines\")"}),
)


def add_setting_options(parser: argparse.ArgumentParser) -> None:
    """The options of :data:`SETTING_OPTIONS`, MODEL, ``--api-key`` and ``--tensor-parallel-size``."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help="model folder or Hugging Face model id, as `vllm "
                        "serve MODEL`; default: the tiny model, made if missing")
    for flags, name, options in SETTING_OPTIONS:
        parser.add_argument(*flags, dest=name, **{"action": "append", **options})
    # One key an option, repeated for several (TGI's form): vLLM's `--api-key K1 K2` form would take a MODEL
    # written after it for a key
    parser.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                        help="a key clients must send as `Authorization: Bearer KEY`, repeated for several; overrides "
                        "API_KEYS (which keeps the keys out of the process list)")
    parser.add_argument("--tensor-parallel-size", "-tp", "--num-shard", type=int, action="append", metavar="N",
                        help="devices per model (the vllm engine's tensor_parallel_size, in VLLM_ENGINE_ARGS); only 1 "
                        "with the built-in engine")


def _one_value(parser: argparse.ArgumentParser, flags: tuple[str, ...], values: list[Any]) -> Any:
    """The value the flags of one setting give (None: not given); two different ones stop the command."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) > 1:
        parser.error(f"argument {'/'.join(flags)}: given different values {', '.join(map(str, distinct))}; give one")
    return distinct[0] if distinct else None


def setting_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line sets (by field name), from :func:`add_setting_options`' options."""
    overrides: dict[str, Any] = {"api_keys": args.api_keys}
    for flags, name, _ in SETTING_OPTIONS:
        given = getattr(args, name)
        values = given if isinstance(given, list) else [] if given is None else [given]
        if name == "model_path" and args.model is not None:
            flags, values = ("MODEL", *flags), [args.model, *values]
        overrides[name] = _one_value(parser, flags, values)
    return {name: value for name, value in overrides.items() if value is not None}


def with_tensor_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings
                         ) -> dict[str, Any]:
    """The settings ``--tensor-parallel-size`` sets: the vllm engine's ``tensor_parallel_size``, added to its
    VLLM_ENGINE_ARGS; with the built-in engine, which runs a model on one device, only 1 (which sets nothing)."""
    size = _one_value(parser, ("--tensor-parallel-size", "-tp", "--num-shard"), args.tensor_parallel_size or [])
    if size is None or (size == 1 and settings.engine != "vllm"):
        return {}
    if settings.engine != "vllm":
        parser.error(f"argument --tensor-parallel-size: {size} needs the vllm engine (--engine vllm); the "
                     "built-in engine runs a model on one device")
    return {"vllm_engine_args": {**settings.vllm_engine_args, "tensor_parallel_size": size}}


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ferry-server", __doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="use this Redis instead of an embedded one (env REDIS_URL)")
    parser.add_argument("--embedded-redis", choices=["auto", "redis-server", "fake"], default="auto",
                        help="which embedded Redis to start when no URL is given")
    parser.add_argument("--redis-port", type=_tcp_port, help="port of the embedded Redis; default: a free one")
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start per model")
    add_setting_options(parser)
    args = parser.parse_args(argv)
    if args.redis_url and args.redis_port:
        parser.error("--redis-port is the embedded Redis's port: it does not go with --redis-url or REDIS_URL")

    given = setting_overrides(parser, args)
    settings = settings_or_exit("ferry-server", **given)
    if tensor_parallel := with_tensor_parallel(parser, args, settings):
        given.update(tensor_parallel)
        settings = settings.model_copy(update=tensor_parallel)
    configure_logging(settings.log_format, settings.log_level)
    # SIGTERM (kill, systemd, supervisors, timeout) stops the server as Ctrl-C does. While the API runs,
    # uvicorn takes both signals, drains, then raises the signal again: by default SIGTERM would then end
    # this process before it stops its workers and Redis; as KeyboardInterrupt it unwinds through them.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if settings.model_path is None:
            log.info("no model path given: using the tiny model at %s", ensure_tiny_model(settings.resolved_model_path))
        failure = serve_all(settings, given, args.redis_url, args.embedded_redis, args.redis_port, args.workers)
    except KeyboardInterrupt:  # a stop asked outside the API's run (which ends quietly on it)
        failure = None
    if failure is not None:
        raise SystemExit(f"ferry-server: {failure}; stopped")
    log.info("ferry-server stopped")


if __name__ == "__main__":
    main()
