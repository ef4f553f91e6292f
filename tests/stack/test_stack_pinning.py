"""Keeping a plan on one Spark application (issue 23, scenario 7).

Temporary views, cached tables and session settings live in one Spark application: on
the stack's shared target, served by two worker applications, a plan whose later wave
reads a temporary view its first wave made fails whenever another application takes the
later task. The way to keep such a plan on one application (docs/operations.md, "Several
workers"): a target of its own that one worker application serves. Here an operator adds
that worker beside the stack (``ServicePinned``, two readers), and two such plans run at
once, each with its own view: every task of both ran in that one application, and the
later waves read the views.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from bench.airflow_standalone import Processes
from tests.stack.harness import Stack, worker_submit

DAG_ID = "stack_pinned"
SERVICE, QUEUE = "ServicePinned", "QueuePinned"
START_DEADLINE = 300.0
RUN_DEADLINE = 420.0

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def running_applications(stack: Stack) -> set[str]:
    return {a["id"] for a in stack.spark_master()["activeapps"] if a["state"] == "RUNNING"}


def test_plans_sharing_temporary_views_stay_on_the_application_of_their_target(
    stack: Stack, tmp_path: Path
) -> None:
    # Given a worker application of its own serving the pinned target
    before = running_applications(stack)
    processes = Processes(tmp_path / "logs")
    pinned = processes.start(
        "pinned", worker_submit(stack, SERVICE, QUEUE, "--max-readers", "2"), stack.process_env()
    )
    try:
        stack.wait(
            lambda: f"worker serving {QUEUE}" in processes.log_text("pinned"),
            START_DEADLINE,
            "the pinned worker serving",
        )

        # When two plans with temporary views of their own are triggered at once
        stack.api.wait_dag(DAG_ID, check=stack.check_alive)
        stack.api.unpause(DAG_ID)
        runs = {
            view: stack.api.trigger(DAG_ID, {"view": view, "rows": rows})["dag_run_id"]
            for view, rows in (("plan_a", 10), ("plan_b", 20))
        }

        # Then both succeed, every task in the one application of the pinned worker
        applications = set()
        for view, run_id in runs.items():
            run = stack.api.wait_run(DAG_ID, run_id, RUN_DEADLINE, check=stack.check_alive)
            assert run["state"] == "success", stack.api.task_instances(DAG_ID, run_id)
            rows = stack.log_rows(run_id)
            assert [r["status"] for r in rows] == ["SUCCEEDED"] * 3, rows
            applications |= {r["spark_application_id"] for r in rows}
            # ... and the later wave read the view the first made, its own
            results = {
                r["task_name"]: list(json.loads(r["result"])["rows"][0].values())
                for r in rows
                if r["wave"] == 2
            }
            assert results == (
                {"count": [10], "sum": [45]} if view == "plan_a" else {"count": [20], "sum": [190]}
            ), results
        assert len(applications) == 1, applications
        # ... the pinned worker's application, not one of the stack's two
        (application,) = applications
        assert application not in before and application in running_applications(stack)
    finally:
        if pinned.poll() is None:
            os.killpg(pinned.pid, signal.SIGTERM)
        processes.stop_all()
