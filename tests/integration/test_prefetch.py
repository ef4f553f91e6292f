"""An executor's prefetch on PostgreSQL (``scheduler_lib.scheduler.prefetch``): while a
queue's tasks run short, one take gets several tasks; the executor runs the first, whose
start the take recorded, and holds the others for this process's next free reader.
What must hold: a held task is QUEUED in its row until it runs (its start recorded
then, durably), each task runs once; a held task that no reader of the process is free
for goes back to its queue for any other reader; a stopping reader gives back what it
held; a take holds nothing below its first task's level."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Task, TaskScheduler
from scheduler_lib.scheduler import prefetch as prefetching

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"
DEADLINE = 30.0  # seconds any wait below gives its condition

_released = threading.Event()


def hold_until_released() -> str:
    """A task that runs until the test lets it go (a long task, as far as prefetch sees)."""
    if not _released.wait(DEADLINE):
        raise TimeoutError("the test never let this task go")
    return "let go"


@pytest.fixture
def broker(pg_scheduler_broker: Broker, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    _released.clear()
    # A warm-up task counts as short however slow the machine is (a run past the
    # threshold would turn prefetch off and leave these tests nothing to check)
    monkeypatch.setattr(prefetching, "SHORT", DEADLINE)
    # and one take from one scheduler is enough to prefetch from it (the rule that a run
    # of takes must serve one scheduler first is the unit test's and the fairness test's)
    monkeypatch.setattr(prefetching, "ONE_SCHEDULER", 1)
    yield pg_scheduler_broker
    _released.set()  # a task still held by a failed test ends


def _warm(scheduler: TaskScheduler, executor: Executor) -> None:
    """One short task run: the queue's tasks are known to run short from then on."""
    handle = scheduler.get_scheduler()
    scheduler.exec_async(handle, Task.python("builtins:abs", -1))
    assert executor.run_one(timeout=5)
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def _short_wave(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, n: int
) -> tuple[TaskScheduler, Executor, Any, list[int]]:
    """A warm reader with prefetch 4 whose held tasks never go back (however slow the
    machine), and a wave of ``n`` short tasks sent to it."""
    monkeypatch.setattr(prefetching, "HOLD", DEADLINE)
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=1, prefetch=4)
    _warm(scheduler, executor)
    handle = scheduler.get_scheduler()
    log_ids = scheduler.exec_many(
        handle, [Task.python("builtins:abs", -i, name=f"t{i}") for i in range(n)]
    )
    return scheduler, executor, handle, log_ids


def _long_then_short(scheduler: TaskScheduler, handle: Any) -> list[int]:
    """A wave of one task that runs until the test lets it go, then three short ones."""
    return scheduler.exec_many(
        handle,
        [Task.python(f"{__name__}:hold_until_released", name="long")]
        + [Task.python("builtins:abs", -n, name=f"short{n}") for n in range(3)],
    )


def _statuses(broker: Broker, log_ids: list[int]) -> dict[int, str]:
    return {i: broker.fetch("log_get", log_id=i)[0]["status"] for i in log_ids}


def _watch_runs(
    broker: Broker, executor: Executor, log_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, dict[int, str]]]:
    """(log id, every task's status) as each task is about to run, in run order."""
    seen: list[tuple[int, dict[int, str]]] = []
    run = executor._run

    def watching(lease: Any, log_id: int, *rest: Any) -> None:
        seen.append((log_id, _statuses(broker, log_ids)))
        run(lease, log_id, *rest)

    monkeypatch.setattr(executor, "_run", watching)
    return seen


def _ran_once_each_alone_in_order(
    broker: Broker, log_ids: list[int], seen: list[tuple[int, dict[int, str]]]
) -> None:
    """One reader ran ``log_ids`` (``seen`` by :func:`_watch_runs`): at every task's run it
    was the only RUNNING row (the others QUEUED or done), each ran once, and each started
    after the one before it ended."""
    assert len(seen) == len(log_ids)
    for log_id, statuses in seen:
        running = [i for i, s in statuses.items() if s == "RUNNING"]
        assert running == [log_id], (log_id, statuses)
    rows = [broker.fetch("log_get", log_id=i)[0] for i in log_ids]
    assert [(r["status"], r["attempts"]) for r in rows] == [("SUCCEEDED", 1)] * len(rows)
    by_start = sorted(rows, key=lambda r: r["start_time"])
    for before, after in itertools.pairwise(by_start):
        assert after["start_time"] >= before["end_time"], (before, after)


def _wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE} s: {what}")
        time.sleep(0.02)


