"""The provider's parts one by one: registration, the hook and its connection, the
trigger (serialize round trip, each event it yields, an event loop it never blocks),
the sensor's ``poke``, and the operators' checks, templating, release and ``on_kill``.

Each test talks to a real broker database (SQLite, and PostgreSQL where the backend
matters); only Airflow's task context is a stand-in (a plain object with what the
operators read from it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import threading
import time
from collections.abc import Iterator
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from airflow.providers.common.compat.sdk import AirflowFailException
from airflow.sdk import DAG, Connection

from scheduler_lib.airflow import (
    ExecAsyncOperator,
    GetSchedulerOperator,
    OrderedWavesOperator,
    ReleaseSchedulerOperator,
    SchedulerLibHook,
    SynchronizationSensor,
    SynchronizationTrigger,
    hooks,
    ordered_waves,
    provider,
    sensors,
    triggers,
)
from scheduler_lib.broker import Broker, activation
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import InvalidTask, TaskScheduler, UnknownKind, init

AIRFLOW_VERSION = tuple(int(part) for part in metadata.version("apache-airflow").split(".")[:2])


@dataclasses.dataclass
class FakeTaskInstance:
    """What the operators read from ``context["ti"]``: ids and upstream XComs."""

    xcoms: dict[str, Any] = dataclasses.field(default_factory=dict)
    dag_id: str = "a_dag"
    run_id: str = "manual__1"
    task_id: str = "a_task"

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)


def context(**xcoms: Any) -> Any:
    return {"ti": FakeTaskInstance(xcoms)}


@pytest.fixture
def broker(scheduler_lib_conn: str) -> Iterator[Broker]:
    with Broker(scheduler_lib_conn) as b:
        init(b)
        yield b


def released(broker: Broker, handle: str) -> bool:
    return all(str(e.conversation_handle) != handle for e in broker.conversation_endpoints())


def sleeps(*seconds: float) -> list[dict[str, Any]]:
    return [{"kind": "python", "callable": "time:sleep", "args": [s]} for s in seconds]


def send_wave(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """GetScheduler then ExecAsync, as two Airflow tasks would: the wave's XCom."""
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    return ExecAsyncOperator(task_id="wave", tasks=tasks).execute(context(get_scheduler=got))


def collect_event(trigger: SynchronizationTrigger, timeout: float = 30) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


# --- registration ------------------------------------------------------------------------


def test_provider_info_is_valid_and_airflow_finds_the_hook(airflow_home: Path) -> None:
    # Given Airflow's own schema for provider info
    schema = json.loads(
        resources.files("airflow").joinpath("provider_info.schema.json").read_text()
    )
    info = provider.get_provider_info()
    # Then ours validates, and the providers manager registers the connection type
    jsonschema.validate(info, schema)
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()  # what the api-server's connection form reads
    assert info["package-name"] in manager.providers
    if AIRFLOW_VERSION >= (3, 2):  # Airflow 3.1 reads form fields from hooks, through FAB
        relabeling = manager.field_behaviours["scheduler_lib"]["relabeling"]
        assert relabeling == {"host": "SQLAlchemy URL"}
        assert "extra__scheduler_lib__target_service" in manager.connection_form_widgets
    try:  # what tasks resolve: the task SDK's own manager since Airflow 3.2
        from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

        hook = ProvidersManagerTaskRuntime().hooks["scheduler_lib"]
    except ImportError:  # Airflow 3.1: tasks use the same manager
        hook = manager.hooks["scheduler_lib"]
    assert hook is not None and hook.hook_class_name.endswith("SchedulerLibHook")


# --- the hook and its connection --------------------------------------------------------


