"""What the scenarios of tests/stack share: the running stack and how to look at it."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from bench.airflow_standalone import Api, HarnessError, Processes, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
READY = 360.0  # seconds for the stack to come up (about 90 on a quiet 2-core machine)
STOP_DEADLINE = 90.0  # seconds for Ctrl-C to stop everything (honcho: SIGTERM, 5 s, SIGKILL)
SUPERUSER = "postgresql+psycopg://postgres@127.0.0.1:5432/"
SERVING = "worker serving QueueAsyncTarget"  # what a scheduler-lib worker logs once it serves


@dataclass
class Stack:
    make: subprocess.Popen[bytes]
    processes: Processes
    env: dict[str, str]
    api: Api
    broker_db: str
    marks: Path  # where tests.stack.marks writes what task bodies did
    memory: MemorySampler

    def check_alive(self) -> None:
        if self.make.poll() is not None:
            raise HarnessError(f"make stack ended ({self.make.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return self.processes.tail("stack", lines)

    def log_text(self) -> str:
        return self.processes.log_text("stack")

    def wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`wait_for` while the stack runs; a failure shows the stack's last lines."""
        try:
            return wait_for(condition, timeout, what, check=self.check_alive)
        except HarnessError as exc:
            pytest.fail(f"{exc}\n{self.tail()}")

    def spark_master(self) -> dict[str, Any]:
        return self.spark_json(self.env["SPARK_MASTER_UI_PORT"])

    @staticmethod
    def spark_json(port: str | int) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=10) as answer:
            return dict(json.load(answer))

    def serving(self) -> int:
        """How often a scheduler-lib worker said it serves (once per start)."""
        return self.log_text().count(SERVING)

    def wait_ready(self, serving: int = 2) -> None:
        """Airflow healthy, the Spark cluster's two workers and two applications up, and
        ``serving`` 'worker serving' lines logged (2 after the start; one more after each
        worker a scenario killed)."""
        self.wait(self.api.healthy, READY, "Airflow's components healthy")

        def cluster() -> bool:
            try:
                master = self.spark_master()
            except OSError:
                return False
            alive = [w for w in master.get("workers", []) if w.get("state") == "ALIVE"]
            apps = [a for a in master.get("activeapps", []) if a.get("state") == "RUNNING"]
            return len(alive) == 2 and len(apps) == 2

        self.wait(cluster, READY, "two Spark workers and two applications")
        # An application registers with the master before its driver serves the queue
        # (its session warms up first): wait for the line each worker prints then, as an
        # operator would.
        self.wait(lambda: self.serving() >= serving, READY, f"{serving} 'worker serving' lines")

    def process_env(self) -> dict[str, str]:
        """The environment ``make stack`` gives each of its processes (secrets, the
        broker's URL as the app role, Spark's and Airflow's settings): what a process an
        operator adds beside the stack runs with."""
        from stack.run import process_environment, settings

        return {**process_environment(settings(self.env)), "PYTHONPATH": self.env["PYTHONPATH"]}

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Unpause ``dag_id`` once parsed and trigger it through the REST API; its run id."""
        self.api.wait_dag(dag_id, check=self.check_alive)
        self.api.unpause(dag_id)
        run_id: str = self.api.trigger(dag_id, conf)["dag_run_id"]
        return run_id

    def running(self, run_id: str, wave: int, n: int) -> Callable[[], list[dict[str, Any]]]:
        """A condition: the ``n`` tasks of ``wave`` all RUNNING (their rows), else nothing."""

        def look() -> list[dict[str, Any]]:
            rows = [r for r in self.log_rows(run_id) if r["wave"] == wave]
            return rows if len(rows) == n and all(r["status"] == "RUNNING" for r in rows) else []

        return look

    def log_rows(self, run_id: str) -> list[dict[str, Any]]:
        """``execution_log``'s rows of an Airflow run, in log id order."""
        engine = sa.create_engine(SUPERUSER + self.broker_db)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT * FROM execution_log WHERE run_id = :run ORDER BY log_id"),
                    {"run": run_id},
                )
                return [dict(r._mapping) for r in rows]
        finally:
            engine.dispose()


def worker_submit(stack: Stack, service: str, queue: str, *args: str) -> list[str]:
    """``spark-submit`` of one more ``scheduler-lib worker`` to the stack's master, serving
    ``service``/``queue``, sized as the Procfile's workers (one core, 512 MiB), its Spark
    UI on a port of its own: what an operator adds beside the stack."""
    entry = subprocess.run(
        ["scheduler-lib", "worker", "--entry-script"],
        env=stack.process_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    sizes = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m",
        "spark.cores.max": "1",
        "spark.ui.port": str(free_port()),
    }
    master = f"spark://127.0.0.1:{stack.env['SPARK_MASTER_PORT']}"
    confs = [part for key, value in sizes.items() for part in ("--conf", f"{key}={value}")]
    return [
        "spark-submit",
        "--master",
        master,
        *confs,
        "--driver-memory",
        "512m",
        entry,
        "--service",
        service,
        "--queue",
        queue,
        *args,
    ]


def memory(processes: list[psutil.Process]) -> int:
    """Bytes of memory ``processes`` use: their proportional set sizes summed (a page
    shared by n processes counts 1/n in each: forked Airflow workers are not counted
    many times over)."""
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except (psutil.Error, OSError):
            continue  # ended meanwhile
    return total


class MemorySampler:
    """The stack's memory every ``interval`` seconds, from its start to its stop: the
    highest and the latest figure (issue 23's budget is 8 GiB)."""

    def __init__(self, state: str, interval: float = 5.0) -> None:
        self.state = state
        self.interval = interval
        self.peak = self.latest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> int:
        self.latest = memory(stack_processes(self.state))
        self.peak = max(self.peak, self.latest)
        return self.latest

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def stack_processes(state: str) -> list[psutil.Process]:
    """Every process on the machine that belongs to the stack whose state is ``state``
    (each has it in its environment: honcho gives it to all, and they to their children)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("STACK_DIR") == state:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found