def test_a_take_of_several_starts_each_task_only_when_it_runs(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, executor, handle, log_ids = _short_wave(broker, monkeypatch, 8)
    takes: list[int] = []
    take = broker.take_recorded

    def counting(*args: Any, **kwargs: Any) -> Any:
        leases, rows = take(*args, **kwargs)
        takes.append(len(leases))
        return leases, rows

    monkeypatch.setattr(broker, "take_recorded", counting)
    seen = _watch_runs(broker, executor, log_ids, monkeypatch)
    # When one reader runs the wave
    for _ in log_ids:
        assert executor.run_one(timeout=5)
    # Then takes got several tasks at once (fewer takes than tasks)
    assert sum(takes) == len(log_ids) and len(takes) < len(log_ids), takes
    # And at every task's run it was the only RUNNING row; each ran once, in turn
    _ran_once_each_alone_in_order(broker, log_ids, seen)
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def test_held_tasks_go_back_when_no_reader_of_the_process_is_free(
    broker: Broker, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=1, prefetch=4, worker=lambda: "busy")
    _warm(scheduler, executor)
    # Given a wave whose first task runs long, taken with three short ones by a process
    # whose one reader is busy with it
    handle = scheduler.get_scheduler()
    long_id, *short_ids = _long_then_short(scheduler, handle)
    held: list[str] = []
    hold = prefetching.Prefetched.hold

    def holding(self: prefetching.Prefetched, leases: Any) -> None:
        held.extend(lease.lease_id for lease in leases)
        hold(self, leases)

    monkeypatch.setattr(prefetching.Prefetched, "hold", holding)
    busy = threading.Thread(target=executor.run_one, kwargs={"timeout": 5})
    busy.start()
    try:
        _wait_until(
            lambda: _statuses(broker, [long_id])[long_id] == "RUNNING", "the long task runs"
        )
        assert len(held) == len(short_ids)  # the take held the three short ones
        # When another process's reader looks for work while the long task runs
        other = Broker(postgres_url, timers=False)
        try:
            elsewhere = Executor(other, QUEUE, idle_timeout=1, prefetch=1, worker=lambda: "free")
            ran_elsewhere = 0
            deadline = time.monotonic() + DEADLINE
            while ran_elsewhere < len(short_ids) and time.monotonic() < deadline:
                ran_elsewhere += elsewhere.run_one(timeout=1)
        finally:
            other.close()
        # Then the three held tasks went back to the queue (after HOLD) and ran there,
        # while the long one still runs
        assert ran_elsewhere == len(short_ids)
        assert _statuses(broker, [long_id])[long_id] == "RUNNING"
        rows = [broker.fetch("log_get", log_id=i)[0] for i in short_ids]
        assert [(r["status"], r["attempts"], r["worker_id"]) for r in rows] == [
            ("SUCCEEDED", 1, "free")
        ] * len(short_ids)
    finally:
        _released.set()
        busy.join(DEADLINE)
    assert not busy.is_alive()
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
    (row,) = broker.fetch("log_get", log_id=long_id)
    assert (row["status"], row["attempts"], row["worker_id"]) == ("SUCCEEDED", 1, "busy")


def test_a_stopping_reader_gives_back_what_it_holds(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetching, "HOLD", DEADLINE)  # only the stop gives them back
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=30, prefetch=4)
    _warm(scheduler, executor)
    handle = scheduler.get_scheduler()
    long_id, *short_ids = _long_then_short(scheduler, handle)
    stop = threading.Event()
    serving = threading.Thread(target=executor.serve, args=(stop,))
    serving.start()
    try:
        _wait_until(
            lambda: _statuses(broker, [long_id])[long_id] == "RUNNING", "the long task runs"
        )
        # Given the three short tasks held (none on the queue, none started)
        assert len(broker.peek(QUEUE)) == 0
        assert set(_statuses(broker, short_ids).values()) == {"QUEUED"}
        # When the reader is asked to stop, and its long task ends
        stop.set()
        _released.set()
        serving.join(DEADLINE)
        assert not serving.is_alive()
    finally:
        stop.set()
        _released.set()
    # Then what it held is back on the queue, not started, and runs elsewhere once
    assert len(broker.peek(QUEUE)) == len(short_ids)
    assert set(_statuses(broker, short_ids).values()) == {"QUEUED"}
    again = Executor(broker, QUEUE, idle_timeout=1, prefetch=1)
    for _ in short_ids:
        assert again.run_one(timeout=5)
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
    rows = [broker.fetch("log_get", log_id=i)[0] for i in [long_id, *short_ids]]
    assert [(r["status"], r["attempts"]) for r in rows] == [("SUCCEEDED", 1)] * len(rows)


