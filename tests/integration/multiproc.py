"""Helpers for tests that run real worker processes: start and always reap them, and
collect what each reported, failing loudly on a worker's error or silence."""

from __future__ import annotations

import contextlib
import queue as queue_module
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

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


def poll(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Re-evaluate ``condition`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(interval)
