"""``ferry-status``: what the deployment is doing, read from its Redis, for operators.

Lists each model (the configured ones and every one with a job stream or heartbeats in Redis), its live
workers per pool, its queue depth (jobs queued or running) and running batch, then every live worker with
what it last reported. ``--model`` limits it to the given models, ``--json`` prints the same as JSON, and
``--check`` exits 1 when a model has no live worker (for scripts and probes).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from pydantic import TypeAdapter
from rich.console import Console
from rich.table import Table

from common.cluster import ModelState, discover_models, read_model_state
from common.connection import REDIS_ERRORS, AsyncRedis, async_client
from common.process import command_parser
from common.run_files import running_servers
from common.settings import Settings, settings_or_exit


async def read_status(redis: AsyncRedis, configured: list[str], only: list[str] | None = None) -> list[ModelState]:
    """The state of the ``only`` models, or else of the configured ones and every one found in Redis."""
    models = sorted(set(only) if only else set(configured) | set(await discover_models(redis)))
    now = time.time()
    return [await read_model_state(redis, model, now) for model in models]


def configured_models(settings: Settings) -> list[str]:
    """Models the configuration names (ModelConfig, MODEL_NAME); none when it names none."""
    names = [entry.name for entry in settings.models]
    return names if names or settings.model_name is None else [settings.model_name]


def render(states: list[ModelState], console: Console) -> None:
    if not states:
        console.print("no models: no configured model and no worker heartbeats in this Redis")
        return
    models = Table(title="Models")
    for column in ("model", "live workers", "pools", "queue depth", "running", "KV tokens held"):
        models.add_column(column, justify="left" if column in ("model", "pools") else "right")
    for state in states:
        pools = ", ".join(f"{pool}: {count}" for pool, count in sorted(state.pools.items())) or "-"
        live = str(len(state.workers)) if state.workers else "[red]0[/red]"
        models.add_row(state.model, live, pools, str(state.queue_depth), str(state.batch_size),
                       str(state.kv_reserved_tokens))
    console.print(models)
    workers = Table(title="Workers")
    for column in ("model", "worker", "pool", "host", "pid", "device", "batch", "waiting", "KV held / budget",
                   "heartbeat left"):
        workers.add_column(column, justify="right" if column in ("pid", "batch", "waiting") else "left")
    for state in states:
        for worker in state.workers:
            status = worker.status
            workers.add_row(
                state.model, worker.consumer, worker.pool, worker.host, str(worker.pid),
                status.device if status else "?", str(status.batch_size) if status else "?",
                str(status.waiting) if status else "?",
                f"{status.kv_reserved_tokens} / {status.kv_budget_tokens}" if status else "?",
                f"{worker.heartbeat_expires_in:.1f} s",
            )
    if workers.row_count:
        console.print(workers)


async def _run(settings: Settings, only: list[str] | None) -> list[ModelState]:
    redis = async_client(settings, socket_connect_timeout=5)
    try:
        return await read_status(redis, configured_models(settings), only)
    finally:
        await redis.aclose()


def local_server_redis(settings: Settings) -> Settings:
    """``settings`` reading the embedded Redis of this user's newest running ``ferry-server``, said on stderr;
    as they are when none runs."""
    servers = running_servers()
    if not servers:
        return settings
    newest, others = servers[0], [str(server.pid) for server in servers[1:]]
    also = f"; also running: pid {', '.join(others)} (--redis-url picks another)" if others else ""
    print(f"ferry-status: reading {newest.redis_url}, the Redis of ferry-server pid {newest.pid}{also}",
          file=sys.stderr)
    return settings.model_copy(update={"redis_url": newest.redis_url})


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("ferry-status", __doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="overrides REDIS_URL")
    parser.add_argument("--model", action="append", help="only this model (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--check", action="store_true", help="exit 1 when a model has no live worker")
    args = parser.parse_args(argv)
    settings = settings_or_exit("ferry-status", **({"redis_url": args.redis_url} if args.redis_url else {}))
    if "redis_url" not in settings.model_fields_set:  # no Redis given: a running ferry-server's, if any
        settings = local_server_redis(settings)
    try:
        states = asyncio.run(_run(settings, args.model))
    except (*REDIS_ERRORS, OSError) as exc:
        print(f"ferry-status: cannot read {settings.redis_location}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if args.json:
            print(TypeAdapter(list[ModelState]).dump_json(states, indent=2).decode())
        else:
            render(states, Console())
        sys.stdout.flush()  # a closed pipe then raises here, not in the flush at exit
    except BrokenPipeError:
        # The reader left (``| head -1``): stop quietly, as the signal module docs advise for command-line
        # tools; stdout goes to devnull so that the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    if args.check and any(not state.workers for state in states):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
