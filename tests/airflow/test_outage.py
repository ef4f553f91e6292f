"""The provider rides through a PostgreSQL outage: the Execution Status page, the trigger,
the sensor and ``OrderedWavesOperator`` go on once the database is back, in the same
process, without a restart.

Each test stops (and starts again) a private PostgreSQL cluster of this module
(``bench/private_postgres.py``, as ``tests/resilience`` uses), never the shared server on
5432. The broker's connection is ``scheduler_lib_default`` (an environment variable)
with a password in its URL (the cluster trusts any): no message may show it.

What it proves:

- the page's JSON answers 503 within a few seconds while the database is down, with one
  line naming the database (no password, no traceback), and 200 on the first request
  after it is back — the same app, its broker never reopened; concurrent requests during
  the outage do not each wait for the database; the page itself stays up;
- the trigger keeps waiting through an outage longer than one look's reconnect deadline,
  says so in its log, and fires when the wave is done after the database is back (also
  when it starts during the outage); its deadline still holds during one;
- the sensor's poke rides through a short outage, says "not yet" (with a log line) past
  the reconnect deadline, and returns the wave once the database is back; a deferrable
  sensor defers instead of failing;
- ``OrderedWavesOperator`` finishes a plan through a restart in the middle of a wave, and
  in deferrable mode hands a wait that outlived the reconnect deadline to its trigger,
  then finishes the plan when it resumes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import structlog.testing
from airflow.providers.common.compat.sdk import AirflowException, AirflowFailException, TaskDeferred
from multiproc import poll

from bench.private_postgres import PrivatePostgres, unavailable_reason
from scheduler_lib.airflow import (
    ExecAsyncOperator,
    GetSchedulerOperator,
    OrderedWavesOperator,
    SynchronizationSensor,
    SynchronizationTrigger,
    hooks,
    triggers,
    ui,
)
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init, monitor

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/scheduler-lib"
PASSWORD = "s3cret-outage-pass"
WAIT = 60.0  # seconds: deadline for conditions that hold within seconds
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DEADLINE = 4.0  # seconds: SCHEDULER_LIB_RECONNECT_TIMEOUT where a test shortens it


class Background(threading.Thread):
    """A thread whose exception (or result) the test collects with :meth:`result`."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._target_call = target
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self._target_call()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = WAIT) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"the background thread did not end within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


# --- the private server and a database on it ---------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL cluster for this module; removed at the end."""
    problem = unavailable_reason()
    if problem is not None:
        if IN_CI:
            pytest.fail(f"a private PostgreSQL server is mandatory under CI: {problem}")
        pytest.skip(f"no private PostgreSQL server: {problem}")
    cluster = PrivatePostgres()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def db(
    server: PrivatePostgres, airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A fresh database on the private server, which ``scheduler_lib_default`` points at
    (its URL carries a password); the server is up before and after the test."""
    if not server.is_accepting():
        server.start()
    name = f"outage_{uuid.uuid4().hex[:12]}"
    url = (
        sa.make_url(server.create_database(name))
        .set(password=PASSWORD)
        .render_as_string(hide_password=False)
    )
    monkeypatch.setenv("AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT", connection(url))
    try:
        yield url
    finally:
        hooks.close_brokers()
        if not server.is_accepting():
            server.start()
        server.drop_database(name)


def connection(url: str, **extra: object) -> str:
    return json.dumps({"conn_type": "scheduler_lib", "host": url, "extra": extra})


def database_named(server: PrivatePostgres, url: str) -> str:
    """How messages name the database: host, port and name (never the password)."""
    return f"127.0.0.1:{server.port}/{sa.make_url(url).database}"


@pytest.fixture
def worker_broker(db: str) -> Iterator[Broker]:
    """The scheduler's catalog on the database, and the broker of the executors (a
    process of their own would have one): it rides through outages for 120 s, whatever a
    test sets SCHEDULER_LIB_RECONNECT_TIMEOUT to for the provider's brokers."""
    broker = Broker(db, reconnect_timeout=120)
    try:
        init(broker, targets=[Target(activation=False)])
        yield broker
    finally:
        broker.close()


