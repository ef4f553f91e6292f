"""What waiting for messages costs on PostgreSQL: an empty RECEIVE looks once before it
waits; its connection keeps its prepared statements (psycopg drops them all at every
ROLLBACK, so a waiting reader whose idle transaction ended that way planned its statements
anew); and a process LISTENs only once something in it waits for wakeups (a RECEIVE, a
queue monitor, a transport endpoint's loader); and readers side by side never come back
empty while a conversation group nobody holds has messages (a one-statement RECEIVE's
snapshot predates its group lock)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.broker.activation import ActivationRuntime
from scheduler_lib.broker.db import store
from scheduler_lib.broker.db.store import Store
from scheduler_lib.broker.transport.endpoint import TransportEndpoint

pytestmark = pytest.mark.postgres

QUEUE = "Inbox"


@pytest.fixture
def broker(postgres_url: str) -> Iterator[Broker]:
    broker = Broker(postgres_url, timers=False)
    try:
        broker.create_queue(QUEUE)
        yield broker
    finally:
        broker.close()


def _looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The one-statement RECEIVEs run from now on."""
    ran: list[str] = []
    on_driver = Store._on_driver

    def counting(self: Store, conn: Any, query: str, params: Any) -> Any:
        if query.startswith("receive_fast"):
            ran.append(query)
        return on_driver(self, conn, query, params)

    monkeypatch.setattr(Store, "_on_driver", counting)
    return ran


def test_an_empty_receive_looks_once(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    broker.receive(QUEUE, timeout=0)  # the queue's settings are read once, then cached
    looks = _looks(monkeypatch)
    # When a RECEIVE that does not wait finds the queue empty, alone or in a transaction
    assert broker.receive(QUEUE, timeout=0) == []
    with broker.transaction() as tx:
        assert tx.receive(QUEUE, timeout=0) == []
    # Then each looked once
    assert looks == ["receive_fast_one", "receive_fast_one"]  # (TOP 1, the default)


def test_a_waiting_receive_keeps_the_prepared_statements(broker: Broker) -> None:
    with broker.transaction() as tx:
        # When RECEIVEs wait and find nothing, again and again (each of their looks runs
        # in a transaction of its own that wrote nothing and ends before the wait)
        for _ in range(8):
            assert tx.receive(QUEUE, timeout=0.02) == []
        # Then the connection still has the looks' statement prepared (psycopg prepares
        # a statement at its fifth run)
        prepared = tx.session.connection().exec_driver_sql(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%queue_messages%%'"
        )
        assert prepared.scalar() >= 1


def _listening(broker: Broker) -> int:
    """The sessions of the broker's database that LISTEN (their last statement)."""
    with broker.transaction() as tx:
        rows = tx.session.connection().exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        )
        return int(rows.scalar())


def test_a_process_that_only_sends_does_not_listen(broker: Broker) -> None:
    broker.create_message_type("Note")
    broker.create_contract("Notes", {"Note": "INITIATOR"})
    broker.create_service("From", QUEUE)
    broker.create_service("To", QUEUE, ["Notes"])
    handle = broker.begin_dialog("From", "To", "Notes")
    # When the process sends, and RECEIVEs without waiting
    for _ in range(3):
        broker.send(handle, "Note", b"x")
    assert len(broker.receive(QUEUE, top=3, timeout=0)) == 3
    # Then no session of it LISTENs (PostgreSQL would signal it at every NOTIFY)
    assert _listening(broker) == 0
    # And a RECEIVE that waits starts listening, so that a sender's NOTIFY wakes it
    assert broker.receive(QUEUE, timeout=0.05) == []
    assert _listening(broker) == 1


def _until_listening(broker: Broker) -> int:
    deadline = time.monotonic() + 10
    while _listening(broker) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return _listening(broker)


def test_queue_monitors_listen_though_nothing_waits_here(broker: Broker) -> None:
    # When an activation runtime starts in a process where no RECEIVE waits
    runtime = ActivationRuntime(broker).start()
    try:
        # Then the process LISTENs: its monitors hear arrivals announced for readers of
        # other processes
        assert _until_listening(broker) == 1
    finally:
        runtime.stop()


def test_a_transport_endpoint_listens_though_nothing_waits_here(broker: Broker) -> None:
    # When a transport endpoint starts in a process where no RECEIVE waits
    with TransportEndpoint(broker, key="k" * 16, listen="127.0.0.1:0"):
        # Then the process LISTENs: its loader hears what other processes put in the
        # transmission queue at once, not at its next poll
        assert _until_listening(broker) == 1


