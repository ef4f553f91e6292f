"""Callers of one scheduler for the durable-synchronization tests, importable by name so
``multiprocessing`` can start them with ``spawn``. Each reports as it goes on
``results``: ``("ok", pid, payload)`` or, on any error, ``("error", pid, traceback)``."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import SynchronizationTimeout, Task, TaskScheduler

WAIT = 30.0  # seconds: the longest one synchronization may take


def task(i: int) -> Task:
    """Task ``i``: its result is ``i``, so each outcome says which task it is."""
    return Task.python("builtins:abs", -i, name=f"task-{i}")


def _done(completion: Any) -> tuple[str, int, str, Any]:
    return ("done", completion.log_id, completion.status, completion.result)


def send_then_synchronize(
    url: str, count: int, calls: int, go: Any, results: Any, *, hang: bool = False
) -> None:
    """Begin a scheduler, send ``count`` tasks as one wave and report ``("sent", handle,
    log ids)``; once ``go`` is set, call ``synchronization`` ``calls`` times, reporting
    each completion as it returns. With ``hang``, then wait to be killed."""
    try:
        with Broker(url, migrate=False, timers=False) as broker:
            scheduler = TaskScheduler(broker)
            handle = scheduler.get_scheduler()
            log_ids = scheduler.exec_many(handle, [task(i) for i in range(count)], wave=1)
            results.put(("ok", os.getpid(), ("sent", str(handle), log_ids)))
            if not go.wait(WAIT):
                raise TimeoutError("never told to synchronize")
            for _ in range(calls):
                results.put(("ok", os.getpid(), _done(scheduler.synchronization(handle, WAIT))))
            results.put(("ok", os.getpid(), ("finished",)))
            if hang:
                time.sleep(300)  # between two synchronization calls: the test kills us here
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))


def attach_then_synchronize(
    url: str, handle: str, calls: int, go: Any, results: Any, *, then_one_more: float = 0.0
) -> None:
    """Attach to ``handle``, report ``("attached", in flight)``; once ``go`` is set, call
    ``synchronization`` ``calls`` times, reporting each completion. With
    ``then_one_more`` > 0, one more call with that timeout reports ``("timeout",)`` when
    nothing was left (else the completion it got)."""
    try:
        with Broker(url, migrate=False, timers=False) as broker:
            scheduler = TaskScheduler(broker)
            attached = scheduler.attach(handle)
            results.put(("ok", os.getpid(), ("attached", attached.in_flight)))
            if not go.wait(WAIT):
                raise TimeoutError("never told to synchronize")
            for _ in range(calls):
                results.put(("ok", os.getpid(), _done(scheduler.synchronization(attached, WAIT))))
            if then_one_more > 0:
                try:
                    extra = scheduler.synchronization(attached, then_one_more)
                except SynchronizationTimeout:
                    results.put(("ok", os.getpid(), ("timeout",)))
                else:
                    results.put(("ok", os.getpid(), _done(extra)))
            results.put(("ok", os.getpid(), ("finished",)))
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))
