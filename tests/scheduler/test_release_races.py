"""release_scheduler called again while an executor ends the target side (issue 22.10):
no deadlock, no dead reader, no endpoint left open."""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid

import pytest
from multiproc import poll

from scheduler_lib.broker import Broker, activation
from scheduler_lib.scheduler import Target, Task, TaskScheduler, init

WAIT = 30.0  # seconds
ROUNDS = 25
RELEASE_OFFSETS = (0.0, 0.0, 0.005, 0.010)  # seconds: two at once, then 5 and 10 ms later


def _all_closed(broker: Broker, conversation: uuid.UUID) -> bool:
    return all(e.conversation_id != conversation for e in broker.conversation_endpoints())


def _release_at_once(scheduler: TaskScheduler, handle: object) -> list[BaseException]:
    """Release the scheduler from one thread per offset; what each raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(RELEASE_OFFSETS))

    def release(offset: float) -> None:
        start.wait()
        if offset:
            time.sleep(offset)  # the stagger, not a wait for a condition
        try:
            scheduler.release_scheduler(handle)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=release, args=(o,)) for o in RELEASE_OFFSETS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a release_scheduler call hangs"
    return errors


@pytest.mark.timeout(600)
def test_releases_racing_the_executors_end_never_deadlock(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: activated executors on the scheduler's target
    init(broker, targets=[Target(max_readers=2)])
    scheduler = TaskScheduler(broker)
    caplog.set_level(logging.WARNING)
    with activation.running(broker, empty_grace=0.1, check_interval=0.2):
        for round_number in range(ROUNDS):
            handle = scheduler.get_scheduler()
            for n in range(3):
                scheduler.exec_async(handle, Task.python("builtins:int", str(n)))
            for _ in range(3):
                assert scheduler.synchronization(handle, timeout=WAIT).ok

            conversation = broker.conversation_endpoint(handle.conversation_handle).conversation_id

            # When: four releases race the executor ending the target side
            errors = _release_at_once(scheduler, handle)

            # Then: none raised, and both endpoints are gone soon
            assert not errors, f"round {round_number}: release_scheduler raised {errors!r}"
            poll(
                functools.partial(_all_closed, broker, conversation),
                WAIT,
                f"round {round_number}: both endpoints of the released scheduler are closed",
                explain=broker.conversation_endpoints,
            )
    # No executor lost a deadlock, so no reader died.
    problems = [
        r.getMessage()
        for r in caplog.records
        if "deadlock" in r.getMessage().lower()
        or ("activation procedure" in r.getMessage() and "failed" in r.getMessage())
    ]
    assert not problems, problems
    assert broker.conversation_endpoints() == []
