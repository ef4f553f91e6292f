"""Worker functions for the multi-process priority tests (``test_priorities.py``).

They live in their own importable module so ``multiprocessing`` can start them with the
``spawn`` method. Every worker reports exactly one item on its ``results`` queue:
``("ok", pid, payload)`` or ``("error", pid, traceback)``.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from scheduler_lib.broker import Broker

POLL_INTERVAL = 0.01  # seconds between receives while every remaining group is held

# One received message as plain data:
# (group id, conversation handle, sequence number, priority, service name).
Received = tuple[str, str, int, int, str]
# One committed RECEIVE: (start tick, end tick, pid, messages). The ticks come from one
# counter shared by all receivers: ``start`` was drawn just before the RECEIVE was called,
# ``end`` just after it returned (the group still locked, the transaction still open).
Batch = tuple[int, int, int, list[Received]]


def _report(results: Any, work: Callable[[], Any]) -> None:
    """Run ``work`` and put its outcome on ``results`` (one item, whatever happens)."""
    try:
        payload = work()
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))
    else:
        results.put(("ok", os.getpid(), payload))


def receive_by_priority(
    url: str,
    queue: str,
    top: int,
    work_seconds: float,
    total: int,
    received_count: Any,
    clock: Any,
    barrier: Any,
    results: Any,
    run_seconds: float,
) -> None:
    """RECEIVE (no filter, ``timeout`` 0) from ``queue`` until ``received_count`` reaches
    ``total`` (all receivers together) or ``run_seconds`` pass; hold each batch's
    transaction ``work_seconds`` before committing. Payload: the batches (see ``Batch``).
    """

    def tick() -> int:
        with clock.get_lock():
            clock.value += 1
            return int(clock.value)

    def work() -> list[Batch]:
        batches: list[Batch] = []
        with Broker(url, migrate=False, timers=False) as broker:
            barrier.wait()
            stop_at = time.monotonic() + run_seconds
            while received_count.value < total and time.monotonic() < stop_at:
                with broker.transaction() as tx:
                    start = tick()
                    messages = tx.receive(queue, top=top, timeout=0)
                    end = tick()
                    if messages:
                        time.sleep(work_seconds)  # "work" while the group stays locked
                if not messages:
                    time.sleep(POLL_INTERVAL)  # the rest is held by others: look again
                    continue
                with received_count.get_lock():
                    received_count.value += len(messages)
                plain = [
                    (
                        str(m.conversation_group_id),
                        str(m.conversation_handle),
                        m.message_sequence_number,
                        m.priority,
                        m.service_name,
                    )
                    for m in messages
                ]
                batches.append((start, end, os.getpid(), plain))
        return batches

    _report(results, work)
