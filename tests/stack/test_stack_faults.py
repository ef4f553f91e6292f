"""The faults an operator meets on ``make stack`` (issue 23, scenarios 2 to 4).

On the running stack (tests/stack/conftest.py), with the DAGs of
``tests/stack/dags/stack_faults.py`` triggered through Airflow's REST API:

2. SIGKILL one scheduler-lib worker's driver while a wave runs on both: its tasks are
   answered FAILED "worker stopped" once their lease runs out, the wave's Airflow retry
   sends them again, the run succeeds, and no task body ran twice except the ones the
   retry asked for (their marks counted); ``again`` starts the worker again.
3. SIGKILL the Spark standalone worker whose executor runs a ``spark_sql`` task: Spark
   runs the lost stage's tasks again on a new executor, the task SUCCEEDS once (no
   retry, no second row) and the next wave runs.
4. Restart Airflow's triggerer, then its scheduler, while a wave's wait is deferred: the
   run succeeds and each task body ran once.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from typing import Any

import psutil
import pytest

from tests.stack.harness import Stack, stack_processes
from tests.stack.marks import count

PYTHON_DAG, SPARK_DAG = "stack_fault_python", "stack_fault_spark"
LEASE = 30.0  # scheduler_lib.scheduler.executor.LEASE
RUN_DEADLINE = 420.0  # seconds for a fault scenario's run (about 90)
START_DEADLINE = 180.0  # seconds for a wave's tasks to be RUNNING
ONCE = {"long1": 1, "long2": 1, "long3": 1, "long4": 1, "after": 1}  # marks: each body once

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def finish(stack: Stack, dag_id: str, run_id: str) -> dict[str, Any]:
    """The run once it ended, asserted ``success`` (its task instances in the message)."""
    run = stack.api.wait_run(dag_id, run_id, RUN_DEADLINE, check=stack.check_alive)
    assert run["state"] == "success", (run, stack.api.task_instances(dag_id, run_id), stack.tail())
    return run


def supervised(stack: Stack, *words: str) -> list[psutil.Process]:
    """The processes ``stack/bin/again`` runs for the Procfile line(s) whose command holds
    each of ``words`` (the loop's children: what a container's restart would stop)."""
    found = []
    for loop in stack_processes(stack.env["STACK_DIR"]):
        try:
            command = loop.cmdline()
            if len(command) > 1 and command[1].endswith("/again") and set(words) <= set(command):
                found += loop.children()
        except psutil.Error:
            continue
    return found


def one_supervised(stack: Stack, *words: str) -> psutil.Process | None:
    """The one process ``again`` runs for ``words``; None while it is being started again."""
    found = supervised(stack, *words)
    assert len(found) <= 1, [p.cmdline() for p in found]
    return found[0] if found else None


def task_instance(stack: Stack, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    (ti,) = [t for t in stack.api.task_instances(dag_id, run_id) if t["task_id"] == task_id]
    return ti


def test_a_killed_worker_drivers_tasks_are_failed_within_the_lease_and_retried(
    stack: Stack,
) -> None:
    # Given a wave of four 20-second tasks running, two on each worker application
    serving = stack.serving()
    run_id = stack.trigger(PYTHON_DAG, {"marks": str(stack.marks), "seconds": 20})
    rows = stack.wait(stack.running(run_id, 1, 4), START_DEADLINE, "wave 1's 4 tasks running")
    # (python tasks run in the driver: worker_id is its host:pid:reader)
    drivers = {r["task_name"]: int(r["worker_id"].split(":")[1]) for r in rows}
    assert len(set(drivers.values())) == 2, rows

    # When one worker's driver (the Python process whose readers hold the leases) is
    # killed without a word
    victim = drivers["long1"]
    lost = {name for name, pid in drivers.items() if pid == victim}
    assert len(lost) == 2, rows
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    # Then the run succeeds: the wave's Airflow task retried ...
    finish(stack, PYTHON_DAG, run_id)
    assert task_instance(stack, PYTHON_DAG, run_id, "waves.wave_1")["try_number"] == 2

    # ... its two lost tasks were answered FAILED within the lease, and ran again (on
    # whichever worker serves), the other two succeeded once
    rows = stack.log_rows(run_id)
    failed = [r for r in rows if r["status"] == "FAILED"]
    assert {r["task_name"] for r in failed} == lost, rows
    for row in failed:
        assert "stopped without an answer" in row["error"], row
        assert row["end_time"] - killed_at < LEASE + 30.0, (row, killed_at)
    wave = [r for r in rows if r["wave"] == 1 and r["status"] == "SUCCEEDED"]
    assert sorted(r["task_name"] for r in wave) == ["long1", "long2", "long3", "long4"], rows

    # ... and each body ran once, except the two the retry asked to run again
    expected = dict(ONCE)
    expected.update({name: 2 for name in lost})
    assert count(stack.marks, run_id) == expected

    # And the killed worker is back (stack/bin/again) and serves
    stack.wait_ready(serving=serving + 1)


def test_a_killed_spark_worker_loses_an_executor_and_spark_runs_the_stage_again(
    stack: Stack,
) -> None:
    # Given a slow spark_sql task running on one application (its executor sleeps per row)
    run_id = stack.trigger(SPARK_DAG, {"rows": 120, "partitions": 6, "ms": 250})
    (row,) = stack.wait(stack.running(run_id, 1, 1), START_DEADLINE, "the slow task running")
    application = row["spark_application_id"]

    # ... on the Spark worker whose executor the application holds
    def host_worker() -> tuple[dict[str, Any], dict[str, Any]] | None:
        for worker in stack.spark_master()["workers"]:
            if worker.get("state") != "ALIVE":
                continue
            page = Stack.spark_json(worker["webuiaddress"].rsplit(":", 1)[1])
            for executor in page.get("executors", []):
                if executor.get("appid") == application:
                    return worker, page
        return None

    worker, _ = stack.wait(host_worker, 60.0, f"the Spark worker running {application}")
    port = worker["webuiaddress"].rsplit(":", 1)[1]
    jvm = one_supervised(stack, "org.apache.spark.deploy.worker.Worker", port)
    assert jvm is not None and "java" in jvm.name(), jvm
    stack.wait(lambda: spark_stage_running(stack, row), 120.0, "the slow stage running")

    # When that Spark worker is killed (its executor goes with it)
    jvm.kill()

    # Then the task succeeds, once, without a retry, and the next wave runs
    finish(stack, SPARK_DAG, run_id)
    rows = stack.log_rows(run_id)
    assert [(r["wave"], r["status"]) for r in rows] == [(1, "SUCCEEDED"), (2, "SUCCEEDED")], rows
    assert rows[0]["result"] is not None and "120" in rows[0]["result"], rows[0]
    assert task_instance(stack, SPARK_DAG, run_id, "waves.wave_1")["try_number"] == 1

    # ... because Spark lost an executor and ran the stage's tasks again elsewhere
    executors = driver_api(stack, row, "allexecutors")
    removed = [e for e in executors if e["id"] != "driver" and not e["isActive"]]
    assert removed, executors
    # And the Spark worker is back (stack/bin/again), the cluster whole again
    stack.wait_ready(serving=stack.serving())


def driver_api(stack: Stack, row: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """The driver's REST API (its Spark UI) for the application that ran ``row``."""
    url = f"{row['spark_ui_url'].rstrip('/')}/api/v1/applications/{row['spark_application_id']}"
    with urllib.request.urlopen(f"{url}/{what}", timeout=10) as answer:
        got: list[dict[str, Any]] = json.load(answer)
        return got