def test_a_task_cancelled_while_held_is_answered_not_run(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, executor, handle, (first, nxt, *held) = _short_wave(broker, monkeypatch, 4)
    # Given one take got the four tasks: the first ran, and its answer started the next
    # (this reader runs it next), two are held
    assert executor.run_one(timeout=5)
    assert _statuses(broker, [nxt, *held]) == {nxt: "RUNNING", **dict.fromkeys(held, "QUEUED")}
    assert broker.peek(QUEUE) == []
    # When the scheduler's queued tasks are cancelled, and the reader looks for work
    assert scheduler.cancel_queued(handle, reason="not wanted") == len(held)
    for _ in [nxt, *held]:
        assert executor.run_one(timeout=5)
    # Then the started one ran, and each held one was answered CANCELLED, never started
    scheduler.synchronization(handle, timeout=5)
    rows = [broker.fetch("log_get", log_id=i)[0] for i in held]
    assert [(r["status"], r["attempts"]) for r in rows] == [("CANCELLED", 0)] * len(held)
    for log_id in (first, nxt):
        (row,) = broker.fetch("log_get", log_id=log_id)
        assert (row["status"], row["attempts"]) == ("SUCCEEDED", 1)
    assert broker.leases(QUEUE) == []


_cancel: list[Any] = []  # what the next task calls (the test's)


def cancel_the_rest() -> int:
    """A task that cancels its scheduler's queued tasks while it runs."""
    return int(_cancel[0]())


def test_a_held_tasks_start_rides_in_the_answer_before_it(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, executor, handle, log_ids = _short_wave(broker, monkeypatch, 8)
    starts: list[str] = []
    run = broker.run

    def counting(query: str, **binds: Any) -> Any:
        starts.append(query)
        return run(query, **binds)

    monkeypatch.setattr(broker, "run", counting)
    seen = _watch_runs(broker, executor, log_ids, monkeypatch)
    # When one reader runs the wave, two takes of four
    for _ in log_ids:
        assert executor.run_one(timeout=5)
    # Then no held task's start took a statement of its own: each rode in the answer of
    # the task before it (the first of each take: in the take's round trip)
    assert "log_start" not in starts, starts
    # And at every task's run it was the only RUNNING row; each ran once, in turn
    _ran_once_each_alone_in_order(broker, log_ids, seen)
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def test_a_held_task_cancelled_before_its_start_could_ride_is_answered_not_run(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetching, "HOLD", DEADLINE)
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=1, prefetch=4)
    _warm(scheduler, executor)
    handle = scheduler.get_scheduler()
    _cancel[:] = [lambda: scheduler.cancel_queued(handle, reason="not wanted")]
    # Given a take of four whose first task cancels the others while they are held
    first, *held = scheduler.exec_many(
        handle,
        [Task.python(f"{__name__}:cancel_the_rest", name="canceller")]
        + [Task.python("builtins:abs", -n, name=f"t{n}") for n in range(3)],
    )
    try:
        ran = _watch_runs(broker, executor, [first, *held], monkeypatch)
        for _ in [first, *held]:
            assert executor.run_one(timeout=5)
    finally:
        _cancel.clear()
    # Then the start that rode in the first task's answer wrote nothing, and no held
    # task ran: each was answered CANCELLED
    assert [log_id for log_id, _ in ran] == [first]
    rows = [broker.fetch("log_get", log_id=i)[0] for i in held]
    assert [(r["status"], r["attempts"]) for r in rows] == [("CANCELLED", 0)] * len(held)
    (row,) = broker.fetch("log_get", log_id=first)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "3")
    assert broker.leases(QUEUE) == []
    statuses = {scheduler.synchronization(handle, timeout=5).status for _ in range(4)}
    assert statuses == {"SUCCEEDED", "CANCELLED"}


def interrupt() -> None:
    """A task that is stopped by Ctrl-C."""
    raise KeyboardInterrupt


def test_a_reader_stopped_by_ctrl_c_starts_no_held_task(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetching, "HOLD", DEADLINE)
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=1, prefetch=4)
    _warm(scheduler, executor)
    handle = scheduler.get_scheduler()
    # Given a take of four whose first task is stopped by Ctrl-C (in the main thread)
    _, *held = scheduler.exec_many(
        handle,
        [Task.python(f"{__name__}:interrupt", name="ctrl-c")]
        + [Task.python("builtins:abs", -n, name=f"t{n}") for n in range(3)],
    )
    with pytest.raises(KeyboardInterrupt):
        executor.run_one(timeout=5)
    # Then it was answered, and no held task was started by its answer: they stay
    # QUEUED, held for the process (which stops, giving them back)
    assert scheduler.synchronization(handle, timeout=5).status == "FAILED"
    assert _statuses(broker, held) == dict.fromkeys(held, "QUEUED")
    assert executor._next is None
    assert executor._prefetched.give_back() == len(held)
    assert len(broker.peek(QUEUE)) == len(held)


