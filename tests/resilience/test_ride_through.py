"""The broker and the scheduler ride through a PostgreSQL server that stops, restarts or is
killed: calls wait for it and go on, a running task's outcome is recorded exactly once,
a live worker's lease is not expired for the outage, and what gives up says so in one
line. Each test stops a private server (never the shared one)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from marking_tasks import marks
from multiproc import poll
from private_postgres import PrivatePostgres

from scheduler_lib.broker import Broker, DatabaseUnavailable, activation
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

pytestmark = pytest.mark.postgres

HERE = Path(__file__).parent
CLI = str(Path(sys.executable).parent / "scheduler-lib")


@pytest.fixture
def broker(private_db_url: str) -> Iterator[Broker]:
    b = Broker(private_db_url)
    try:
        yield b
    finally:
        b.close()


def _restart_when(
    server: PrivatePostgres, condition: Callable[[], object], down: float
) -> threading.Thread:
    """In the background: once ``condition()`` holds, stop the server for ``down``
    seconds (the outage) and start it again."""

    def run() -> None:
        poll(condition, 60, "the moment to stop the server")
        server.stop_for(down)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_operations_wait_for_a_stopped_server_and_go_on(
    broker: Broker, private_postgres: PrivatePostgres
) -> None:
    broker.create_message_type("Ping")
    broker.create_contract("C", {"Ping": "ANY"})
    broker.create_queue("Q")
    broker.create_service("S", "Q", ["C"])
    handle = broker.begin_dialog("S", "S", "C")
    # Given the server is stopped, and comes back 1.5 s later
    private_postgres.stop()
    starter = threading.Timer(1.5, private_postgres.start)
    starter.start()
    stopped = time.monotonic()
    # When the broker is used meanwhile, Then each call waits for it and then works
    broker.send(handle, "Ping", b"during the outage")
    assert time.monotonic() - stopped >= 1.0  # it did wait
    (message,) = broker.receive("Q", timeout=5)
    assert message.body == b"during the outage"
    starter.join()
    assert broker.availability.available and broker.availability.recovered_at > 0
    # And the connections the restart killed are gone from the pools: nothing but the
    # first call after the outage met one
    lost: list[str] = []
    broker.availability.watch(lambda a: lost.append(str(a.last_error)))
    for _ in range(20):
        broker.queues()
    assert lost == []


def test_a_server_away_past_the_deadline_is_one_clear_error(
    private_db_url: str, private_postgres: PrivatePostgres
) -> None:
    with_password = sa.make_url(private_db_url).set(password="s3cret-pass")
    url = with_password.render_as_string(hide_password=False)
    broker = Broker(url, reconnect_timeout=1)
    try:
        private_postgres.stop()
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as caught:
            broker.queues()
        took = time.monotonic() - started
        assert 1.0 <= took < 10, took
        text = str(caught.value)
        assert "s3cret-pass" not in text and "***" in text
        assert f"127.0.0.1:{private_postgres.port}" in text and "tried for 1 s" in text
    finally:
        private_postgres.start()
        broker.close()
    # And the command line says it in one line, exit 3, no traceback, no password
    private_postgres.stop()
    try:
        result = subprocess.run(
            [CLI, "status", "--db", url, "--reconnect-timeout", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        private_postgres.start()
    assert result.returncode == 3, result.stdout + result.stderr  # could not reach the database
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scheduler-lib: error: "), result.stderr
    assert "unavailable" in lines[0] and "s3cret-pass" not in result.stderr
    assert "Traceback" not in result.stderr


def test_a_task_running_through_a_restart_is_recorded_once(
    broker: Broker, private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    init(broker, targets=[Target(activation=False)])
    scheduler = TaskScheduler(broker)
    marks_file = tmp_path / "marks"
    stop = threading.Event()
    executor = Executor(broker, "QueueAsyncTarget", idle_timeout=600)
    serving = threading.Thread(target=executor.serve, args=(stop,), daemon=True)
    serving.start()
    try:
        handle = scheduler.get_scheduler()
        log_id = scheduler.exec_async(
            handle, Task.python("marking_tasks:mark", str(marks_file), "t1", 2.0)
        )
        # Given the server restarts while the task runs (and is down when it ends)
        restarter = _restart_when(private_postgres, lambda: marks(marks_file)[0]["t1"], 3.0)
        # When the caller waits for it, Then it gets one SUCCEEDED answer
        completion = scheduler.synchronization(handle, timeout=90)
        restarter.join()
        assert (completion.log_id, completion.status) == (log_id, "SUCCEEDED")
        # And the task ran once, and its row says so
        starts, ends = marks(marks_file)
        assert (starts["t1"], ends["t1"]) == (1, 1)
        (row,) = broker.fetch("log_get", log_id=log_id)
        assert (row["status"], row["attempts"]) == ("SUCCEEDED", 1)
        assert row["end_time"] is not None
        assert broker.leases() == []
    finally:
        stop.set()
        serving.join(10)


def test_a_lease_is_not_expired_for_an_outage_longer_than_it(
    private_db_url: str, private_postgres: PrivatePostgres
) -> None:
    holder = Broker(private_db_url, timers=False)
    expirer = Broker(private_db_url, timers=False)  # another process's timer thread
    try:
        holder.create_message_type("Work")
        holder.create_contract("C", {"Work": "ANY"})
        holder.create_queue("Q")
        holder.create_service("S", "Q", ["C"])
        handle = holder.begin_dialog("S", "S", "C")
        holder.send(handle, "Work", b"live")
        holder.send(handle, "Work", b"dead")
        live = holder.take("Q", lease=2.0)
        dead = holder.take("Q", lease=2.0)
        # Given an outage twice as long as the leases (both expire while it lasts)
        private_postgres.stop_for(4.0)
        # When the expirer looks as soon as the server is back
        expirer.fire_timers()
        back = time.time()
        # Then neither lease is expired: their holders get a whole lease to renew them
        held = {r["lease_id"] for r in expirer.leases()}
        assert {live[0].lease_id, dead[0].lease_id} <= held
        # And a live holder renews in time
        holder.renew(live[0])

        # And a lease nobody renews expires once it had that whole lease
        def dead_expired() -> bool:
            holder.renew(live[0])  # the live holder goes on renewing
            expirer.fire_timers()
            return dead[0].lease_id not in {r["lease_id"] for r in expirer.leases()}

        poll(dead_expired, 30, "the unrenewed lease to expire")
        assert time.time() - back >= 1.5
        assert live[0].lease_id in {r["lease_id"] for r in expirer.leases()}
        history = holder.failure_history(dead[0].message)
        assert history.failures == 1 and "worker lost" in (history.last_error or "")
        assert holder.failure_history(live[0].message).failures == 0
    finally:
        holder.close()
        expirer.close()


def reader_that_returns_on_flag(broker: Broker, queue: str) -> None:
    """An activation procedure that returns once its flag file exists."""
    flag = Path(os.environ["RESILIENCE_READER_FLAG"])
    while not flag.exists():
        time.sleep(0.05)


def test_a_reader_that_ends_while_the_server_is_down_leaves_no_row(
    broker: Broker,
    private_postgres: PrivatePostgres,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flag = tmp_path / "flag"
    monkeypatch.setenv("RESILIENCE_READER_FLAG", str(flag))
    broker.create_message_type("Work")
    broker.create_contract("C", {"Work": "ANY"})
    broker.create_queue(
        "Q",
        activation_status=True,
        activation_procedure="test_ride_through:reader_that_returns_on_flag",
        max_queue_readers=1,
    )
    broker.create_service("S", "Q", ["C"])
    with activation.running(broker, heartbeat_interval=0.5, check_interval=0.2) as runtime:
        broker.send(broker.begin_dialog("S", "S", "C"), "Work", b"x")
        poll(lambda: runtime.readers == 1, 20, "a reader")
        assert len(broker.activated_tasks()) == 1
        # Given the reader ends while the server is down (it cannot remove its row)
        private_postgres.stop()
        flag.touch()
        poll(lambda: runtime.readers == 0, 20, "the reader to end")
        private_postgres.start()
        # Then once the server is back, no row says it still runs
        poll(lambda: broker.activated_tasks() == [], 20, "its row to go")
