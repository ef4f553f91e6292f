"""Worker functions for the scheduler's multi-process tests, importable by name so
``multiprocessing`` can start them with ``spawn``. Each reports once on ``results``:
``("ok", pid, payload)`` or ``("error", pid, traceback)``."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Semaphores


def executor(url: str, lease: float, results: Any) -> None:
    """An executor process (killed by the test in the middle of a task)."""
    try:
        with Broker(url, migrate=False, timers=False) as broker:
            results.put(("ok", os.getpid(), "started"))
            Executor(broker, "QueueAsyncTarget", lease=lease, idle_timeout=300).serve()
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))


def use_semaphore(url: str, name: str, rounds: int, hold: float, results: Any) -> None:
    """Take the semaphore ``rounds`` times, holding it ``hold`` seconds each; report the
    (start, end) of every hold, in wall-clock seconds."""
    try:
        with Broker(url, migrate=False, timers=False) as broker:
            semaphores = Semaphores(broker)
            held = []
            for _ in range(rounds):
                with semaphores.hold(name, timeout=60, lease=5):
                    start = time.time()
                    time.sleep(hold)
                    held.append((start, time.time()))
            results.put(("ok", os.getpid(), held))
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))


def hold_semaphore_forever(url: str, name: str, lease: float, results: Any) -> None:
    """Take a permit, keep renewing it, and never give it back (the test kills us)."""
    try:
        with (
            Broker(url, migrate=False, timers=False) as broker,
            Semaphores(broker).hold(name, timeout=60, lease=lease) as permit,
        ):
            results.put(("ok", os.getpid(), permit.holder_id))
            time.sleep(300)
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))