@pytest.fixture
def serve(worker_broker: Broker) -> Iterator[Callable[[], None]]:
    """``serve()`` starts two executors on the target queue (threads, as a worker's
    readers), stopped at the end of the test."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start() -> None:
        for _ in range(2):
            executor = Executor(worker_broker, "QueueAsyncTarget", idle_timeout=600)
            thread = threading.Thread(target=executor.serve, args=(stop,), daemon=True)
            thread.start()
            threads.append(thread)

    try:
        yield start
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def rows(broker: Broker, log_ids: list[int]) -> dict[int, str]:
    """log id -> status, read by the executors' broker."""
    found = {}
    for log_id in log_ids:
        for row in broker.fetch("log_get", log_id=log_id):
            found[log_id] = row["status"]
    return found


# --- Airflow's side: a task context, a wave sent as the operators send one --------------


@dataclasses.dataclass
class FakeTaskInstance:
    """What the operators read from ``context["ti"]``: ids and upstream XComs."""

    xcoms: dict[str, Any] = dataclasses.field(default_factory=dict)
    dag_id: str = "outage_dag"
    run_id: str = "manual__1"
    task_id: str = "a_task"

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)


def context(**xcoms: Any) -> Any:
    return {"ti": FakeTaskInstance(xcoms)}


def sleeps(*seconds: float) -> list[dict[str, Any]]:
    return [
        {"kind": "python", "name": f"sleep {i}", "callable": "time:sleep", "args": [s]}
        for i, s in enumerate(seconds, start=1)
    ]


