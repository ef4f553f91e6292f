"""One task's ``exec_async`` on PostgreSQL: its ``execution_log`` row rides inside the
SEND's own statement (``Store.riding``), one autocommit round trip, and is written only
with the message — never a row without its message, nor a message without its row."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from statement_spy import statements as _statements

from scheduler_lib.broker import Broker, ConversationStateError
from scheduler_lib.scheduler import Task, TaskScheduler

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"


@pytest.fixture
def sched(pg_scheduler_broker: Broker) -> Broker:
    return pg_scheduler_broker


def _row(scheduler: TaskScheduler, handle: Any, log_id: int) -> dict[str, Any]:
    return {
        "log_id": log_id,
        "caller_id": scheduler.caller_id,
        "handle": str(handle.conversation_handle),
        "target": handle.target_service,
        "wave": None,
        "name": "t",
        "kind": "python",
        "body": "{}",
        "now": time.time(),
        **scheduler.context,
    }


def test_one_task_is_one_statement_with_its_row(
    sched: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    task = Task.python("builtins:print", name="t")
    scheduler.exec_async(handle, task)  # the first one: caches filled, target made
    ran = _statements(monkeypatch)
    log_id = scheduler.exec_async(handle, task)
    # One statement: the row inside the SEND (no BEGIN / pipeline / COMMIT around it)
    assert ran == ["send_fast+log_insert_one (autocommit)"], ran
    # And both are there, committed: the row (QUEUED) and its message
    monkeypatch.undo()
    (row,) = sched.fetch("log_get", log_id=log_id)
    assert (row["status"], row["task_name"]) == ("QUEUED", "t")
    queued = [m for m in sched.peek(QUEUE) if json.loads(m.body or b"{}")["log_id"] == log_id]
    assert len(queued) == 1, queued


def test_a_send_that_cannot_go_writes_no_row(sched: Broker) -> None:
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    scheduler.exec_async(handle, Task.python("builtins:print", name="warm"))
    # The scheduler's conversation ended on this side: no SEND can go on it
    sched.end_conversation(handle.conversation_handle)
    log_id = 10**12  # an id no sequence gave out
    with pytest.raises(ConversationStateError):
        sched.send(
            handle.conversation_handle,
            scheduler.names.sent,
            "{}",
            before=("log_insert_one", _row(scheduler, handle, log_id)),
        )
    # Nothing half-written: no row without its message
    assert sched.fetch("log_get", log_id=log_id) == []


def test_the_riding_statement_alone_writes_nothing_when_the_send_cannot_go(
    sched: Broker,
) -> None:
    """The riding statement itself, without the transaction's checked path after it: a
    SEND its checks refuse leaves no row (the FROM ``sender`` that guards the row)."""
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    scheduler.exec_async(handle, Task.python("builtins:print", name="warm"))
    sched.end_conversation(handle.conversation_handle)
    store = sched._store
    riding = store.riding("send_fast", "log_insert_one")
    assert riding is not None
    log_id = 10**12 + 1
    with sched.transaction() as tx:
        rows = tx.session.rows(
            riding,
            handle=str(handle.conversation_handle),
            message_type=scheduler.names.sent,
            validation="NONE",
            body=b"{}",
            now=time.time(),
            lease_id=None,
            **{f"before_{k}": v for k, v in _row(scheduler, handle, log_id).items()},
        )
    assert rows == []
    assert sched.fetch("log_get", log_id=log_id) == []


def test_the_next_waves_log_ids_are_taken_while_a_wave_runs(
    sched: Broker, executors: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a wave's last completion to the next wave's send, no statement takes log ids:
    they were taken while the wave ran (off the path between two waves)."""
    scheduler = TaskScheduler(sched)
    waves = [
        [Task.python("builtins:len", [i], name=f"w{w}t{i}") for i in range(70)] for w in (1, 2, 3)
    ]
    ran = _statements(monkeypatch)
    with executors(2):
        report = scheduler.run_waves(
            waves, on_completion=lambda wave, _: ran.append(f"completed {wave}")
        )
    assert report.ok
    sends = [i for i, name in enumerate(ran) if "send_many_fast" in name]
    assert len(sends) == 3, [n for n in ran if "send" in n]
    for wave in (2, 3):
        last = max(i for i, name in enumerate(ran) if name == f"completed {wave - 1}")
        send = next(i for i in sends if i > last)
        between = ran[last : send + 1]
        assert not [name for name in between if name.startswith("log_ids_next")], between
    # and every task still got its own id
    assert len({c.log_id for c in report.completions}) == 210