def test_a_task_reserved_while_its_answer_waits_keeps_its_lease(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next task's start rides in the answer: while the answer waits (here a slow
    one: the database slow to take it), the reserved task's lease is renewed; it must not
    expire under the reader that will run it."""
    monkeypatch.setattr(prefetching, "HOLD", DEADLINE)
    lease = 1.5
    scheduler = TaskScheduler(broker)
    executor = Executor(broker, QUEUE, idle_timeout=1, prefetch=4, lease=lease)
    _warm(scheduler, executor)
    handle = scheduler.get_scheduler()
    log_ids = scheduler.exec_many(
        handle, [Task.python("builtins:abs", -n, name=f"t{n}") for n in range(4)]
    )
    answering = threading.Event()
    go_on = threading.Event()
    answer = executor._answer

    def slow(*args: Any, **kwargs: Any) -> None:
        if not answering.is_set():  # the first answer only
            answering.set()
            go_on.wait(DEADLINE)
        answer(*args, **kwargs)

    monkeypatch.setattr(executor, "_answer", slow)
    ran: list[bool] = []  # (one reader: one thread runs the four)
    first = threading.Thread(
        target=lambda: ran.extend(executor.run_one(timeout=5) for _ in log_ids)
    )
    first.start()
    try:
        # Given the first task's answer waiting, the next task reserved for its reader
        _wait_until(answering.is_set, "the first answer waits")
        assert executor._next is not None
        # When it waits for three leases while expired leases are looked for
        deadline = time.monotonic() + 3 * lease
        while time.monotonic() < deadline:
            broker.fire_timers()
            time.sleep(0.1)
    finally:
        go_on.set()
        first.join(DEADLINE)
    assert not first.is_alive()
    assert ran == [True] * len(log_ids)
    # Then no lease expired: each task ran once, here, and was answered once
    rows = [broker.fetch("log_get", log_id=i)[0] for i in log_ids]
    assert [(r["status"], r["attempts"]) for r in rows] == [("SUCCEEDED", 1)] * len(rows)
    answers = [scheduler.synchronization(handle, timeout=5).status for _ in log_ids]
    assert answers == ["SUCCEEDED"] * len(log_ids)
    assert broker.leases(QUEUE) == []


def test_a_take_whose_reply_was_lost_runs_the_task_it_started_first(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, executor, handle, log_ids = _short_wave(broker, monkeypatch, 4)
    # Given a take of four whose start statement committed but whose reply was lost,
    # its leases handed over last first (the one started is not the first of the list)
    take = broker.take_recorded
    lost: list[int] = []

    def losing(*args: Any, **kwargs: Any) -> Any:
        leases, rows = take(*args, **kwargs)
        if len(leases) > 1:
            lost.append(len(rows or ()))
            return list(reversed(leases)), None
        return leases, rows

    monkeypatch.setattr(broker, "take_recorded", losing)
    seen = _watch_runs(broker, executor, log_ids, monkeypatch)
    # When one reader runs them
    for _ in log_ids:
        assert executor.run_one(timeout=5)
    # Then the task the statement started ran first, each alone RUNNING at its run,
    # and each counted one attempt
    assert lost == [1]
    assert seen[0][0] == log_ids[0]
    for log_id, statuses in seen:
        assert [i for i, s in statuses.items() if s == "RUNNING"] == [log_id], statuses
    rows = [broker.fetch("log_get", log_id=i)[0] for i in log_ids]
    assert [(r["status"], r["attempts"]) for r in rows] == [("SUCCEEDED", 1)] * len(rows)
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def test_one_long_task_turns_prefetch_off() -> None:
    held = prefetching.Prefetched(None, QUEUE)  # type: ignore[arg-type]
    for _ in range(prefetching.ONE_SCHEDULER):
        held.took("one scheduler")
    # Before any task ran, and after short ones, and after one long one
    before = held.top(4)
    held.ran(0.001)
    short = held.top(4)
    held.ran(2 * prefetching.SHORT)
    after_long = held.top(4)
    assert (before, short, after_long) == (1, 4, 1)