def spark_stage_running(stack: Stack, row: dict[str, Any]) -> bool:
    """Whether the application runs a stage with a task started (the executor is busy)."""
    try:
        stages = driver_api(stack, row, "stages?status=active")
    except OSError:
        return False
    return any(s.get("numActiveTasks", 0) > 0 for s in stages)


def test_restarting_the_triggerer_and_the_scheduler_while_a_wave_is_deferred(
    stack: Stack,
) -> None:
    # Given a wave of four 30-second tasks whose wait is deferred to the triggerer
    run_id = stack.trigger(PYTHON_DAG, {"marks": str(stack.marks), "seconds": 30})
    stack.wait(stack.running(run_id, 1, 4), START_DEADLINE, "wave 1's 4 tasks running")
    stack.wait(
        lambda: task_instance(stack, PYTHON_DAG, run_id, "waves.wave_1")["state"] == "deferred",
        120.0,
        "wave 1's wait deferred",
    )

    # When the triggerer, then the scheduler, are stopped and started again (as a
    # container restart does: SIGTERM, and stack/bin/again starts it a second later)
    for component in ("triggerer", "scheduler"):
        old = one_supervised(stack, "airflow", component, "--skip-serve-logs")
        assert old is not None, component
        old.terminate()
        psutil.wait_procs([old], timeout=60)

        def started_again(c: str = component, pid: int = old.pid) -> bool:
            new = one_supervised(stack, "airflow", c, "--skip-serve-logs")
            return new is not None and new.pid != pid

        stack.wait(started_again, 60.0, f"a new {component}")

    # Then the run succeeds, and each task body ran once
    finish(stack, PYTHON_DAG, run_id)
    assert count(stack.marks, run_id) == {
        "long1": 1,
        "long2": 1,
        "long3": 1,
        "long4": 1,
        "after": 1,
    }
    assert {r["status"] for r in stack.log_rows(run_id)} == {"SUCCEEDED"}
    stack.wait(stack.api.healthy, 120.0, "Airflow's components healthy again")
