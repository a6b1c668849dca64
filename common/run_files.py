"""Run files: what the Ferry processes running for this user hold, so that other commands find them.

``ferry-server`` records where its embedded Redis is (``ferry-status`` reads it when given no Redis), and CPU
workers claim their cores (worker/cpu_threads.py). Each file is held with an exclusive ``flock`` by the process
it belongs to: the kernel drops the lock when that process dies, however it ends (``kill -9`` included), so a
file nobody holds is stale, whatever pid it names, even one the system has given to another process since.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ValidationError

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


def is_held(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock (False for a file that is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return False


class ServerRecord(BaseModel):
    """A running ``ferry-server``'s run file: its pid and its embedded Redis."""

    pid: int
    redis_url: str
    started: float  # time.time() at its start: the newest server is the one ferry-status reads


@contextlib.contextmanager
def server_run_file(redis_url: str) -> Iterator[Path]:
    """Record this process's embedded Redis in ``server-<pid>.json`` of the run dir while the block runs. The
    file is locked before it is renamed into place, so a reader never sees it unlocked or half written."""
    directory = run_subdir()
    path = directory / f"server-{os.getpid()}.json"
    fd, partial = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".partial", dir=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # at once: the file is new
        record = ServerRecord(pid=os.getpid(), redis_url=redis_url, started=time.time())
        os.write(fd, record.model_dump_json().encode())
        os.replace(partial, path)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def running_servers() -> list[ServerRecord]:
    """The ``ferry-server`` processes of this user that are running, newest first; stale files are left out."""
    directory = run_dir()
    records = []
    for path in directory.glob("server-*.json") if directory.is_dir() else ():
        if not is_held(path):
            continue
        with contextlib.suppress(OSError, ValidationError):  # gone since, or not one of ours
            records.append(ServerRecord.model_validate_json(path.read_bytes()))
    return sorted(records, key=lambda record: record.started, reverse=True)
