"""A task's lease lives while its answer waits for the database: an answer retried past
the lease (a storm of lost connections) once let the poison policy fail a task that had
run and succeeded (CI: test_terminated_backends, an answer retried for 31.8 s under a
30 s lease)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from scheduler_lib.broker import Broker, ConnectionLost
from scheduler_lib.scheduler import Executor, Task, TaskScheduler

LEASE = 1.0  # seconds: renewed every third of it
HELD = 3.0  # seconds the answer cannot commit: three leases


def test_a_lease_lives_while_the_answer_waits_for_the_database(
    sched: Broker, scheduler: TaskScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = scheduler.get_scheduler()
    log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -5))
    executor = Executor(sched, "QueueAsyncTarget", lease=LEASE, idle_timeout=1)
    answer = Executor._answer
    fired: list[int] = []
    held_until = time.monotonic() + HELD

    def lost_for_a_while(self: Executor, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < held_until:
            time.sleep(0.1)
            # Meanwhile the timer thread expires the leases whose heartbeat stopped
            fired.append(sched.fire_timers())
            raise ConnectionLost("the connection was lost", committing=True)
        return answer(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "_answer", lost_for_a_while)
    # When the task runs and its answer cannot commit for three leases
    assert executor.run_one(timeout=5)
    # Then no lease expired meanwhile, and the task's row and answer say it succeeded once
    assert len(fired) > 10 and not any(fired), fired
    (row,) = sched.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "5")
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