def send_wave(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """GetScheduler then ExecAsync, as two Airflow tasks would: the wave's XCom."""
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    return ExecAsyncOperator(task_id="wave", tasks=tasks).execute(context(get_scheduler=got))


def reader_broker() -> Broker:
    """The one reading broker this process opened: no timers, no migrate (the page's, or
    the triggers')."""
    (broker,) = [
        b for (_, migrate, timers, _), b in hooks._brokers.items() if not timers and not migrate
    ]
    return broker


class Lines:
    """The log lines (Airflow's structlog events) emitted while it is entered, readable
    from any thread."""

    def __enter__(self) -> Lines:
        self._capturing = structlog.testing.capture_logs()
        self.events = self._capturing.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._capturing.__exit__(*exc)

    def having(self, *words: str) -> list[str]:
        lines = [str(e.get("event")) for e in list(self.events)]
        return [line for line in lines if all(w in line for w in words)]


def first_event(trigger: SynchronizationTrigger, timeout: float = WAIT) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


# --- the Execution Status page ------------------------------------------------------------


@pytest.fixture(scope="module")
def api_server(airflow_home: Path) -> Iterator[Any]:
    """Airflow's api-server app with the plugin loaded from ``plugins/``, behind a test
    client (as in test_ui.py)."""
    os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", secrets.token_hex(48))
    from airflow import plugins_manager, settings
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    settings.PLUGINS_FOLDER = str(REPO / "plugins")
    for value in vars(plugins_manager).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    with TestClient(create_app("core")) as client:
        yield client


@pytest.fixture
def admin(api_server: Any) -> dict[str, str]:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    user = SimpleAuthManagerUser(username="tester", role="admin")
    return {"Authorization": f"Bearer {get_auth_manager().generate_jwt(user)}"}


def sent_rows(url: str) -> list[int]:
    """A scheduler of DAG run etl/manual__1 sends three tasks nobody serves; their log
    ids, newest first."""
    broker = Broker(url)
    try:
        init(broker, targets=[Target(activation=False)])
        scheduler = TaskScheduler(
            broker, context={"dag_id": "etl", "run_id": "manual__1", "task_id": "t"}
        )
        handle = scheduler.get_scheduler()
        sent = [scheduler.exec_async(handle, Task.sql("SELECT 1"), wave=1) for _ in range(3)]
    finally:
        broker.close()
    return sorted(sent, reverse=True)


def log_ids(response: Any) -> list[int]:
    assert response.status_code == 200, response.text
    return [r["log_id"] for r in response.json()["log"]]


def assert_short_reason(response: Any, server: PrivatePostgres, url: str) -> str:
    """A 503 whose detail is one line naming the database and why, no secret, no
    traceback."""
    assert response.status_code == 503, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail, detail
    assert database_named(server, url) in detail and "unavailable" in detail, detail
    assert len(detail) < 500, detail
    assert PASSWORD not in response.text and "Traceback" not in response.text
    return str(detail)


def test_the_page_answers_503_while_the_database_is_down_and_200_once_it_is_back(
    api_server: Any, admin: dict[str, str], db: str, server: PrivatePostgres
) -> None:
    sent = sent_rows(db)
    snapshot = f"{PREFIX}/api/snapshot"
    run_snapshot = f"{PREFIX}/api/dags/etl/runs/manual__1/snapshot"
    assert log_ids(api_server.get(snapshot, headers=admin)) == sent
    assert log_ids(api_server.get(run_snapshot, headers=admin)) == sent
    page_broker = reader_broker()  # opened like the triggers': no timers, no migrate

    # Given the database is down
    server.stop()
    try:
        # When the page polls, Then 503 within the page's short deadline (not the
        # broker's 120 s), one line naming the database
        started = time.monotonic()
        response = api_server.get(snapshot, headers=admin)
        took = time.monotonic() - started
        detail = assert_short_reason(response, server, db)
        assert ui.UI_RECONNECT_TIMEOUT <= took < ui.UI_RECONNECT_TIMEOUT + 5, took
        assert response.json()["detail"].endswith("at its next refresh")
        # ... with the last error the driver gave, not a stack
        assert "Connection refused" in detail, detail
        assert_short_reason(api_server.get(run_snapshot, headers=admin), server, db)
        # And the page itself stays up (it needs no database: its script shows the line)
        page = api_server.get(f"{PREFIX}/", headers=admin)
        assert (
            page.status_code == 200
            and "showProblem" in api_server.get(f"{PREFIX}/static/page.js", headers=admin).text
        )

        # When several pages poll at once, Then one request waits for the database and
        # the others answer at once (an outage holds one api-server thread, not one per
        # open page)
        def timed() -> tuple[int, float]:
            began = time.monotonic()
            answer = api_server.get(snapshot, headers=admin)
            assert_short_reason(answer, server, db)
            return answer.status_code, time.monotonic() - began

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: timed(), range(4)))
        assert [code for code, _ in answers] == [503] * 4
        assert sum(took < 1.0 for _, took in answers) >= 3, answers
    finally:
        server.start()

    # When the next request comes after the database is back, Then it answers 200 with
    # the rows: the same app, the same broker (its dead connections were dropped)
    assert log_ids(api_server.get(snapshot, headers=admin)) == sent
    assert log_ids(api_server.get(run_snapshot, headers=admin)) == sent
    assert reader_broker() is page_broker and page_broker.availability.available