def test_a_connection_lost_at_the_idle_commit_of_a_waiting_synchronization(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler_lib.broker.db.session import Session
    from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

    broker = Broker(postgres_url, timers=False)
    try:
        init(broker, targets=[Target(activation=False)])
        scheduler = TaskScheduler(broker)
        handle = scheduler.get_scheduler()
        log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -5))
        # Given: the COMMIT that ends a waiting RECEIVE's idle transaction meets a backend
        # that was just terminated (the first time it runs)
        killed = threading.Event()
        release = Session.release_while_idle

        def killing(self: Session) -> None:
            conn = self.connection() if self.connected else None
            if not killed.is_set() and conn is not None and store.in_transaction(conn):
                pid = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
                with broker.transaction() as tx:
                    tx.session.connection().exec_driver_sql(
                        f"SELECT pg_terminate_backend({int(pid)})"
                    )
                killed.set()
            release(self)

        monkeypatch.setattr(Session, "release_while_idle", killing)
        answered: list[Any] = []
        waiting = threading.Thread(
            target=lambda: answered.append(scheduler.synchronization(handle, timeout=30)),
            daemon=True,
        )
        # When synchronization waits and is woken with nothing there for it (as by an
        # answer to another scheduler on the same queue), so that it looks in a transaction
        waiting.start()
        queue = scheduler.names.initiator_queue
        deadline = time.monotonic() + 10
        while not killed.is_set() and time.monotonic() < deadline:
            broker.waiting.wakeups.notify({queue})
            killed.wait(0.01)
        assert killed.is_set(), "the idle transaction's end was never reached"
        # And the task runs afterwards
        assert Executor(broker, "QueueAsyncTarget", idle_timeout=1).run_one(timeout=10)
        waiting.join(30)
        # Then synchronization rode through the lost connection and got the answer once
        assert not waiting.is_alive()
        [completion] = answered
        assert (completion.log_id, completion.status) == (log_id, "SUCCEEDED")
        (row,) = broker.fetch("log_get", log_id=log_id)
        assert (row["status"], row["attempts"]) == ("SUCCEEDED", 1)
    finally:
        broker.close()


CONVERSATIONS = 8  # each its own conversation group
READERS = 4
MESSAGES = 800


@pytest.mark.parametrize("how", ["receive", "take"])
def test_concurrent_readers_never_come_back_empty_while_a_free_group_has_messages(
    broker: Broker, how: str
) -> None:
    # Given messages spread round robin over eight conversation groups, the oldest first
    broker.create_message_type("Job")
    broker.create_contract("JobContract", {"Job": "INITIATOR"})
    broker.create_queue("Senders")
    broker.create_service("SenderService", "Senders")
    broker.create_service("InboxService", QUEUE, ["JobContract"])
    handles = [
        broker.begin_dialog("SenderService", "InboxService", "JobContract")
        for _ in range(CONVERSATIONS)
    ]
    with broker.transaction() as tx:
        for i in range(MESSAGES):
            tx.send(handles[i % CONVERSATIONS], "Job", b"%d" % i)
    taken: list[bytes] = []
    wrongly_empty: list[int] = []
    lock = threading.Lock()

    def read() -> None:
        while True:
            if how == "receive":
                got = [m.body for m in broker.receive(QUEUE, timeout=0)]
            else:
                leases = broker.take(QUEUE, timeout=0, durable=False)
                got = [lease.message.body for lease in leases]
                for lease in leases:
                    broker.complete(lease)
            with lock:
                if not got and len(taken) < MESSAGES - CONVERSATIONS * READERS:
                    # The groups drain evenly (the oldest message comes first), so every
                    # group still had messages, and the other readers held three at most.
                    wrongly_empty.append(len(taken))
                taken.extend(got)
                if len(taken) >= MESSAGES:
                    return

    # When four readers RECEIVE (or take) without waiting, one message at a time
    threads = [threading.Thread(target=read) for _ in range(READERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # Then none came back empty while a group nobody held had messages (the statement's
    # snapshot predates its group lock: it must read past what the group's last holder
    # took meanwhile), and each message came once
    assert wrongly_empty == []
    assert sorted(taken, key=int) == [b"%d" % i for i in range(MESSAGES)]
