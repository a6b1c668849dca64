"""Where a CPU worker's torch threads run: an automatic placement, as vLLM's CPU engine core has.

A worker on a CPU host shares the machine with its API pod, Redis and the clients. With torch's default (one
thread per core) its compute threads fight those processes for every core, and a decode step waits for its
slowest thread. vLLM's CPU engine binds its engine core's threads to the cores it owns and leaves one for its
front end; the built-in engine's worker does the same by default (README "Configuration", ``CPU_THREADS_BIND``).
"""

import logging
import os

import torch

from common.settings import Settings, parse_core_list

log = logging.getLogger(__name__)

RESERVED_CORES = 1
"""Cores ``auto`` leaves to the processes beside the worker (its API pod, Redis), when the host has more."""


def auto_cores(usable: set[int]) -> list[int]:
    """The cores ``auto`` binds to: the usable ones but the last :data:`RESERVED_CORES` (all of them on a
    host with no more than that)."""
    cores = sorted(usable)
    return cores[:-RESERVED_CORES] if len(cores) > RESERVED_CORES else cores


def place_worker_threads(settings: Settings) -> list[int] | None:
    """Bind this worker process's torch threads as ``settings.cpu_threads_bind`` says; the cores bound, or None
    when the placement is left as it is: a device other than the CPU, the vllm engine (it binds its own engine
    core), ``nobind``, or ``auto`` with OMP_NUM_THREADS set (the operator placed the threads)."""
    setting = settings.cpu_threads_bind
    if settings.device != "cpu" or settings.engine != "transformers" or setting == "nobind":
        return None
    usable = os.sched_getaffinity(0)
    if setting == "auto":
        if "OMP_NUM_THREADS" in os.environ:
            log.info("CPU threads: OMP_NUM_THREADS=%s is set, placement left as it is", os.environ["OMP_NUM_THREADS"])
            return None
        cores = auto_cores(usable)
    else:
        cores = parse_core_list(setting)
        if not set(cores) <= usable:
            raise ValueError(f"cpuThreadsBind {setting}: cores {sorted(set(cores) - usable)} are not usable by "
                             f"this process (usable: {sorted(usable)})")
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    log.info("CPU threads: %d torch threads bound to cores %s (cpuThreadsBind %s)", len(cores), cores, setting)
    return cores
