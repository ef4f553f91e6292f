"""Wakeups.wait_for_arrivals: how synchronization gathers answers before one RECEIVE."""

from __future__ import annotations

import threading
import time

from scheduler_lib.broker.db.wakeup import Wakeups

QUEUE = "InitiatorQueue"


def _notify_later(wakeups: Wakeups, times: int, every: float) -> threading.Thread:
    def run() -> None:
        for _ in range(times):
            time.sleep(every)  # the arrivals' pace is what is under test
            wakeups.notify([QUEUE])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_returns_as_soon_as_the_count_has_arrived() -> None:
    wakeups = Wakeups()
    seen = wakeups.generation(QUEUE)
    # Given three arrivals announced already
    wakeups.notify([QUEUE])
    wakeups.notify([QUEUE])
    wakeups.notify([QUEUE])
    # When waiting for three, with a long window, Then it does not wait at all
    started = time.monotonic()
    assert wakeups.wait_for_arrivals(QUEUE, seen, 3, window=30.0, timeout=30.0) == 3
    assert time.monotonic() - started < 1.0


def test_gathers_for_the_window_after_the_first_arrival() -> None:
    wakeups = Wakeups()
    seen = wakeups.generation(QUEUE)
    # Given one arrival now and others 0.05 s apart, fewer than awaited
    thread = _notify_later(wakeups, 3, 0.05)
    started = time.monotonic()
    # When waiting for ten with a 0.12 s window (and a long timeout)
    moved = wakeups.wait_for_arrivals(QUEUE, seen, 10, window=0.12, timeout=30.0)
    waited = time.monotonic() - started
    thread.join()
    # Then it returned the window after the first, with what had come by then
    assert 1 <= moved < 10
    assert 0.05 + 0.12 - 0.02 <= waited < 5.0


def test_gives_up_after_the_timeout_when_nothing_arrives() -> None:
    wakeups = Wakeups()
    seen = wakeups.generation(QUEUE)
    wakeups.notify(["another queue"])  # other queues' arrivals do not count
    started = time.monotonic()
    assert wakeups.wait_for_arrivals(QUEUE, seen, 2, window=0.01, timeout=0.2) == 0
    assert time.monotonic() - started >= 0.19