def test_a_page_first_opened_during_an_outage_answers_503_then_works(
    api_server: Any,
    admin: dict[str, str],
    db: str,
    server: PrivatePostgres,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker is opened (and the scheduler's schema checked) on a request made
    while the database is down — with ``migrate`` off, as for the guide's SELECT-only
    monitor role — and the schema check rides through like the queries do."""
    sent = sent_rows(db)
    monkeypatch.setenv("AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT", connection(db, migrate=False))
    monkeypatch.setenv("AIRFLOW__SCHEDULER_LIB__UI_RECONNECT_TIMEOUT", "1")
    hooks.close_brokers()  # as in an api-server that never opened it
    server.stop()
    try:
        started = time.monotonic()
        response = api_server.get(f"{PREFIX}/api/snapshot", headers=admin)
        assert time.monotonic() - started < 6
        assert_short_reason(response, server, db)
    finally:
        server.start()
    assert log_ids(api_server.get(f"{PREFIX}/api/snapshot", headers=admin)) == sent


# --- the trigger ---------------------------------------------------------------------------


def test_the_trigger_waits_through_an_outage_and_fires_once_the_wave_is_done(
    db: str,
    server: PrivatePostgres,
    worker_broker: Broker,
    serve: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One look gives up after 1 s: the outage outlasts it, so the trigger's own loop is
    # what rides through.
    monkeypatch.setattr(triggers, "LOOK_RECONNECT_TIMEOUT", 1.0)
    wave = send_wave(sleeps(1.5, 1.5))
    ids = wave["log_ids"]
    trigger = SynchronizationTrigger(wave["scheduler_handle"], ids, poll_interval=0.1)
    serve()
    times: dict[str, float] = {}

    with Lines() as lines:

        def outage() -> None:
            # Given the server stops while the wave's tasks run
            poll(
                lambda: set(rows(worker_broker, ids).values()) == {"RUNNING"}, WAIT, "the tasks run"
            )
            server.stop()
            times["stopped"] = time.monotonic()
            # ... and stays down until the trigger said it waits for it (so past one
            # look's deadline)
            poll(lambda: lines.having("unavailable", "waiting"), WAIT, "the trigger to wait")
            server.start()
            times["back"] = time.monotonic()

        outage_thread = Background(outage)
        outage_thread.start()
        # When the trigger runs through it
        event = first_event(trigger)
        fired = time.monotonic()
        outage_thread.result()

    # Then it fired once the wave was done, after the database was back
    assert event["status"] == triggers.DONE, event
    assert [t["status"] for t in event["tasks"]] == ["SUCCEEDED", "SUCCEEDED"]
    assert fired >= times["back"] > times["stopped"] + 1.0
    (waiting,) = lines.having("unavailable", "waiting")
    assert database_named(server, db) in waiting and PASSWORD not in waiting
    assert lines.having("is back after")
    # And nothing of the wave is left in the queue (the trigger drained its answers)
    assert worker_broker.peek("QueueAsyncInitiator") == []


def test_a_trigger_that_starts_during_an_outage_fires_once_the_database_is_back(
    db: str,
    server: PrivatePostgres,
    worker_broker: Broker,
    serve: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A triggerer (re)started while the database is down: opening the broker and
    checking the scheduler's schema ride through as the looks do."""
    monkeypatch.setattr(triggers, "LOOK_RECONNECT_TIMEOUT", 1.0)
    wave = send_wave(sleeps(0.1))
    serve()
    poll(
        lambda: rows(worker_broker, wave["log_ids"]) == {wave["log_ids"][0]: "SUCCEEDED"},
        WAIT,
        "the task to complete",
    )
    hooks.close_brokers()  # a fresh triggerer process: no broker opened yet
    trigger = SynchronizationTrigger(wave["scheduler_handle"], wave["log_ids"], poll_interval=0.1)
    server.stop()
    with Lines() as lines:
        starter = Background(
            lambda: (
                poll(lambda: lines.having("unavailable"), WAIT, "the trigger to wait"),
                server.start(),
            )
        )
        starter.start()
        event = first_event(trigger)
        starter.result()
    assert event["status"] == triggers.DONE, event
    assert [t["status"] for t in event["tasks"]] == ["SUCCEEDED"]


def test_the_triggers_deadline_holds_during_an_outage(
    db: str, server: PrivatePostgres, worker_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(triggers, "LOOK_RECONNECT_TIMEOUT", 1.0)
    wave = send_wave(sleeps(0))  # nobody serves it
    server.stop()
    try:
        started = time.monotonic()
        trigger = SynchronizationTrigger(
            wave["scheduler_handle"], wave["log_ids"], poll_interval=0.1, deadline=time.time() + 2
        )
        event = first_event(trigger)
        took = time.monotonic() - started
    finally:
        server.start()
    assert event["status"] == triggers.TIMEOUT, event
    assert "deadline passed" in event["message"] and "unavailable" in event["message"]
    assert database_named(server, db) in event["message"]
    assert PASSWORD not in event["message"]
    # (not before the deadline; after it by at most the look that was under way)
    assert 1.9 <= took < 2 + triggers.LOOK_RECONNECT_TIMEOUT + 5, took


# --- the sensor ----------------------------------------------------------------------------


def test_poke_rides_through_says_not_yet_past_the_deadline_and_returns_the_wave_after(
    db: str,
    server: PrivatePostgres,
    worker_broker: Broker,
    serve: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The provider's brokers ride through 4 s here (the executors' through 120 s).
    monkeypatch.setenv("SCHEDULER_LIB_RECONNECT_TIMEOUT", str(DEADLINE))
    wave = send_wave(sleeps(0.5, 0.5))
    sensor = SynchronizationSensor(task_id="sync", exec_task_id="wave")
    ctx = context(wave=wave)
    assert sensor.poke(ctx).is_done is False  # nobody serves the queue yet
    serve()

    # Given an outage shorter than the deadline (the server is started again once the
    # poke has met it), When poked, Then the poke is only slower: it answers, and says
    # nothing of an outage
    server.stop()
    with Lines() as lines:
        poking = Background(lambda: sensor.poke(ctx))
        poking.start()
        poll(lambda: not _hooks_broker().availability.available, WAIT, "the poke to meet it")
        server.start()
        poked = poking.result()
    assert poked.is_done in (False, True) and not lines.having("unavailable")
    assert _hooks_broker().availability.available

    # Given an outage past the deadline, When poked, Then "not yet", with a log line,
    # rather than a failed Airflow task
    poll(lambda: set(rows(worker_broker, wave["log_ids"]).values()) != {"QUEUED"}, WAIT, "a start")
    server.stop()
    try:
        with Lines() as lines:
            started = time.monotonic()
            assert sensor.poke(ctx).is_done is False
            took = time.monotonic() - started
            # ... and a deferrable sensor defers: the trigger waits for the database
            deferrable = SynchronizationSensor(task_id="sync", exec_task_id="wave", deferrable=True)
            with pytest.raises(TaskDeferred) as deferred:
                deferrable.execute(ctx)
    finally:
        server.start()
    assert DEADLINE <= took < DEADLINE + 6, took
    (line, deferring) = lines.having("unavailable")
    assert database_named(server, db) in line and PASSWORD not in line
    assert "poking again later" in line and "deferring" in deferring
    assert isinstance(deferred.value.trigger, SynchronizationTrigger)
    assert deferred.value.trigger.log_ids == wave["log_ids"]

    # Then once the database is back, the wave
    done = poll(lambda: (p := sensor.poke(ctx)).is_done and p, WAIT, "the wave to complete")
    assert [t["status"] for t in done.xcom_value] == ["SUCCEEDED", "SUCCEEDED"]


# --- OrderedWavesOperator -----------------------------------------------------------------


def test_ordered_waves_finish_a_plan_through_a_restart_in_the_middle_of_a_wave(
    db: str, server: PrivatePostgres, worker_broker: Broker, serve: Callable[[], None]
) -> None:
    waves = [sleeps(1.5, 1.5), sleeps(0.1)]
    plan = OrderedWavesOperator(task_id="plan", waves=waves)
    serve()

    def restart() -> None:
        # Given the server stops while the first wave runs, until the plan's broker
        # (the hook's, shared by the process) has noticed it
        poll(
            lambda: any(r["status"] == "RUNNING" for r in _plan_rows(worker_broker)),
            WAIT,
            "the first wave to run",
        )
        server.stop()
        poll(lambda: not _hooks_broker().availability.available, WAIT, "the plan to notice")
        server.start()

    restarter = Background(restart)
    restarter.start()
    # When the plan runs through it (the broker's default 120 s deadline)
    result = plan.execute(context())
    restarter.result()
    # Then every wave completed, each task once
    assert [[t["status"] for t in w] for w in result["waves"]] == [
        ["SUCCEEDED", "SUCCEEDED"],
        ["SUCCEEDED"],
    ]
    assert _hooks_broker().availability.recovered_at > 0
    statuses = [r["status"] for r in _plan_rows(worker_broker)]
    assert statuses == ["SUCCEEDED"] * 3, statuses


def _plan_rows(broker: Broker) -> list[Any]:
    """The rows of the tasks the plan sent (its DAG's), oldest first."""
    rows = monitor.execution_log(broker, monitor.Filters(dag_id="outage_dag"), limit=100)
    return rows[::-1]


def _hooks_broker() -> Broker:
    (broker,) = [b for (_, _, timers, _), b in hooks._brokers.items() if timers]
    return broker


def test_a_plan_that_outlives_the_deadline_fails_in_one_line_naming_its_scheduler(
    db: str, server: PrivatePostgres, worker_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the reconnect deadline a non-deferrable plan fails (retryably: Airflow's
    retries apply) with one line naming the database and the scheduler left behind."""
    monkeypatch.setenv("SCHEDULER_LIB_RECONNECT_TIMEOUT", "1")
    plan = OrderedWavesOperator(task_id="plan", waves=[sleeps(0.1), sleeps(0.1)])
    running = Background(lambda: plan.execute(context()))
    running.start()
    poll(lambda: _plan_rows(worker_broker), WAIT, "the first wave to be sent")  # nobody serves
    server.stop()
    try:
        with pytest.raises(AirflowException) as failed:
            running.result()
    finally:
        server.start()
    assert not isinstance(failed.value, AirflowFailException)  # retries apply
    message = str(failed.value)
    assert "\n" not in message and "unavailable" in message, message
    assert database_named(server, db) in message and PASSWORD not in message
    (row,) = _plan_rows(worker_broker)
    assert f"scheduler {row['scheduler_handle']}" in message


def test_a_deferrable_plan_defers_a_wait_past_the_deadline_and_finishes_on_resume(
    db: str,
    server: PrivatePostgres,
    worker_broker: Broker,
    serve: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHEDULER_LIB_RECONNECT_TIMEOUT", "1")
    plan = OrderedWavesOperator(
        task_id="plan",
        waves=[sleeps(0.1), sleeps(0.1)],
        deferrable=True,
        defer_after=120,
        trigger_poll_interval=0.1,
    )
    ctx = context()
    # Given the first wave is sent and waited for in place (nobody serves it yet)
    running = Background(lambda: plan.execute(ctx))
    running.start()
    poll(lambda: _plan_rows(worker_broker), WAIT, "the first wave to be sent")
    # When the database goes away past the reconnect deadline
    server.stop()
    try:
        # Then the operator defers (rather than failing): the trigger waits
        with pytest.raises(TaskDeferred) as deferred:
            running.result()
    finally:
        server.start()
    trigger = deferred.value.trigger
    assert isinstance(trigger, SynchronizationTrigger)
    assert deferred.value.method_name == "resume_wave"
    # And once the database is back and the wave is served, the plan goes on
    serve()
    event = first_event(trigger)
    assert event["status"] == triggers.DONE, event
    result = plan.resume_wave(ctx, event)
    assert [[t["status"] for t in w] for w in result["waves"]] == [["SUCCEEDED"], ["SUCCEEDED"]]
