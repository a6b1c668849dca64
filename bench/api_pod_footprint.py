"""An API pod's start-up cost: ``import api.app`` time and an idle ``ferry-api``'s memory (issue 13).

``.venv/bin/python bench/api_pod_footprint.py [--tree DIR ...]`` measures each source tree (default: this
checkout; pass an older checkout, e.g. ``git worktree add /tmp/before HEAD~1``, to compare) with this
interpreter, alternating the trees over ``--rounds`` rounds so machine noise hits every side alike:

- import: the seconds ``import api.app`` takes in a fresh interpreter (what every pod start pays), and whether
  torch or transformers got loaded;
- idle RSS: a ``ferry-api`` process for the tiny model against a redis-server of its own, once it answers
  ``/v2/health/live`` and has sat idle for ``--idle`` seconds (resident memory, from psutil).

Prints one line per measurement and a median table (Markdown).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.embedded import embedded_redis  # noqa: E402
from worker.tiny_model import ensure_tiny_model  # noqa: E402

IMPORT_PROBE = (
    "import sys, time; started = time.perf_counter(); import api.app; "
    "print(time.perf_counter() - started, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
)


def measure_import(tree: Path) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    return float(out[0]), out[1].strip()


def measure_idle_rss(tree: Path, model: Path, redis_url: str, port: int, idle: float) -> float:
    """MiB resident in an idle ``ferry-api`` (``python -m api.main``) of ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "MODEL_PATH": str(model), "REDIS_URL": redis_url,
           "PORT": str(port), "HOST": "127.0.0.1", "LOG_LEVEL": "warning"}
    process = subprocess.Popen([sys.executable, "-m", "api.main"], cwd=tree, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"ferry-api of {tree} exited with {process.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ferry-api of {tree} did not answer within 120 s") from None
                time.sleep(0.1)
        time.sleep(idle)
        return psutil.Process(process.pid).memory_info().rss / 2**20
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="a source tree to measure (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds the pod sits idle before the reading")
    parser.add_argument("--port", type=int, default=18431)
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.tree or [ROOT]]
    results: dict[Path, dict[str, list[float]]] = {tree: {"import": [], "rss": []} for tree in trees}
    with tempfile.TemporaryDirectory() as scratch, embedded_redis("redis-server") as redis_url:
        model = ensure_tiny_model(Path(scratch) / "tiny")
        for round_ in range(args.rounds):
            for tree in trees if round_ % 2 == 0 else trees[::-1]:
                seconds, heavy = measure_import(tree)
                rss = measure_idle_rss(tree, model, redis_url, args.port, args.idle)
                results[tree]["import"].append(seconds)
                results[tree]["rss"].append(rss)
                print(f"round {round_ + 1} {tree}: import api.app {seconds:.2f} s (loaded: {heavy}), "
                      f"idle ferry-api {rss:.0f} MiB", flush=True)
    print("\n| tree | import api.app (median s) | idle ferry-api RSS (median MiB) |\n|---|---:|---:|")
    for tree, values in results.items():
        print(f"| {tree} | {statistics.median(values['import']):.2f} | {statistics.median(values['rss']):.0f} |")


if __name__ == "__main__":
    main()
