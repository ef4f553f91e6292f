"""Side-effect marks of the stack's fault scenarios: a task body that leaves a file when
it starts, so a test counts how often each body ran (on whichever worker application,
since the workers share this machine's disk)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path


def mark_and_sleep(marks: str, run_id: str, name: str, seconds: str | float) -> str:
    """Leave a mark for ``name`` in ``run_id``'s folder, then sleep ``seconds``, or less if
    the test ``release``s the run first (it has seen what it waited for while they ran)."""
    folder = Path(marks) / folder_name(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.{os.getpid()}.{time.time_ns()}").touch()
    deadline = time.monotonic() + float(seconds)  # rendered from a template: a string
    released = release_path(Path(marks), run_id)
    while not released.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return name


def release(marks: Path, run_id: str) -> None:
    """End the sleep of ``run_id``'s task bodies, those running and those to come."""
    release_path(marks, run_id).touch()


def release_path(marks: Path, run_id: str) -> Path:
    # Beside the run's folder, not in it: count() counts every file in there.
    return marks / f"{folder_name(run_id)}.release"


def folder_name(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


def count(marks: Path, run_id: str) -> Counter[str]:
    """How often each task body of ``run_id`` started."""
    folder = marks / folder_name(run_id)
    if not folder.is_dir():
        return Counter()
    return Counter(path.name.split(".", 1)[0] for path in folder.iterdir())