def test_the_connection_password_goes_into_the_url_and_bad_hosts_are_named() -> None:
    conn = Connection(conn_id="c", conn_type="scheduler_lib", host="postgresql://me@db/b")
    conn.password = "s3cret"
    assert hooks.broker_url(conn) == "postgresql://me:s3cret@db/b"
    with_own = Connection(conn_id="c", conn_type="scheduler_lib", host="postgresql://me:x@db/b")
    with_own.password = "other"
    assert hooks.broker_url(with_own) == "postgresql://me:x@db/b"  # the URL's own wins
    for host in ("", "not a url", "postgresql://me:s3cret@db:notaport/b"):
        bad = Connection(conn_id="broken_conn", conn_type="scheduler_lib", host=host)
        with pytest.raises(InvalidArgument, match="connection 'broken_conn'") as raised:
            hooks.broker_url(bad)
        assert "s3cret" not in str(raised.value)


def test_connection_extras_are_checked() -> None:
    def options(extra: dict[str, Any]) -> dict[str, Any]:
        conn = Connection(
            conn_id="c", conn_type="scheduler_lib", host="sqlite://", extra=json.dumps(extra)
        )
        return hooks.connection_options(conn)

    assert options({}) == {"target_service": "ServiceAsyncTarget", "migrate": True}
    # The connection form's prefixed names, and its nulls, mean the same.
    assert options({"extra__scheduler_lib__target_service": "T", "migrate": None}) == {
        "target_service": "T",
        "migrate": True,
    }
    assert options({"migrate": "false"})["migrate"] is False
    with pytest.raises(InvalidArgument, match=r"unknown extra field\(s\) \['targt'\]"):
        options({"targt": "T"})


