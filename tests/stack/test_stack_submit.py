"""``spark_submit`` and ``pyspark`` tasks on ``make stack`` (issue 23, scenario 5).

On the running stack (tests/stack/conftest.py), with the DAGs of
``tests/stack/dags/stack_submit.py`` triggered through Airflow's REST API:

5. A ``spark_submit`` task submits a real application (``tests/stack/apps/
   sleepy_count.py``) to the stack's Spark cluster through the Spark provider's hook and
   the stack's ``spark_default`` connection (``spark://127.0.0.1:<master port>``), is
   tracked until the application ends, and a cancel (``fail_fast``) kills it; ``pyspark``
   callable tasks run, and a cancel stops their Spark job.

The stack's Spark workers offer two cores each, and its two worker applications take one
on each: the submitted application runs on a spare one.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stack.harness import Stack

SUBMIT_DAG, CANCEL_DAG = "stack_submit", "stack_submit_cancel"
APPS = Path(__file__).resolve().parent / "apps"
RUN_DEADLINE = 420.0  # seconds for a run (about 60)
START_DEADLINE = 180.0  # seconds for a wave's tasks to be RUNNING
SUBMITTED_DEADLINE = 240.0  # seconds for spark-submit's application to run (about 30-60)
STOP_DEADLINE = 60.0  # seconds for a cancel to end the application and the Spark job

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(stack: Stack) -> Iterator[Stack]:
    """The stack, whose Spark workers have a core each to spare beside the two worker
    applications; an application a failed scenario left running is killed at the end,
    as an operator would (the master UI's kill)."""
    own = {a["id"] for a in stack.spark_master()["activeapps"]}  # the worker applications
    try:
        yield stack
    finally:
        with contextlib.suppress(OSError):
            for app in stack.spark_master()["activeapps"]:
                if app["id"] not in own:
                    kill_application(stack, app["id"])
    stack.wait_ready(serving=stack.serving())


def kill_application(stack: Stack, app_id: str) -> None:
    """The master web UI's "kill" of an application."""
    data = urllib.parse.urlencode({"id": app_id, "terminate": "true"}).encode()
    url = f"http://127.0.0.1:{stack.env['SPARK_MASTER_UI_PORT']}/app/kill/"
    with urllib.request.urlopen(url, data=data, timeout=30):
        pass


def ended(stack: Stack, dag_id: str, run_id: str) -> dict[str, Any]:
    run: dict[str, Any] = stack.api.wait_run(dag_id, run_id, RUN_DEADLINE, check=stack.check_alive)
    return run


def application_name(row: dict[str, Any]) -> str:
    """The name a ``spark_submit`` task gives its application (spark-submit ``--name``):
    the task's label and log id (the task's ``name`` field is its name in the log)."""
    return f"{row['task_name']} (log {row['log_id']})"


def on_master(stack: Stack, name: str) -> tuple[str, dict[str, Any]] | None:
    """Where the master lists the application called ``name``: ``("active", app)`` or
    ``("completed", app)``, or None."""
    master = stack.spark_master()
    for where in ("active", "completed"):
        apps = [a for a in master.get(f"{where}apps", []) if a.get("name") == name]
        assert len(apps) <= 1, (name, apps)
        if apps:
            return where, apps[0]
    return None


def running_jobs(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The running Spark jobs of the task of ``row`` (its job group), from its
    application driver's REST API (its Spark UI); None when the driver did not answer
    (a busy driver on a loaded machine may take seconds)."""
    url = (
        f"{row['spark_ui_url'].rstrip('/')}/api/v1/applications/"
        f"{row['spark_application_id']}/jobs?status=running"
    )
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            jobs: list[dict[str, Any]] = json.load(answer)
    except OSError:
        return None
    return [j for j in jobs if j.get("jobGroup") == row["spark_job_group"]]


def result(row: dict[str, Any]) -> Any:
    value = row["result"]
    return json.loads(value) if isinstance(value, str) else value


def test_a_spark_submit_task_runs_an_application_on_the_cluster_to_its_end(
    cluster: Stack,
) -> None:
    stack = cluster
    # Given a spark_submit task of sleepy_count.py (20 rows of 200 ms: 4 s of work) and a
    # pyspark task in a wave, then a second wave
    run_id = stack.trigger(SUBMIT_DAG, {"apps": str(APPS), "rows": 20, "ms": 200})

    # When the run ends
    run = ended(stack, SUBMIT_DAG, run_id)

    # Then it succeeded, each task once
    rows = stack.log_rows(run_id)
    assert run["state"] == "success", (run, rows, stack.tail())
    assert sorted((r["wave"], r["task_name"], r["status"]) for r in rows) == [
        (1, "pyspark count", "SUCCEEDED"),
        (1, "sleepy count", "SUCCEEDED"),
        (2, "after", "SUCCEEDED"),
    ], rows
    (submitted,) = [r for r in rows if r["task_name"] == "sleepy count"]
    (pyspark,) = [r for r in rows if r["task_name"] == "pyspark count"]

    # ... the spark_submit task's row records the submission (client deploy mode: the
    # provider knows no application id, the master names it)
    assert result(submitted) == {
        "application": str(APPS / "sleepy_count.py"),
        "application_id": None,
    }, submitted
    assert submitted["spark_job_group"] == f"spark_submit-{submitted['log_id']}", submitted

    # ... the application ran on the cluster and finished, and the task was tracked until
    # it ended (its row ends after the application did)
    found = on_master(stack, application_name(submitted))
    assert found is not None and found[0] == "completed", (found, stack.spark_master())
    app = found[1]
    assert app["state"] == "FINISHED", app
    assert app["duration"] >= 20 * 200, app  # milliseconds: the rows' sleeps
    assert submitted["end_time"] >= (app["starttime"] + app["duration"]) / 1000 - 1.0, (
        submitted,
        app,
    )
    # ... on a spare core (the stack's own applications kept theirs)
    apps = stack.spark_master()["activeapps"]
    assert len([a for a in apps if a["state"] == "RUNNING"]) == 2, apps
    assert app["id"] not in {a["id"] for a in apps}, apps

    # ... and the pyspark task counted on one of the worker applications, in its job group
    assert result(pyspark) == 20, pyspark
    assert pyspark["spark_application_id"] in {a["id"] for a in apps}, (pyspark, apps)
    assert pyspark["spark_job_group"] == f"scheduler_lib-{pyspark['log_id']}", pyspark


def test_a_cancel_kills_the_submitted_application_and_the_pyspark_job(
    cluster: Stack,
) -> None:
    stack = cluster
    # Given a wave of a long spark_submit task (600 rows of 500 ms: 5 minutes), a long
    # pyspark task (the same count) and a python task that fails when told to, fail_fast
    fail_file = stack.marks / f"fail-{uuid.uuid4().hex}"
    run_id = stack.trigger(
        CANCEL_DAG, {"apps": str(APPS), "fail_file": str(fail_file), "fail_after": 300}
    )
    try:
        rows = stack.wait(stack.running(run_id, 1, 3), START_DEADLINE, "wave 1's 3 tasks running")
        (submitted,) = [r for r in rows if r["task_name"] == "long submit"]
        (pyspark,) = [r for r in rows if r["task_name"] == "long pyspark"]
        name = application_name(submitted)

        # ... the submitted application running on the cluster, the pyspark task's job too
        def submitted_running() -> dict[str, Any] | None:
            found = on_master(stack, name)
            assert found is None or found[0] == "active", (found, stack.tail())
            return found[1] if found and found[1]["state"] == "RUNNING" else None

        app = stack.wait(submitted_running, SUBMITTED_DEADLINE, f"application {name!r} running")
        (pyspark,) = [r for r in stack.log_rows(run_id) if r["log_id"] == pyspark["log_id"]]
        stack.wait(lambda: running_jobs(pyspark), 120.0, "the pyspark task's Spark job running")
    finally:
        # When the python task fails (told to; also when the above did not come true: the
        # wave stops then too, rather than run for minutes)
        failed_at = time.time()
        fail_file.touch()

    # Then the run fails, the python task FAILED, the two others stopped: CANCELLED
    run = ended(stack, CANCEL_DAG, run_id)
    rows = stack.log_rows(run_id)
    assert run["state"] == "failed", (run, rows)
    assert sorted((r["wave"], r["task_name"], r["status"]) for r in rows) == [
        (1, "fail", "FAILED"),
        (1, "long pyspark", "CANCELLED"),
        (1, "long submit", "CANCELLED"),
    ], rows  # and the second wave never sent
    for row in rows:
        assert row["end_time"] - failed_at < STOP_DEADLINE, (row, failed_at)
    (failed,) = [r for r in rows if r["task_name"] == "fail"]
    assert "told to fail" in failed["error"], failed

    # ... the submitted application is gone from the cluster (spark-submit, its driver,
    # was killed: the master ends the application and frees its executor)
    def submitted_ended() -> dict[str, Any] | None:
        found = on_master(stack, name)
        return found[1] if found and found[0] == "completed" else None

    gone = stack.wait(submitted_ended, STOP_DEADLINE, f"application {name!r} ended")
    assert gone["id"] == app["id"] and gone["state"] in ("KILLED", "FINISHED"), gone
    assert gone["duration"] < 600 * 500, gone  # it did not count to its end

    # ... and the pyspark task's Spark job no longer runs (its job group was cancelled)
    stack.wait(lambda: running_jobs(pyspark) == [], 60.0, "no Spark job of the pyspark task")
