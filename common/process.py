"""Process-level set-up shared by the commands: their argument parser, the start-up heap freeze, and child
processes that cannot outlive their parent."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

CONFIG_EPILOG = (
    "configuration: every setting has an environment variable (MODEL_PATH, REDIS_URL, MAX_BATCH_SIZE, ...) and a "
    "key in the JSON file named by FERRY_CONFIG; options override env vars, which override the file. Every "
    'setting, its env var and its file key: README.md, section "Configuration".'
)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ferry_version() -> str:
    """The installed version of the ferry-llm distribution."""
    try:
        return version("ferry-llm")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0.0.0+local"


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of a Ferry command: ``--version``, and ``--help`` saying where the settings that
    have no option come from."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=CONFIG_EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {ferry_version()}")
    return parser


def freeze_startup_heap() -> None:
    """Leave everything alive after start-up out of garbage collection from now on.

    Called by the ``ferry-api`` and ``ferry-worker`` entry points (not by library code: tests and embedders
    keep the default). An API pod or worker holds hundreds of thousands of long-lived objects once its modules
    are imported; every full collection walks all of them, with the event loop or the engine stalled meanwhile,
    and every stream's inter-token latency jumps by that pause (bench/RESULTS.md, "gc.freeze()").
    Frozen, they are never scanned again; what is allocated later is collected as usual.

    They are unfrozen at exit, so that the interpreter's last collections free them as they would have: frozen,
    the objects of nanobind extensions (triton's, which torch imports when it is installed) outlive the
    interpreter's teardown, and nanobind reports each of them as leaked, some 30 lines on every stop.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def _die_with_parent() -> Callable[[], None] | None:
    """The ``preexec_fn`` that makes the kernel send SIGTERM to the child when this process dies (Linux's
    ``prctl(PR_SET_PDEATHSIG)``); None elsewhere. libc is looked up here, before the fork, so the child only
    makes two system calls before its exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(1)

    return preexec


def child_process(args: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start a child that cannot outlive this process, however it ends (a signal, a crash, ``kill -9``).

    The kernel's parent-death signal is used rather than a parent-watch (the child polling whether its parent
    is alive) because it needs nothing from the child (``redis-server`` cannot be taught to poll), arrives at
    once instead of a poll later, and is delivered even when the parent is killed with SIGKILL; the child
    gets SIGTERM, so a worker still closes its engine. It is tied to the thread that starts the child:
    start children from the main thread. The child gets a session of its own, so a Ctrl-C in the terminal
    reaches this process only, which stops its children in order (:func:`stop_processes`).
    """
    return subprocess.Popen(list(args), preexec_fn=_die_with_parent(), start_new_session=True, **popen)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every process, give them ``grace`` seconds together to exit, then SIGKILL the rest."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