def test_a_waves_lists_go_as_binary_arrays_and_arrive_as_they_were(sched: Broker) -> None:
    """A wave's bodies, names and ids go as binary arrays (the text form escaped every
    quote of every JSON body in Python); what array syntax would have to escape arrives
    unchanged, in the row and in the message."""
    from psycopg.adapt import PyFormat
    from psycopg.types.array import ListBinaryDumper

    with sched.transaction() as tx:
        driver = tx.session.connection().connection.driver_connection
        assert driver.adapters.get_dumper(list, PyFormat.AUTO) is ListBinaryDumper  # type: ignore[union-attr]
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    awkward = ['a "quoted" {brace}, comma', 'back\\slash \\"', "NULL", "", "ünï €"]
    tasks = [Task.python("builtins:len", [text], name=text or "empty") for text in awkward]
    log_ids = scheduler._send(handle, tasks, 1)
    for log_id, task in zip(log_ids, tasks, strict=True):
        (row,) = sched.fetch("log_get", log_id=log_id)
        assert (row["task_name"], json.loads(row["task_body"])) == (task.label, task.to_dict())
    sent = [json.loads(m.body or b"{}") for m in sched.peek(QUEUE)]
    by_id = {body["log_id"]: body["task"] for body in sent}
    assert [by_id[i] for i in log_ids] == [t.to_dict() for t in tasks]


def test_a_new_schedulers_first_wave_and_first_task_go_in_one_round_trip(
    sched: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new scheduler's first SEND makes its conversation's target endpoint: ahead of
    the SEND in its round trip (``target_create_fast``), not on the checked path's ten
    statements; in a process that never sent the type before too (its validation read
    in one statement). Then the tasks are there, once each, on the target's queue."""
    fresh = Broker(sched.url, migrate=False, timers=False)  # nothing cached: a new process
    try:
        scheduler = TaskScheduler(fresh)
        wave_handle, task_handle = scheduler.get_scheduler(), scheduler.get_scheduler()
        scheduler._reserve_log_ids(4)  # the ids, taken ahead as run_waves does
        ran = _statements(monkeypatch)
        wave = [Task.python("builtins:len", [i], name=f"w{i}") for i in range(3)]
        log_ids = scheduler.exec_many(wave_handle, wave, wave=1)
        log_ids.append(scheduler.exec_async(task_handle, Task.python("builtins:len", [9])))
        assert ran == [
            "message_type_list",
            "pipeline:log_insert_many+target_create_fast+send_many_fast",
            "pipeline:target_create_fast+send_fast+log_insert_one",
        ], ran
    finally:
        fresh.close()
    monkeypatch.undo()
    sent = [json.loads(m.body or b"{}")["log_id"] for m in sched.peek(QUEUE)]
    assert sorted(sent) == sorted(log_ids)
    targets = {
        str(e.conversation_id): e for e in sched.conversation_endpoints() if not e.is_initiator
    }
    for handle in (wave_handle, task_handle):
        near = sched.conversation_endpoint(handle.conversation_handle)
        target = targets[str(near.conversation_id)]
        assert (target.service_name, target.queue_name, target.state.value) == (
            handle.target_service,
            QUEUE,
            "SI",
        )
