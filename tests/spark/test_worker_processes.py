"""The Spark worker as users run it: hosted by ``spark-submit`` (the way a cluster starts
it), on PostgreSQL, and scaled out by external activation — a second worker application
started when one driver's readers are all busy."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from multiproc import Output
from multiproc import poll as _poll

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.spark import Worker
from scheduler_lib.spark.worker import launch_command

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent  # spark-submit and scheduler-lib live next to python
DEADLINE = 120.0  # a JVM starts in ~10 s here; far more when the machine is busy


def poll(condition: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    return _poll(condition, timeout, what, interval=0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def environment(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYSPARK_PYTHON": sys.executable,  # the driver's Python: this one
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


@pytest.fixture
def submitted_worker(sqlite_url: str) -> Iterator[tuple[subprocess.Popen[str], Output]]:
    """``spark-submit --master local[1] <entry script> --db …``: a worker hosted the way a
    cluster hosts it."""
    entry = subprocess.run(
        [str(BIN / "scheduler-lib"), "worker", "--entry-script"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    command = [str(BIN / "spark-submit"), "--master", "local[1]", entry, "--db", sqlite_url]
    process = subprocess.Popen(
        [*command, "--metrics-port", "0"],  # any free port, which it says
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    output = Output(process.stdout)
    try:
        yield process, output
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def test_spark_submit_hosts_the_worker_and_status_links_its_ui(
    submitted_worker: tuple[subprocess.Popen[str], Output], sqlite_url: str
) -> None:
    process, output = submitted_worker
    poll(
        lambda: output.has("worker serving") or process.poll() is not None,
        "the worker to serve",
    )
    assert process.poll() is None, output.tail()
    # Its health check names the Spark application it runs (and the database, the readers)
    said = re.compile(r"metrics on (http://[^/\s]+)/metrics")
    [base] = poll(
        lambda: [m.group(1) for line in output.lines if (m := said.search(line))], "the port"
    )
    with urllib.request.urlopen(f"{base}/healthz", timeout=30) as got:
        healthy = json.loads(got.read())
    assert healthy["healthy"] is True, healthy
    assert healthy["checks"]["spark"]["detail"].startswith("application local-"), healthy
    assert set(healthy["checks"]) == {"database", "readers", "spark"}, healthy
    with Broker(sqlite_url) as broker:
        report = TaskScheduler(broker).run_waves(
            [[{"kind": "spark_sql", "sql": "SELECT count(*) AS n FROM range(7)"}]]
        )
        [done] = report.completions
        assert done.ok, done.error
        assert done.result["rows"] == [{"n": 7}]
        with broker.transaction() as tx:
            row = tx.fetch_one("log_get", log_id=done.log_id)
    # Who ran it: the driver's Python process, its reader, and the Spark application.
    _host, pid, reader, application = row["worker_id"].split(":", 3)
    assert application.startswith("local-") and reader.startswith("reader-")
    assert row["spark_application_id"] == application
    assert row["spark_ui_url"].startswith("http://")
    status = subprocess.run(
        [str(BIN / "scheduler-lib"), "status", "--db", sqlite_url],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "250"},
    ).stdout
    assert f"Spark application {application}: UI {row['spark_ui_url']}" in status
    # Stopping the driver JVM (what a cluster manager does) ends the Python side too.
    process.send_signal(signal.SIGTERM)
    poll(lambda: process.poll() is not None, "spark-submit to end", 60)
    poll(lambda: not alive(int(pid)), "the worker's Python process to leave", 60)


@pytest.mark.postgres
def test_a_worker_on_postgresql_runs_a_wave(postgres_url: str, spark: SparkSession) -> None:
    with Broker(postgres_url) as broker, Worker(broker, spark=spark, max_readers=2):
        report = TaskScheduler(broker).run_waves(
            [
                [
                    {"kind": "spark_sql", "sql": f"SELECT {i} * count(*) AS n FROM range(10)"}
                    for i in range(3)
                ],
                [{"kind": "pyspark", "callable": "spark_tasks:squares", "args": [2]}],
            ]
        )
    assert report.ok, [c.error for c in report.completions]
    assert sorted(c.result["rows"][0]["n"] for c in report.waves[0].completions) == [0, 10, 20]


def test_external_activation_starts_another_worker_when_the_driver_is_full(
    sqlite_url: str, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launched worker is a real second Spark application (its own JVM).
    for key, value in environment().items():
        monkeypatch.setenv(key, value)
    gate = tmp_path / "gate"
    command = launch_command(
        sqlite_url,
        service="ServiceAsyncTarget",
        queue="QueueAsyncTarget",
        master="local[1]",
        max_readers=1,
        conf={"spark.ui.enabled": "false"},
        idle_exit=3,
    )
    with Broker(sqlite_url) as broker:
        worker = Worker(
            broker, spark=spark, max_readers=1, launch_command=command, max_launched=1
        ).start()
        try:
            scheduler = TaskScheduler(broker)
            handle = scheduler.get_scheduler()
            hold = {"kind": "pyspark", "callable": "spark_tasks:hold_until", "args": [str(gate)]}
            log_ids = scheduler.exec_many(handle, [hold, hold])

            def runners() -> list[Any]:
                with broker.transaction() as tx:
                    rows = [tx.fetch_one("log_get", log_id=i) for i in log_ids]
                running = [r for r in rows if r["status"] == "RUNNING"]
                return running if len(running) == 2 else []

            # One driver runs one task at a time: the second can only run in another.
            rows = poll(runners, "both tasks to run, one in a launched worker")
            applications = {r["worker_id"].rsplit(":", 1)[1] for r in rows}
            assert spark.sparkContext.applicationId in applications
            assert len(applications) == 2
            gate.touch()
            done = [scheduler.synchronization(handle, timeout=DEADLINE) for _ in log_ids]
            assert all(c.ok for c in done), [c.error for c in done]
            assert {c.result for c in done} == applications
            launcher = worker.launcher
            assert launcher is not None
            launched = list(launcher.processes)
            assert len(launched) == 1  # the cap
            # Idle for idle_exit seconds, the launched worker leaves by itself.
            poll(lambda: launcher.running == 0, "the launched worker to leave when idle")
            assert launched[0].returncode == 0
            scheduler.release_scheduler(handle)
        finally:
            gate.touch()
            worker.stop()
    events = json.dumps(command)
    assert "--no-init" in events and "--idle-exit" in events
