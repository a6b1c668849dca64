"""Core lists such as ``0-3,6``, apart from the settings and the worker: the settings check ``cpuThreadsBind``
with the parser a CPU worker binds its threads by (worker/cpu_threads.py), and the settings, which the API pods
import, must not import the worker (torch)."""

from __future__ import annotations


def parse_core_list(text: str) -> list[int]:
    """Core ids of a list such as ``0-3,6`` (the form of taskset and OMP places); ValueError when malformed."""
    cores: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{text!r} is not a list of core ids such as 0-3,6")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"{part.strip()!r} is an empty range")
        cores.update(range(low, high + 1))
    return sorted(cores)
