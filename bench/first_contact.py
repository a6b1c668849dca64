"""First contact: how long a new user waits for ``make serve`` to answer, from a fresh clone and again.

Clones the repository (its committed HEAD) into a scratch folder and times ``make serve`` there, as the README
says to run it, from the command to the first 200 on ``POST /v1/completions``: once cold (no ``.venv``, no tiny
model, an empty Inductor cache: everything a fresh machine lacks but pip's own sources), then ``--warm`` more
times in the same clone (a second start). Each run is stopped with Ctrl-C (SIGINT) as a user stops it. For each
it records when the install finished (the Makefile's stamp), when ``/health`` first answered 200 and when the
first completion did. Writes bench/out/first_contact.json and prints a table.

    .venv/bin/python bench/first_contact.py            # the default engine
    .venv/bin/python bench/first_contact.py --engine vllm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
POLL_SECONDS = 0.25
STOP_SECONDS = 60.0
# What would point `make serve` at something other than its embedded defaults
CLEARED_ENV = ("REDIS_URL", "FERRY_CONFIG", "MODEL_PATH", "MODEL_NAME", "ENGINE",
               "COMPILE_MODEL", "PORT", "HOST", "VIRTUAL_ENV")


@dataclass
class Run:
    kind: str  # cold or warm
    installed_s: float | None  # when the Makefile's install stamp was there (None: it was before the start)
    health_s: float
    first_completion_s: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to make and ferry-server (their process group), as a user in a terminal stops it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_once(clone: Path, env: dict[str, str], engine: str | None, kind: str, log_path: Path,
               timeout: float) -> Run:
    port = free_port()
    stamp = clone / ".venv" / "bin" / ".serve"
    had_stamp = stamp.exists()
    command = ["make", "serve", f"ARGS=--port {port}"] + ([f"ENGINE={engine}"] if engine else [])
    base = f"http://127.0.0.1:{port}"
    installed = health = None
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            with httpx.Client(timeout=10) as client:
                while True:
                    now = time.monotonic() - started
                    if proc.poll() is not None:
                        raise SystemExit(f"make serve exited with {proc.returncode}; see {log_path}")
                    if now > timeout:
                        raise SystemExit(f"no completion within {timeout:.0f} s; see {log_path}")
                    if installed is None and not had_stamp and stamp.exists():
                        installed = now
                    try:
                        if health is None and client.get(f"{base}/health").status_code == 200:
                            health = now
                        if health is not None:
                            answer = client.post(f"{base}/v1/completions",
                                                 json={"model": "any", "prompt": "Hello", "max_tokens": 8})
                            if answer.status_code == 200:
                                return Run(kind, installed, health, time.monotonic() - started)
                    except httpx.HTTPError:
                        pass  # not listening yet
                    time.sleep(POLL_SECONDS)
        finally:
            stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=2, help="starts after the cold one, in the same clone")
    parser.add_argument("--engine", choices=["transformers", "vllm"], help="make serve ENGINE=...; default: none given")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds a start may take")
    parser.add_argument("--keep", action="store_true", help="keep the scratch clone (its .venv is over 1 GB)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ferry-first-contact-"))
    clone = scratch / "ferry"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    env = {key: value for key, value in os.environ.items() if key not in CLEARED_ENV}
    env |= {"FERRY_HOME": str(scratch / "home"), "FERRY_RUN_DIR": str(scratch / "run"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor")}
    runs: list[Run] = []
    try:
        for i in range(1 + args.warm):
            kind = "cold" if i == 0 else "warm"
            run = serve_once(clone, env, args.engine, kind, args.out / f"first_contact_{i}.log", args.timeout)
            runs.append(run)
            print(f"{kind}: installed {run.installed_s or 0:.1f} s, /health {run.health_s:.1f} s, first completion "
                  f"{run.first_completion_s:.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"commit": commit, "engine": args.engine or "default", "cpus": os.cpu_count(),
              "runs": [asdict(run) for run in runs]}
    (args.out / "first_contact.json").write_text(json.dumps(result, indent=2))
    print(f"\n| start ({commit}, engine {result['engine']}) | install done s | /health 200 s "
          "| first /v1/completions 200 s |")
    print("|---|---:|---:|---:|")
    for run in runs:
        installed = f"{run.installed_s:.1f}" if run.installed_s is not None else "-"
        print(f"| {run.kind} | {installed} | {run.health_s:.1f} | {run.first_completion_s:.1f} |")


if __name__ == "__main__":
    main()
