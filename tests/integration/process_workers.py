"""Worker functions for the multi-process broker tests (``test_processes.py``).

They live in their own importable module so ``multiprocessing`` can start them with the
``spawn`` method: a fresh interpreter imports this module by name and runs one function.
Every worker reports exactly one item on its ``results`` queue: ``("ok", pid, payload)``
or ``("error", pid, traceback)``, so the parent never waits on a worker that died quietly
and sees a worker's failure as text.

Timestamps that processes compare are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for
the whole machine on Linux) or ``time.time()`` when compared with ``enqueued_at``.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

from scheduler_lib.broker import Broker

INITIATOR_SERVICE = "InitiatorService"
TARGET_SERVICE = "TargetService"
CONTRACT = "AsyncContract"
REQUEST = "AsyncSent"  # initiator -> target
REPLY = "AsyncDone"  # target -> initiator

# One received message as plain data: (conversation handle, sequence number, type, body).
Received = tuple[str, int, str, bytes | None]
# One committed RECEIVE: (group id, pid, start, end, messages); the group was locked
# throughout [start, end] (monotonic seconds).
Batch = tuple[str, int, float, float, list[Received]]


def _report(results: Any, work: Callable[[], Any]) -> None:
    """Run ``work`` and put its outcome on ``results`` (one item, whatever happens)."""
    try:
        payload = work()
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))
    else:
        results.put(("ok", os.getpid(), payload))


def _plain(messages: Any) -> list[Received]:
    return [
        (str(m.conversation_handle), m.message_sequence_number, m.message_type_name, m.body)
        for m in messages
    ]


def receive_loop(
    url: str,
    queue: str,
    top: int,
    timeout: float,
    work_seconds: float,
    total: int,
    received_count: Any,
    barrier: Any,
    results: Any,
    run_seconds: float,
    conversations: list[str] | None = None,
) -> None:
    """Receive from ``queue`` until ``received_count`` reaches ``total`` (all receivers
    together) or ``run_seconds`` pass. With ``conversations``, each RECEIVE instead names
    one of them, picked at random (``timeout`` 0): it must still lock the whole group.

    Each batch is received in a transaction that is held ``work_seconds`` before it
    commits; the payload lists ``(group id, pid, start, end, messages)`` per committed
    batch, where ``[start, end]`` lies inside the time the group was locked.
    """

    def work() -> list[Batch]:
        batches: list[Batch] = []
        rng = random.Random(os.getpid())
        with Broker(url, migrate=False, timers=False) as broker:
            barrier.wait()
            stop_at = time.monotonic() + run_seconds
            while received_count.value < total and time.monotonic() < stop_at:
                with broker.transaction() as tx:
                    if conversations:
                        handle = rng.choice(conversations)
                        messages = tx.receive(queue, top=top, timeout=0, conversation=handle)
                    else:
                        messages = tx.receive(queue, top=top, timeout=timeout)
                    if not messages:
                        continue
                    start = time.monotonic()  # the group is locked from here...
                    time.sleep(work_seconds)  # ...while we "work" in the transaction
                    end = time.monotonic()  # ...to here (the commit comes after)
                groups = {str(m.conversation_group_id) for m in messages}
                if len(groups) != 1:
                    raise AssertionError(f"one RECEIVE returned several groups: {groups}")
                with received_count.get_lock():
                    received_count.value += len(messages)
                batches.append((groups.pop(), os.getpid(), start, end, _plain(messages)))
        return batches

    _report(results, work)


def send_conversations(
    url: str,
    sender: int,
    conversations: int,
    per_conversation: int,
    barrier: Any,
    results: Any,
) -> None:
    """Begin ``conversations`` dialogs and send ``per_conversation`` requests on each,
    interleaved, one SEND per transaction. Payload: ``[(handle, seq, body), ...]``."""

    def work() -> list[tuple[str, int, bytes]]:
        sent: list[tuple[str, int, bytes]] = []
        with Broker(url, migrate=False, timers=False) as broker:
            handles = [
                broker.begin_dialog(INITIATOR_SERVICE, TARGET_SERVICE, CONTRACT)
                for _ in range(conversations)
            ]
            barrier.wait()
            for i in range(per_conversation):
                for c, handle in enumerate(handles):
                    body = f"s{sender}:c{c}:{i}".encode()
                    seq = broker.send(handle, REQUEST, body)
                    sent.append((str(handle), seq, body))
        return sent

    _report(results, work)


def receive_and_hang(
    url: str, queue: str, receives: int, top: int, results: Any, hang: Any
) -> None:
    """Receive ``receives`` times in ONE transaction, report what it holds, then block on
    ``hang`` (an Event nobody sets) with the transaction open, until killed."""

    def work() -> None:
        broker = Broker(url, migrate=False, timers=False)
        tx = broker.transaction()
        held: list[Received] = []
        for _ in range(receives):
            held.extend(_plain(tx.receive(queue, top=top, timeout=5)))
        results.put(("held", os.getpid(), held))
        hang.wait(60)  # the parent kills us long before this
        raise AssertionError("receive_and_hang was not killed")

    _report(results, work)


def begin_with_timer(
    url: str, timer_seconds: float | None, lifetime: float | None, results: Any
) -> None:
    """Begin a dialog (optionally with a lifetime), send one request so the target
    endpoint exists, set a conversation timer when asked, and exit.

    Payload: ``(initiator handle, time.time() just before the timer/lifetime started)``.
    """

    def work() -> tuple[str, float]:
        with Broker(url, migrate=False, timers=False) as broker:
            started = time.time()
            handle = broker.begin_dialog(
                INITIATOR_SERVICE, TARGET_SERVICE, CONTRACT, lifetime=lifetime
            )
            broker.send(handle, REQUEST, b"hello")
            if timer_seconds is not None:
                started = time.time()
                broker.begin_conversation_timer(handle, timer_seconds)
        return str(handle), started

    _report(results, work)


def blocked_receive(url: str, queue: str, timeout: float, blocked: Any, results: Any) -> None:
    """RECEIVE with ``timeout``; set ``blocked`` once the receive found nothing and went to
    sleep in its WAITFOR. Payload: ``(messages, monotonic time receive returned)``."""

    def work() -> tuple[list[Received], float]:
        with Broker(url, migrate=False, timers=False) as broker:
            wakeups = broker.waiting.wakeups  # test hook: learn when WAITFOR starts to sleep
            original_wait = wakeups.wait

            def wait(queue_name: str, seen: int, wait_timeout: float) -> bool:
                if original_wait(queue_name, seen, 0):  # woken already: no real sleep
                    return True
                blocked.set()
                return original_wait(queue_name, seen, wait_timeout)

            wakeups.wait = wait  # type: ignore[method-assign]
            messages = broker.receive(queue, top=10, timeout=timeout)
            returned = time.monotonic()
        return _plain(messages), returned

    _report(results, work)
