"""External activation on the cluster (issue 23, scenario 6).

Beside the running stack, an operator adds a ``scheduler-lib worker`` of one reader on a
target of its own (``ServiceBurst``), submitted to the stack's Spark master with
``spark-submit`` as the Procfile's workers are, and with ``--launch-command`` starting one
more such worker through ``spark-submit`` when it is full. When a wave of two tasks comes:

- the first worker takes one, and its launcher starts another application on the
  cluster, which takes the other: the two run at once, in two drivers;
- the launched worker leaves once idle for its ``--idle-exit``;
- when the first worker stops (SIGTERM), the launch set-up it made (the events queue, its
  service, the event notification on the target queue) is gone with it.
"""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from bench.airflow_standalone import Processes
from scheduler_lib.broker import Broker
from tests.stack.harness import SUPERUSER, Stack, worker_submit
from tests.stack.marks import count, release

DAG_ID = "stack_burst"
SERVICE, QUEUE = "ServiceBurst", "QueueBurst"
IDLE_EXIT = 20  # seconds the launched worker stays without work
TASK_SECONDS = 600  # at most: the test releases the tasks once it has seen both run at once
START_DEADLINE = 300.0  # seconds for the launched application to come up and take its task
RUN_DEADLINE = 420.0
STOP_DEADLINE = 90.0

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def drivers(process: psutil.Process) -> list[psutil.Process]:
    """The Python drivers under a ``spark-submit`` (the first one's and what it launched)."""
    found = []
    for child in process.children(recursive=True):
        try:
            if child.name().startswith("python") and any("worker" in a for a in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def launch_setup(stack: Stack) -> dict[str, Any]:
    with Broker(SUPERUSER + stack.broker_db, migrate=False, timers=False) as broker:
        return {
            "queues": {q.name for q in broker.queues()} & {f"{QUEUE}Launcher"},
            "services": {s["service_name"] for s in broker.services()} & {f"{SERVICE}Launcher"},
            "notifications": {n["notification_name"] for n in broker.event_notifications()}
            & {f"{QUEUE}Workers"},
        }


def test_a_full_worker_launches_another_application_on_the_cluster(
    stack: Stack, tmp_path: Path
) -> None:
    env = stack.process_env()
    launched_command = worker_submit(
        stack, SERVICE, QUEUE, "--max-readers", "1", "--no-init", "--idle-exit", str(IDLE_EXIT)
    )
    first_command = worker_submit(
        stack,
        SERVICE,
        QUEUE,
        "--max-readers",
        "1",
        "--queue-readers",
        "2",
        "--max-launched",
        "1",
        "--launch-command",
        shlex.join(launched_command),
    )
    processes = Processes(tmp_path / "logs")
    first = processes.start("burst", first_command, env)
    run_id: str | None = None
    try:
        # Given one worker of one reader serving the target, its launcher listening
        stack.wait(
            lambda: f"worker serving {QUEUE}" in processes.log_text("burst"),
            START_DEADLINE,
            "the first burst worker serving",
        )
        assert launch_setup(stack) == {
            "queues": {f"{QUEUE}Launcher"},
            "services": {f"{SERVICE}Launcher"},
            "notifications": {f"{QUEUE}Workers"},
        }
        (driver,) = drivers(psutil.Process(first.pid))

        # When a wave of two tasks comes, held until the test releases them, so that a
        # launched application has time to start (about 40 s: its JVM, its executor, its
        # session's warm-up) while the first runs
        stack.api.wait_dag(DAG_ID, check=stack.check_alive)
        stack.api.unpause(DAG_ID)
        run_id = stack.api.trigger(DAG_ID, {"marks": str(stack.marks), "seconds": TASK_SECONDS})[
            "dag_run_id"
        ]

        # Then another application on the cluster takes the second, the two at once
        def both_running() -> list[dict[str, Any]]:
            rows = stack.log_rows(run_id)
            running = [r for r in rows if r["status"] == "RUNNING"]
            return running if len(running) == 2 else []

        rows = stack.wait(
            both_running, START_DEADLINE, "both tasks running, one in a launched worker"
        )
        pids = {int(r["worker_id"].split(":")[1]) for r in rows}
        assert driver.pid in pids and len(pids) == 2, (driver.pid, rows)
        (launched_pid,) = pids - {driver.pid}
        assert launched_pid in {p.pid for p in drivers(psutil.Process(first.pid))}
        apps = [a for a in stack.spark_master()["activeapps"] if a["state"] == "RUNNING"]
        assert len(apps) == 4, apps  # the stack's two, the first burst worker, the launched
        release(stack.marks, run_id)

        run = stack.api.wait_run(DAG_ID, run_id, RUN_DEADLINE, check=stack.check_alive)
        assert run["state"] == "success", stack.api.task_instances(DAG_ID, run_id)
        assert count(stack.marks, run_id) == {"burst1": 1, "burst2": 1}

        # And the launched worker leaves once idle, its application with it
        stack.wait(
            lambda: not psutil.pid_exists(launched_pid),
            IDLE_EXIT + 120.0,
            "the launched worker leaving when idle",
        )
        stack.wait(
            lambda: len([a for a in stack.spark_master()["activeapps"]]) == 3,
            120.0,
            "the launched application gone from the master",
        )

        # When the first worker is stopped as a service manager stops it
        driver.send_signal(signal.SIGTERM)
        first.wait(STOP_DEADLINE)

        # Then the launch set-up it made is gone with it
        assert launch_setup(stack) == {"queues": set(), "services": set(), "notifications": set()}
    finally:
        if run_id is not None:  # a failed check must not leave the tasks holding the stack
            release(stack.marks, run_id)
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        processes.stop_all()
