"""Run files: what the Ferry processes running for this user hold, so that other processes find them.

CPU workers claim their cores (worker/cpu_threads.py). Each file is held with an exclusive ``flock`` by the process
it belongs to: the kernel drops the lock when that process dies, however it ends (``kill -9`` included), so a
file nobody holds is stale, whatever pid it names, even one the system has given to another process since.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from common.settings import ferry_home

RUN_DIR_ENV = "FERRY_RUN_DIR"


def run_dir() -> Path:
    """``$FERRY_RUN_DIR``, else ``$XDG_RUNTIME_DIR/ferry`` (the user's runtime folder, emptied at logout), else
    ``$FERRY_HOME/run``."""
    if RUN_DIR_ENV in os.environ:
        return Path(os.environ[RUN_DIR_ENV])
    if "XDG_RUNTIME_DIR" in os.environ:
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "ferry"
    return ferry_home() / "run"


def run_subdir(name: str = "") -> Path:
    """The run dir (or its folder ``name``), made private to the user if missing."""
    path = run_dir() / name
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def try_lock(path: Path) -> int | None:
    """A descriptor of ``path`` (made if missing) holding its exclusive lock, or None when another process holds
    it. The lock lasts until the descriptor is closed or this process ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
