"""Where a CPU worker's torch threads run: an automatic placement, as vLLM's CPU engine core has.

A worker on a CPU host shares the machine with its API pod, Redis and the clients. With torch's default (one
thread per core) its compute threads fight those processes for every core, and a decode step waits for its
slowest thread. vLLM's CPU engine binds its engine core's threads to the cores it owns and leaves one for its
front end; the built-in engine's worker does the same by default (README "Configuration", ``CPU_THREADS_BIND``).

Several CPU workers of one host split those cores, as vLLM's CPU data-parallel ranks each bind cores of their
own: ``auto`` gives each worker 1/``cpuWorkersPerHost`` of them. vLLM is told each rank's number; here a worker
claims the first free share itself, with a lock file per core in the run dir (common/run_files.py) that the
kernel releases when the worker dies, so workers started apart (two ``ferry-worker``, two ``ferry-server``)
take disjoint cores without being numbered. ``ferry-server`` claims its workers' shares itself, logs them, and
hands each worker its list.
"""

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.core_list import parse_core_list
from common.run_files import run_subdir, try_lock
from common.settings import Settings

log = logging.getLogger(__name__)

RESERVED_CORES = 1
"""Cores ``auto`` leaves to the processes beside the workers (their API pod, Redis), when the host has more
than one per worker."""
CLAIMS_DIR = "cpu-cores"
"""The run dir's folder of core claims: ``core-<id>.lock``, each locked by the process whose worker holds it."""


def auto_cores(usable: set[int], workers: int = 1) -> list[int]:
    """The cores ``auto`` divides among the host's ``workers`` CPU workers: the usable ones but the last
    :data:`RESERVED_CORES`, unless that would leave a worker without a core of its own (then all of them)."""
    cores = sorted(usable)
    return cores[:-RESERVED_CORES] if len(cores) - RESERVED_CORES >= workers else cores


@dataclass
class CoreClaim:
    """The cores ``auto`` gave one worker, held against the host's other workers by the locks of their claim
    files (``locks``, descriptors) until :meth:`close` or the end of this process. ``shared``: no core was free,
    these are another worker's too."""

    cores: list[int]
    shared: bool
    locks: list[int]

    def close(self) -> None:
        for fd in self.locks:
            os.close(fd)
        self.locks = []

    def describe(self, usable: set[int], workers: int) -> str:
        """What the claim is, for the log."""
        if not self.shared:
            return f"1/{workers} of the host's cores (cpuWorkersPerHost {workers})"
        if len(usable) < workers:
            return f"shared with another worker: {len(usable)} usable cores are fewer than the {workers} CPU workers"
        return (f"shared with another worker: the host's other CPU workers hold the rest (cpuWorkersPerHost "
                f"{workers} counts fewer workers than run here)")


def claim_cores(usable: set[int], workers: int) -> CoreClaim:
    """Claim one worker's share: the first ``1/workers`` of :func:`auto_cores` that no live worker of the host
    holds (fewer when fewer are free; at least one core); when none is free, the first share, shared."""
    pool = auto_cores(usable, workers)
    size = max(1, len(pool) // workers)
    directory = run_subdir(CLAIMS_DIR)
    guard = os.open(directory / "claiming.lock", os.O_RDWR | os.O_CREAT, 0o600)
    locks: dict[int, int] = {}
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one claimer at a time, so that a share is consecutive cores
        for core in pool:
            if len(locks) == size:
                break
            if (fd := try_lock(directory / f"core-{core}.lock")) is not None:
                locks[core] = fd
    finally:
        os.close(guard)
    if not locks:
        return CoreClaim(pool[:size], shared=True, locks=[])
    return CoreClaim(sorted(locks), shared=False, locks=list(locks.values()))


def binds_threads(settings: Settings) -> bool:
    """Whether a worker places its torch threads: on the CPU with the built-in engine (the vllm engine binds its
    own engine core), unless ``nobind``, or ``auto`` with OMP_NUM_THREADS set (the operator placed them)."""
    setting = settings.cpu_threads_bind
    if settings.device != "cpu" or settings.engine != "transformers" or setting == "nobind":
        return False
    if setting == "auto" and "OMP_NUM_THREADS" in os.environ:
        log.info("CPU threads: OMP_NUM_THREADS=%s is set, placement left as it is", os.environ["OMP_NUM_THREADS"])
        return False
    return True


def place_worker_threads(settings: Settings) -> CoreClaim | None:
    """Bind this worker process's torch threads as ``settings.cpu_threads_bind`` says; the cores bound (with
    ``auto``, claimed until closed or the process ends), or None when the placement is left as it is
    (:func:`binds_threads`)."""
    if not binds_threads(settings):
        return None
    setting = settings.cpu_threads_bind
    usable = os.sched_getaffinity(0)
    if setting == "auto":
        workers = settings.cpu_workers_per_host or 1
        claim = claim_cores(usable, workers)
        how = f"cpuThreadsBind auto, {claim.describe(usable, workers)}"
    else:
        cores = parse_core_list(setting)
        if not set(cores) <= usable:
            raise ValueError(f"cpuThreadsBind {setting}: cores {sorted(set(cores) - usable)} are not usable by "
                             f"this process (usable: {sorted(usable)})")
        claim, how = CoreClaim(cores, shared=False, locks=[]), f"cpuThreadsBind {setting}"
    os.sched_setaffinity(0, claim.cores)
    torch.set_num_threads(len(claim.cores))
    log.log(logging.WARNING if claim.shared else logging.INFO, "CPU threads: %d torch threads bound to cores %s (%s)",
            len(claim.cores), claim.cores, how)
    return claim


@contextlib.contextmanager
def launched_worker_cores(settings: Settings, models: list[str]) -> Iterator[list[str | None]]:
    """For ``ferry-server``, which starts a CPU worker of each of ``models`` on this host: with ``auto``, claim
    each worker its share (until the block ends: the workers die with the server) and log it; yields each
    worker's CPU_THREADS_BIND, or None where the setting stays as it is. ValueError when cpuWorkersPerHost
    counts fewer workers than these."""
    if settings.cpu_threads_bind != "auto" or not binds_threads(settings):
        yield [None] * len(models)
        return
    workers = settings.cpu_workers_per_host or len(models)
    if workers < len(models):
        raise ValueError(f"cpuWorkersPerHost {workers} counts fewer CPU workers than the {len(models)} this "
                         f"ferry-server starts")
    usable = os.sched_getaffinity(0)
    with contextlib.ExitStack() as stack:
        claims = [stack.enter_context(contextlib.closing(claim_cores(usable, workers))) for _ in models]
        for number, (model, claim) in enumerate(zip(models, claims, strict=True), 1):
            log.log(logging.WARNING if claim.shared else logging.INFO, "CPU worker %d of %d (model %s): cores %s, %s",
                    number, len(models), model, claim.cores, claim.describe(usable, workers))
        yield [",".join(map(str, claim.cores)) for claim in claims]
