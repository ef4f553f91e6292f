"""Helpers for tests that run real worker processes: start and always reap them, collect
what each reported (failing loudly on a worker's error or silence), read a command's
output as it comes, and wait on a condition with a deadline."""

from __future__ import annotations

import contextlib
import queue as queue_module
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import IO, Any, TypeVar

import pytest

RESULT_TIMEOUT = 60.0  # seconds for workers to report

T = TypeVar("T")


@contextlib.contextmanager
def running(processes: Sequence[BaseProcess]) -> Iterator[None]:
    """Start the processes; on the way out join them, killing any that lingers (and all
    of them at once when the test failed)."""
    started: list[BaseProcess] = []
    try:
        for process in processes:
            process.start()
            started.append(process)
        yield
    except BaseException:
        for process in started:
            if process.is_alive():
                process.kill()
        raise
    finally:
        for process in started:
            process.join(timeout=15)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def collect(results: Any, count: int, timeout: float = RESULT_TIMEOUT) -> list[tuple[int, Any]]:
    """The ``(pid, payload)`` of ``count`` workers; fails on a worker error or silence."""
    deadline = time.monotonic() + timeout
    reports: list[tuple[int, Any]] = []
    while len(reports) < count:
        remaining = deadline - time.monotonic()
        try:
            status, pid, payload = results.get(timeout=max(remaining, 0.01))
        except queue_module.Empty:
            pytest.fail(f"only {len(reports)} of {count} workers reported within {timeout} s")
        if status == "error":
            pytest.fail(f"worker {pid} failed:\n{payload}")
        reports.append((pid, payload))
    return reports


def poll(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.05,
    *,
    explain: Callable[[], object] | None = None,
) -> T:
    """Re-evaluate ``condition`` until it is truthy; fail after ``timeout`` seconds (with
    ``explain()``, what things look like then, in the message)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = "" if explain is None else f"; {explain()}"
            pytest.fail(f"{what}: not within {timeout} s{seen}")
        time.sleep(interval)


class Output:
    """A process's output, read on a thread, so a test can wait for a line."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])
