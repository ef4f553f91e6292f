"""Synchronization returns each answer once, durably (issue 22.4): no answer a RECEIVE took
exists only in a caller's memory, so callers in several processes attached to one
scheduler share its answers, and a caller killed between two calls and restarted (by
``attach``) still gets every outcome, once. Real processes, real activated readers."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from multiproc import collect, poll, running

from scheduler_lib.broker import Broker, MessageStatus, activation
from scheduler_lib.scheduler import Target, TaskScheduler, init

WAIT = 60.0  # seconds: the longest a step of a test may take
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def served(broker: Broker) -> Iterator[Broker]:
    """A broker with the scheduler's catalog whose target queue's readers are activated."""
    init(broker, targets=[Target(max_readers=4)])
    with activation.running(broker, empty_grace=0.1, check_interval=0.2):
        yield broker


def _next(results: Any) -> tuple[int, Any]:
    ((pid, payload),) = collect(results, 1, timeout=WAIT)
    return pid, payload


def _all_answered(broker: Broker, handle: str, log_ids: list[int]) -> None:
    """Wait until every task's row says it ended and its answer waits on the initiator
    queue, so a RECEIVE that takes more than one answer would take them all at once."""
    scheduler = TaskScheduler(broker)

    def waiting() -> int:
        return sum(
            1
            for m in broker.peek("QueueAsyncInitiator")
            if str(m.conversation_handle) == handle and m.status == MessageStatus.READY
        )

    poll(
        lambda: scheduler.wave_progress(handle, log_ids).done and waiting() == len(log_ids),
        WAIT,
        "every task ended and answered",
        explain=lambda: ([r["status"] for r in scheduler.log(handle)], waiting()),
    )


def _outcomes(broker: Broker, handle: str) -> dict[int, tuple[str, Any]]:
    """Each task's outcome as its ``execution_log`` row records it."""
    return {
        int(r["log_id"]): (r["status"], None if r["result"] is None else int(r["result"]))
        for r in TaskScheduler(broker).log(handle)
    }


def test_two_attached_callers_share_the_answers_each_returned_once(
    served: Broker, db_url: str
) -> None:
    # Given a caller that sent a wave of 8 tasks, and a second process attached to its
    # scheduler; every task has ended, so all 8 answers wait on the initiator queue
    results, go_sender, go_attached = CTX.Queue(), CTX.Event(), CTX.Event()
    from synchronization_workers import attach_then_synchronize, send_then_synchronize

    sender = CTX.Process(target=send_then_synchronize, args=(db_url, 8, 4, go_sender, results))
    with running([sender]):
        sender_pid, (_, handle, log_ids) = _next(results)
        attached = CTX.Process(
            target=attach_then_synchronize, args=(db_url, handle, 4, go_attached, results)
        )
        with running([attached]):
            _, (what, in_flight) = _next(results)
            assert what == "attached" and 0 <= in_flight <= 8
            _all_answered(served, handle, log_ids)

            # When the sender calls synchronization first, then each calls it 4 times in all
            go_sender.set()
            pid, first = _next(results)
            assert pid == sender_pid and first[0] == "done"
            go_attached.set()
            returned: dict[int, list[tuple[int, str, Any]]] = {pid: [first[1:]]}
            finished = 0
            while finished < 2:
                pid, payload = _next(results)
                if payload[0] == "finished":
                    finished += 1
                else:
                    _, log_id, status, result = payload
                    returned.setdefault(pid, []).append((log_id, status, result))

    # Then every answer was returned once, to one of them: 4 each, none twice, none lost
    assert sorted(len(got) for got in returned.values()) == [4, 4]
    every = [item for got in returned.values() for item in got]
    assert sorted(log_id for log_id, _, _ in every) == sorted(log_ids)
    # and each is the outcome the log recorded (task i returns i)
    outcomes = _outcomes(served, handle)
    assert {log_id: (status, result) for log_id, status, result in every} == outcomes
    assert sorted(result for _, _, result in every) == list(range(8))
    assert sender_pid in returned


def test_a_caller_killed_between_two_calls_and_restarted_gets_every_outcome_once(
    served: Broker, db_url: str
) -> None:
    # Given a caller that sent a wave of 6 tasks, all of them ended, and that returned one
    # completion; it is SIGKILLed before its second synchronization call
    results, go = CTX.Queue(), CTX.Event()
    from synchronization_workers import attach_then_synchronize, send_then_synchronize

    caller = CTX.Process(
        target=send_then_synchronize, args=(db_url, 6, 1, go, results), kwargs={"hang": True}
    )
    with running([caller]):
        pid, (_, handle, log_ids) = _next(results)
        _all_answered(served, handle, log_ids)
        go.set()
        _, first = _next(results)
        assert first[0] == "done"
        assert _next(results)[1] == ("finished",)
        os.kill(pid, signal.SIGKILL)
        caller.join(WAIT)
        assert caller.exitcode == -signal.SIGKILL

    # When it is restarted: it attaches to the same scheduler and calls synchronization
    # for the 5 tasks left, then once more (a new queue to report on: a process killed
    # while its queue's writer lock was still held would block every later writer)
    results, restarted_go = CTX.Queue(), CTX.Event()
    restarted_go.set()
    restarted = CTX.Process(
        target=attach_then_synchronize,
        args=(db_url, handle, 5, restarted_go, results),
        kwargs={"then_one_more": 1.0},
    )
    with running([restarted]):
        _, (what, in_flight) = _next(results)
        assert (what, in_flight) == ("attached", 0)  # every task ended: none running
        after = [_next(results)[1] for _ in range(5)]
        last = _next(results)[1]
        assert _next(results)[1] == ("finished",)

    # Then the wave completed with every task's outcome exactly once: the one returned
    # before the kill, the 5 others after the restart, and nothing more
    assert last == ("timeout",)
    every = [first, *after]
    assert sorted(log_id for _, log_id, _, _ in every) == sorted(log_ids)
    outcomes = _outcomes(served, handle)
    assert {log_id: (status, result) for _, log_id, status, result in every} == outcomes
    assert all(status == "SUCCEEDED" for status, _ in outcomes.values())