def test_test_connection_says_what_is_wrong(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ok, message = SchedulerLibHook().test_connection()
    assert ok, message
    monkeypatch.setenv(
        "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT",
        json.dumps({"conn_type": "scheduler_lib", "host": "sqlite://", "extra": {"x": 1}}),
    )
    ok, message = SchedulerLibHook().test_connection()
    assert not ok and "unknown extra field" in message


def test_a_connection_that_does_not_migrate_checks_the_schema_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sqlalchemy as sa

    from scheduler_lib.broker.exceptions import SchemaNotCurrent

    # Given a database with the broker's schema but not the scheduler's, and a connection
    # to it with "migrate": false (a role that may not change the schema)
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    Broker(url).close()
    monkeypatch.setenv(
        "AIRFLOW_CONN_NO_MIGRATE",
        json.dumps({"conn_type": "scheduler_lib", "host": url, "extra": {"migrate": False}}),
    )
    engine = sa.create_engine(url)
    tables = set(sa.inspect(engine).get_table_names())

    # When a task opens the scheduler through it
    with pytest.raises(SchemaNotCurrent) as raised:
        SchedulerLibHook("no_migrate").get_scheduler()

    # Then it is told what is missing and who may create it, and nothing was created
    assert "the scheduler's schema is missing" in str(raised.value)
    assert "scheduler-lib init" in str(raised.value)
    assert set(sa.inspect(engine).get_table_names()) == tables
    engine.dispose()


# --- the trigger --------------------------------------------------------------------------


def test_the_trigger_serializes_to_what_builds_it_again() -> None:
    trigger = SynchronizationTrigger(
        "6f1c1f6e-0000-4000-8000-000000000001",
        [3, 4],
        scheduler_lib_conn_id="other",
        poll_interval=0.25,
        deadline=1e9,
        carry={"index": 1},
    )
    path, kwargs = trigger.serialize()
    module, _, name = path.rpartition(".")  # how the triggerer finds the class again
    again = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (path, kwargs)
    assert path == "scheduler_lib.airflow.triggers.SynchronizationTrigger"


def test_the_trigger_fires_with_every_task_once_the_wave_is_done(broker: Broker) -> None:
    # Given a wave of two tasks, one failing, served by executors
    wave = send_wave(
        [*sleeps(0.3), {"kind": "python", "name": "bad", "callable": "math:sqrt", "args": [-1]}]
    )
    trigger = SynchronizationTrigger(
        wave["scheduler_handle"], wave["log_ids"], poll_interval=0.05, carry={"k": 1}
    )
    with activation.running(broker):
        event = collect_event(trigger)
    # Then its event lists both outcomes (judging them is the operator's job)
    assert event["status"] == triggers.DONE and event["carry"] == {"k": 1}
    by_id = {t["log_id"]: t for t in event["tasks"]}
    assert [by_id[i]["status"] for i in wave["log_ids"]] == ["SUCCEEDED", "FAILED"]
    assert "math domain error" in by_id[wave["log_ids"][1]]["error"]
    # ... and the AsyncDone messages it read the log for are gone from the queue
    assert broker.peek("QueueAsyncInitiator") == []


def test_the_trigger_says_when_the_scheduler_ended_or_time_ran_out(broker: Broker) -> None:
    # Given a wave nobody serves
    wave = send_wave(sleeps(0))
    # When the deadline has passed, Then: timeout
    late = SynchronizationTrigger(
        wave["scheduler_handle"], wave["log_ids"], poll_interval=0.05, deadline=time.time()
    )
    assert collect_event(late)["status"] == triggers.TIMEOUT
    # When the scheduler is released meanwhile, Then: ended (no waiting for ever)
    ReleaseSchedulerOperator(task_id="r", scheduler_handle=wave["scheduler_handle"]).execute(
        context()
    )
    gone = collect_event(
        SynchronizationTrigger(wave["scheduler_handle"], wave["log_ids"], poll_interval=0.05)
    )
    # the release cancelled the queued task first: its row ended, so the wave is done
    assert gone["status"] == triggers.DONE
    assert gone["tasks"][0]["status"] == "CANCELLED"
    # When the conversation ends under a wave still queued (no cancel first), Then: ended
    orphan = send_wave(sleeps(0))
    broker.end_conversation(orphan["scheduler_handle"])
    ended = collect_event(
        SynchronizationTrigger(orphan["scheduler_handle"], orphan["log_ids"], poll_interval=0.05)
    )
    assert ended["status"] == triggers.ENDED
    assert "1 task(s) will not complete" in ended["message"]


def test_the_trigger_reports_a_broken_connection_as_an_event(
    airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT",
        json.dumps({"conn_type": "scheduler_lib", "host": "no url here"}),
    )
    event = collect_event(SynchronizationTrigger("6f1c1f6e-0000-4000-8000-000000000001", [1]))
    assert event["status"] == triggers.ERROR and "not a SQLAlchemy URL" in event["message"]


def test_the_trigger_never_blocks_the_event_loop(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a database that takes 0.3 s to answer each look at the wave
    real = TaskScheduler.wave_progress

    def slow(self: TaskScheduler, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TaskScheduler, "wave_progress", slow)
    wave = send_wave(sleeps(0.5))
    trigger = SynchronizationTrigger(wave["scheduler_handle"], wave["log_ids"], poll_interval=0.05)

    # When the trigger waits beside a coroutine that ticks every 10 ms
    async def main() -> tuple[dict[str, Any], float]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticking = asyncio.create_task(ticker())
        try:
            async for event in trigger.run():
                return dict(event.payload), max(gaps)
        finally:
            stop.set()
            await ticking
        raise AssertionError("no event")

    with activation.running(broker):
        event, worst_gap = asyncio.run(asyncio.wait_for(main(), 30))
    # Then the loop kept ticking while each 0.3 s look ran in a thread
    assert event["status"] == triggers.DONE
    assert worst_gap < 0.2, f"the event loop stalled for {worst_gap:.3f} s"


# --- the sensor ---------------------------------------------------------------------------


def test_poke_waits_for_the_wave_then_returns_it(broker: Broker) -> None:
    wave = send_wave(sleeps(0.2, 0.2))
    sensor = SynchronizationSensor(task_id="sync", exec_task_id="wave")
    ctx = context(wave=wave)
    assert sensor.poke(ctx).is_done is False  # nobody serves the queue yet
    with activation.running(broker):
        deadline = time.monotonic() + 30
        while not (done := sensor.poke(ctx)).is_done:
            assert time.monotonic() < deadline, "the wave did not complete"
            time.sleep(0.05)
    assert [t["status"] for t in done.xcom_value] == ["SUCCEEDED", "SUCCEEDED"]
    assert [t["log_id"] for t in done.xcom_value] == wave["log_ids"]


def test_a_failed_task_fails_poke_with_its_error(broker: Broker) -> None:
    wave = send_wave([{"kind": "python", "name": "root", "callable": "math:sqrt", "args": [-1]}])
    sensor = SynchronizationSensor(task_id="sync", exec_task_id="wave")
    with activation.running(broker):
        deadline = time.monotonic() + 30
        with pytest.raises(AirflowFailException, match=r"root \(log id \d+\): FAILED: ValueError"):
            while not sensor.poke(context(wave=wave)).is_done:
                assert time.monotonic() < deadline, "the task did not complete"
                time.sleep(0.05)


def test_the_sensor_names_a_missing_wave(broker: Broker) -> None:
    with pytest.raises(ValueError, match="give exec_task_id"):
        SynchronizationSensor(task_id="sync")
    sensor = SynchronizationSensor(task_id="sync", exec_task_id="wave_3")
    with pytest.raises(AirflowFailException, match="task 'wave_3' pushed no wave"):
        sensor.poke(context())


# --- the operators ------------------------------------------------------------------------


def test_malformed_tasks_are_refused_when_the_dag_is_parsed() -> None:
    with pytest.raises(InvalidTask, match="wave_1: tasks must be a list"):
        ExecAsyncOperator(task_id="wave_1", tasks={"kind": "sql"})
    with pytest.raises(InvalidTask, match="wave_1, task 2: a task is an object with a 'kind'"):
        ExecAsyncOperator(task_id="wave_1", tasks=[{"kind": "sql", "sql": "x"}, {"sql": "y"}])
    with pytest.raises(ValueError, match="wave is numbered from 1"):
        ExecAsyncOperator(task_id="w", tasks=[], wave=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        OrderedWavesOperator(task_id="p", waves=[], policy="sometimes")
    with pytest.raises(ValueError, match="max_in_flight needs a task that stays running"):
        OrderedWavesOperator(task_id="p", waves=[], deferrable=True, max_in_flight=2)


def test_tasks_are_templated_and_carry_the_airflow_ids(broker: Broker) -> None:
    op = ExecAsyncOperator(
        task_id="load",
        wave=2,
        tasks=[{"kind": "sql", "name": "day {{ ds }}", "sql": ["SELECT '{{ ds }}'"]}],
    )
    op.render_template_fields({"ds": "2026-03-01"})  # type: ignore[arg-type]
    assert op.tasks == [{"kind": "sql", "name": "day 2026-03-01", "sql": ["SELECT '2026-03-01'"]}]
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    sent = op.execute(context(get_scheduler=got))
    [row] = TaskScheduler(broker).log(sent["scheduler_handle"])
    assert (row["task_name"], row["wave"]) == ("day 2026-03-01", 2)  # as given, from 1
    assert (row["dag_id"], row["run_id"], row["task_id"]) == ("a_dag", "manual__1", "a_task")


def test_a_wave_with_an_unknown_kind_sends_nothing(broker: Broker) -> None:
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    op = ExecAsyncOperator(task_id="w", tasks=[*sleeps(0), {"kind": "cobol", "src": "x"}])
    # ... and fails for good (a retry cannot fix a task's shape)
    with pytest.raises(AirflowFailException, match="unknown task kind 'cobol'") as failed:
        op.execute(context(get_scheduler=got))
    assert isinstance(failed.value.__cause__, UnknownKind)
    assert TaskScheduler(broker).log(got["scheduler_handle"]) == []


def test_release_twice_is_quiet_and_exec_on_a_released_scheduler_fails_clearly(
    broker: Broker,
) -> None:
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    release = ReleaseSchedulerOperator(task_id="release")
    release.execute(context(get_scheduler=got))
    release.execute(context(get_scheduler=got))  # already gone: not an error
    with pytest.raises(AirflowFailException, match="no such conversation"):
        ExecAsyncOperator(task_id="w", tasks=sleeps(0)).execute(context(get_scheduler=got))


def test_on_kill_cancels_what_the_plan_started(broker: Broker) -> None:
    # Given a plan whose first wave runs for long, executing in another thread
    op = OrderedWavesOperator(task_id="plan", waves=[sleeps(*[0.5] * 8), sleeps(0)])
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            op.execute(context())
            outcome["error"] = None
        except BaseException as exc:
            outcome["error"] = exc

    with activation.running(broker):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not any(r["status"] == "RUNNING" for r in broker.fetch("log_recent", limit=20)):
            assert time.monotonic() < deadline, "the plan did not start"
            time.sleep(0.05)
        # When Airflow kills the task
        op.on_kill()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the plan kept waiting after on_kill"
        rows = broker.fetch("log_recent", limit=20)
        # ... and once the target has ended its side, the conversation is gone
        deadline = time.monotonic() + 30
        while not released(broker, rows[0]["scheduler_handle"]):
            assert time.monotonic() < deadline, "the scheduler's conversation was not ended"
            time.sleep(0.1)
    # Then the tasks not yet started were cancelled, the second wave was never sent,
    # and the operator did not report success
    assert len(rows) == 8
    assert sum(r["status"] == "CANCELLED" for r in rows) >= 4
    assert isinstance(outcome["error"], AirflowFailException)


def test_ordered_waves_draws_the_blog_loop() -> None:
    # One Airflow task per wave by default ...
    with DAG("shape", schedule=None) as dag:
        ordered_waves([sleeps(0, 0), sleeps(0)], group_id="etl", wave_names=["load", "sum"])
    assert set(dag.task_dict) == {
        "etl.get_scheduler",
        "etl.load",
        "etl.sum",
        "etl.release_scheduler",
    }
    assert dag.task_dict["etl.load"].upstream_task_ids == {"etl.get_scheduler"}
    assert dag.task_dict["etl.sum"].upstream_task_ids == {"etl.load"}
    assert dag.task_dict["etl.sum"].wait and dag.task_dict["etl.sum"].wave == 2
    assert dag.task_dict["etl.sum"].scheduler_task_id == "etl.get_scheduler"
    release = dag.task_dict["etl.release_scheduler"]
    assert release.is_teardown
    assert release.upstream_task_ids == {"etl.sum", "etl.get_scheduler"}
    # ... or the blog's send and wait apart
    with DAG("apart", schedule=None) as dag:
        ordered_waves(
            [sleeps(0, 0), sleeps(0)],
            group_id="etl",
            wave_names=["load", "sum"],
            separate_sensors=True,
            deferrable=True,
        )
    assert dag.task_dict["etl.sum"].upstream_task_ids == {"etl.load_sync"}
    assert dag.task_dict["etl.sum_sync"].exec_task_id == "etl.sum"
    assert dag.task_dict["etl.sum_sync"].deferrable and not dag.task_dict["etl.sum"].wait
    assert dag.task_dict["etl.release_scheduler"].upstream_task_ids == {
        "etl.sum_sync",
        "etl.get_scheduler",
    }
    with (
        pytest.raises(ValueError, match="wave_names must name each of the 2 waves once"),
        DAG("bad", schedule=None),
    ):
        ordered_waves([sleeps(0), sleeps(0)], wave_names=["a", "a"])
    with (
        pytest.raises(ValueError, match="sensor_kwargs needs separate_sensors=True"),
        DAG("bad2", schedule=None),
    ):
        ordered_waves([sleeps(0)], sensor_kwargs={"mode": "reschedule"})


def test_a_wave_that_waits_fails_with_its_tasks_errors(broker: Broker) -> None:
    got = GetSchedulerOperator(task_id="get_scheduler").execute(context())
    wave = ExecAsyncOperator(
        task_id="wave_1",
        wait=True,
        tasks=[
            *sleeps(0.1),
            {"kind": "python", "name": "root", "callable": "math:sqrt", "args": [-1]},
        ],
    )
    with (
        activation.running(broker),
        # retryable: a retry sends the failed task again
        pytest.raises(sensors.WaveTasksFailed, match=r"wave_1: 1 of 2 task\(s\) did not succeed"),
    ):
        wave.execute(context(get_scheduler=got))
    with pytest.raises(ValueError, match="deferrable=True waits, so it needs wait=True"):
        ExecAsyncOperator(task_id="w", tasks=[], deferrable=True)
