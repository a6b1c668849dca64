"""How many token events one Redis core carries: the input of docs/scaling.md's sizing table.

Every generated token is one PUBLISH of a :class:`common.protocol.TokenEvent` (the worker pipelines a step's
PUBLISHes) to a request channel that one pattern subscription per API pod covers; every request adds one XADD
of its job (plus a handful of small commands). This starts its own ``redis-server`` on a free loopback port and
drives it with ``redis-benchmark`` (C, pipelined: the client is not the limit), with this project's message
sizes:

* PUBLISH of a token event to ``ferry:events:POD:REQ`` while P API pods (P pattern subscribers, each its own
  ``redis-cli psubscribe`` draining its socket) listen, one of which matches: Redis checks every pattern
  subscription on every PUBLISH, so P is what the fleet's size changes;
* SPUBLISH of the same event in a Redis Cluster's way (``redisCluster``): each API pod SSUBSCRIBEs the exact
  channel of each of its requests (``--streams`` per pod) on one connection, and a sharded publish looks its one
  channel up, whatever the number of pods (a standalone redis-server runs the sharded commands as one shard does);
* XADD of a job with a 512-token prompt to a stream trimmed as workers do (XDEL after the job), measured as
  XADD alone.

Rounds alternate the order of the measurements; the median and min-max per measurement are printed as a
Markdown table. Usage: ``.venv/bin/python bench/redis_capacity.py [--rounds 2] [--requests 400000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from common import keys  # noqa: E402
from common.protocol import Job, SamplingParams, TokenEvent, TokenInfo  # noqa: E402
from tests.helpers import free_port  # noqa: E402

TOKEN_EVENT = TokenEvent(index=57, token=TokenInfo(id=12345, text=" token", logprob=-1.2345678, special=False))
JOB = Job(request_id="0123456789abcdef0123456789abcdef.0123456789ab", model="llama-8b",
          reply_channel=keys.events_channel("0123456789ab", 1, "0123456789abcdef0123456789abcdef.0123456789ab"),
          input_ids=list(range(20000, 20512)), params=SamplingParams(seed=2**63, max_new_tokens=256),
          enqueued_at=time.time(), deadline=time.time() + 60)


@contextlib.contextmanager
def redis_server() -> Iterator[int]:
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", workdir,
                                 # a redis-cli subscriber on this loaded machine may fall behind a burst of 400,000
                                 # messages: queue them rather than drop it (a publish to nobody costs less)
                                 "--client-output-buffer-limit", "pubsub 0 0 0"], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def pod_channel(pod: int, stream: int) -> str:
    return keys.events_channel(f"pod{pod:04d}", 1, f"{stream:032x}.0123456789ab")


@contextlib.contextmanager
def subscribers(port: int, pods: int, streams: int | None) -> Iterator[Callable[[], bool]]:
    """``pods`` API pods (each its own connection, its output read and dropped): one pattern subscription each
    (``streams`` None), or the sharded subscriptions of ``streams`` request channels each. Yields a check that
    they are all still there (Redis drops a subscriber that falls behind by its output buffer limit, and a
    publish that reaches nobody is cheaper: such a measurement is not reported)."""
    if streams is None:
        argvs = [["psubscribe", keys.events_pattern(f"pod{i:04d}", 1)] for i in range(pods)]
        count, expected = ["pubsub", "numpat"], pods
    else:
        argvs = [["ssubscribe", *(pod_channel(i, j) for j in range(streams))] for i in range(pods)]
        count, expected = ["eval", "return #redis.call('pubsub', 'shardchannels')", "0"], pods * streams
    procs = [subprocess.Popen(["redis-cli", "-p", str(port), *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for argv in argvs]

    def intact() -> bool:
        info = subprocess.run(["redis-cli", "-p", str(port), *count], capture_output=True, text=True)
        return int(info.stdout.strip() or 0) >= expected

    try:
        deadline = time.monotonic() + 30
        while not intact():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not all {expected} subscriptions arrived")
            time.sleep(0.05)
        yield intact
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def benchmark(port: int, requests: int, *command: str) -> float:
    """Commands per second ``redis-benchmark`` reaches: 16 connections, 32 commands pipelined on each."""
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-n", str(requests), "-c", "16", "-P", "32", "-q",
                          "--csv", *command], capture_output=True, text=True, check=True).stdout
    row = [line for line in out.splitlines() if line and not line.startswith('"test"')][-1]
    return float(row.rsplit(",", 7)[1].strip('"'))  # the test's name holds the command, quotes unescaped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=400_000, help="commands per measurement")
    parser.add_argument("--pods", type=int, nargs="+", default=[1, 10, 100, 500])
    parser.add_argument("--streams", type=int, default=32, help="open streams per pod, for the sharded measurement")
    args = parser.parse_args(argv)
    for tool in ("redis-server", "redis-cli", "redis-benchmark"):
        if shutil.which(tool) is None:
            parser.exit(2, f"{tool} is not installed (Debian: redis-server, redis-tools)\n")
    event, job = TOKEN_EVENT.model_dump_json(), JOB.model_dump_json()
    channel = keys.events_channel("pod0000", 1, JOB.request_id)
    results: dict[str, list[float]] = {}
    with redis_server() as port:
        version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
        for round_ in range(args.rounds):
            order = args.pods if round_ % 2 == 0 else args.pods[::-1]
            for pods in order:
                with subscribers(port, pods, None) as intact:
                    name = f"PUBLISH token event ({len(event)} B), {pods} API pod pattern subscriptions"
                    rate = benchmark(port, args.requests, "PUBLISH", channel, event)
                    results.setdefault(name, []).extend([rate] if intact() else [])
                with subscribers(port, pods, args.streams) as intact:
                    name = (f"SPUBLISH token event ({len(event)} B), {pods} API pods × {args.streams} sharded "
                            "request channels")
                    rate = benchmark(port, args.requests, "SPUBLISH", pod_channel(0, 0), event)
                    results.setdefault(name, []).extend([rate] if intact() else [])
            name = f"XADD job ({len(job)} B, 512-token prompt)"
            rate = benchmark(port, args.requests // 4, "XADD", keys.job_stream("bench"), "MAXLEN", "~", "10000", "*",
                             keys.JOB_FIELD, job)
            results.setdefault(name, []).append(rate)
            print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
    print(f"`{' '.join(['.venv/bin/python', 'bench/redis_capacity.py', *(argv or sys.argv[1:])])}`: redis-server "
          f"{version}, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), {args.rounds} rounds, "
          f"redis-benchmark -c 16 -P 32, {args.requests} commands per measurement.\n")
    print("| measurement | commands/s, median (min-max) |\n|---|---|")
    for name, rates in results.items():
        if not rates:
            print(f"| {name} | none: a subscriber was dropped in every round |")
            continue
        print(f"| {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}), {len(rates)} "
              "rounds |")


if __name__ == "__main__":
    main()
