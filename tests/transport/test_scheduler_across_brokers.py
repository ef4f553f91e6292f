"""The blog's test (seed 002) with the initiator on one broker and the target, with its
executors, on another: the Airflow side's database and the Spark side's, linked by the
transport. Both orders of backends (SQLite initiator / PostgreSQL target and back)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from transport_catalog import KEY

from scheduler_lib.broker import Broker
from scheduler_lib.broker.transport import TransportEndpoint
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

SHAPE = [(4, 10.1), (2, 9.2), (1, 8.3), (2, 7.4), (1, 6.5)]  # the blog's waves
UNIT = 0.05  # seconds per "second" of the blog's test


def sleep(seconds: float) -> Task:
    return Task.python("time:sleep", seconds, name=f"sleep {seconds}")


@contextlib.contextmanager
def executors(broker: Broker, count: int) -> Iterator[None]:
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=Executor(broker, "QueueAsyncTarget", idle_timeout=3600).serve,
            args=(stop,),
            name=f"reader-{i}",
            daemon=True,
        )
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def rows(broker: Broker, handle: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in broker.fetch("log_of_scheduler", handle=str(handle))]


def test_the_blogs_waves_with_initiator_and_target_on_two_brokers(
    pair_urls: tuple[str, str],
) -> None:
    options = {"key": KEY, "listen": "127.0.0.1:0", "retry_initial": 0.3, "retry_max": 2.0}
    with (
        Broker(pair_urls[0]) as airflow_side,
        Broker(pair_urls[1]) as spark_side,
        TransportEndpoint(airflow_side, **options) as ea,
        TransportEndpoint(spark_side, **options) as eb,
    ):
        # Given the target service (and its executors) on one broker only, routed to
        init(airflow_side, targets=[Target(address=eb.address)])
        init(spark_side, targets=[Target(activation=False)], initiator_address=ea.address)
        waves = [[sleep(units * UNIT)] * count for count, units in SHAPE]
        ids = {"dag_id": "blog", "run_id": "manual__1", "task_id": "waves"}
        with executors(spark_side, 4):
            # When the Airflow side (a task instance of a DAG) runs the blog's waves
            report = TaskScheduler(airflow_side, context={**ids, "try_number": 1}).run_waves(waves)
        # Then every task succeeded, wave after wave, the tasks of a wave together
        assert report.ok and len(report.completions) == 10
        log = rows(airflow_side, report.scheduler_handle)
        assert [r["status"] for r in log] == ["SUCCEEDED"] * 10
        by_wave = [[r for r in log if r["wave"] == w] for w in range(1, len(SHAPE) + 1)]
        assert [len(w) for w in by_wave] == [count for count, _ in SHAPE]
        for earlier, later in itertools.pairwise(by_wave):
            assert min(r["start_time"] for r in later) >= max(r["end_time"] for r in earlier)
        for wave in by_wave:
            assert max(r["start_time"] for r in wave) < min(r["end_time"] for r in wave)
            assert len({r["worker_id"] for r in wave}) == len(wave)
        # ... and the Spark side kept its own record of each run, keyed to the initiator's
        [far] = {
            r["scheduler_handle"]
            for r in spark_side.fetch("log_recent", limit=100)
            if r["origin_log_id"] is not None
        }
        copies = rows(spark_side, far)
        assert sorted(r["origin_log_id"] for r in copies) == sorted(r["log_id"] for r in log)
        assert {r["status"] for r in copies} == {"SUCCEEDED"}
        # (naming the Airflow task instance that sent them, as the initiator's rows do)
        assert {(r["dag_id"], r["run_id"], r["task_id"]) for r in log + copies} == {
            tuple(ids.values())
        }
        # ... and a failing task's error travels back as its result
        failing = TaskScheduler(airflow_side)
        with executors(spark_side, 1), failing.scheduler() as handle:
            log_id = failing.exec_async(handle, Task.python("builtins:int", "not a number"))
            done = failing.synchronization(handle, timeout=30)
        assert done.log_id == log_id and done.status == "FAILED"
        assert done.error is not None and "ValueError" in done.error
        [row] = rows(airflow_side, handle.conversation_handle)
        assert row["status"] == "FAILED" and "invalid literal" in row["error"]
