"""Tasks that leave marks outside the broker's database: the ground truth the resilience
tests compare ``execution_log`` with (how often each task really started and ended)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path


def mark(path: str, name: str, seconds: float) -> str:
    """Append ``start NAME`` to ``path``, sleep, append ``end NAME``; return ``name``."""
    _append(path, f"start {name} {os.getpid()} {time.time():.3f}")
    time.sleep(seconds)
    _append(path, f"end {name} {os.getpid()} {time.time():.3f}")
    return name


def _append(path: str, line: str) -> None:
    # One write of one short line to a file opened for appending: lines of concurrent
    # tasks (threads, processes) never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def marks(path: str | Path) -> tuple[Counter[str], Counter[str]]:
    """(starts, ends) per task name."""
    starts: Counter[str] = Counter()
    ends: Counter[str] = Counter()
    if not Path(path).exists():
        return starts, ends
    for line in Path(path).read_text().splitlines():
        what, name, *_ = line.split()
        (starts if what == "start" else ends)[name] += 1
    return starts, ends
