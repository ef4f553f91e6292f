"""``make stack``, end to end, as an operator runs it (issue 23, scenario 1).

Given ``make stack`` started as documented, in a process of its own, with the committed
``.env`` and nothing but free ports and names of its own (its databases and roles on the
machine's PostgreSQL, its state in the test's tmp dir): a Spark standalone cluster of two
workers, a Hive metastore, Airflow's api-server, scheduler, dag-processor and triggerer
on PostgreSQL, two ``scheduler-lib worker`` applications on the cluster and
``scheduler-lib serve``; when both example DAGs are triggered through Airflow's REST API
as the logged-in admin (without a logical date, as the API and the UI allow); then

- both runs succeed in Airflow;
- the ETL load wave's four tasks ran at once, spread over both worker applications, and
  the later waves read the tables the earlier ones made on the other application;
- headless Chromium follows the ETL run on the Execution Status page and its run tab;
- Ctrl-C (SIGINT to the terminal's process group) stops every process of the stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from bench.airflow_standalone import Api, HarnessError, Processes, free_port, quote, wait_for
from stack.run import DEFAULTS, read_env_file
from tests.airflow.test_standalone import CHROME_FLAGS, PAGE_STATE

REPO = Path(__file__).resolve().parents[2]
ETL, BLOG = "scheduler_lib_batch_etl", "scheduler_lib_blog_waves"
READY = 360.0  # seconds for the stack to come up (about 90 on a quiet 2-core machine)
RUN_DEADLINE = 420.0  # seconds for both runs (about 60; a retry waits 5 s more)
BROWSER_WAIT = 60.0
STOP_DEADLINE = 90.0  # seconds for Ctrl-C to stop everything (honcho: SIGTERM, 5 s, SIGKILL)
SUPERUSER = "postgresql+psycopg://postgres@127.0.0.1:5432/"

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]


@dataclass
class Stack:
    make: subprocess.Popen[bytes]
    processes: Processes
    env: dict[str, str]
    api: Api
    broker_db: str

    def check_alive(self) -> None:
        if self.make.poll() is not None:
            raise HarnessError(f"make stack ended ({self.make.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return self.processes.tail("stack", lines)

    def spark_master(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.env['SPARK_MASTER_UI_PORT']}/json/"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return dict(json.load(answer))


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


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    suffix = uuid.uuid4().hex[:8]
    names = {
        "AIRFLOW_DB_NAME": f"stack_{suffix}_airflow",
        "AIRFLOW_DB_USER": f"stack_{suffix}_airflow",
        "BROKER_DB_NAME": f"stack_{suffix}_broker",
        "BROKER_OWNER_ROLE": f"stack_{suffix}_owner",
        "BROKER_APP_ROLE": f"stack_{suffix}_app",
        "BROKER_MONITOR_ROLE": f"stack_{suffix}_monitor",
    }
    ports = {key: str(free_port()) for key in DEFAULTS if key.endswith("_PORT")}
    ports["POSTGRES_PORT"] = "5432"
    state = str(tmp_path / "stack")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SPARK"))},
        **names,
        **ports,
        "STACK_DIR": state,
    }
    processes = Processes(tmp_path / "logs")
    make = processes.start("stack", ["make", "-s", "stack"], env, cwd=REPO)
    api = Api(f"http://127.0.0.1:{ports['AIRFLOW_PORT']}")
    try:
        yield Stack(make, processes, env, api, names["BROKER_DB_NAME"])
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                make.wait(STOP_DEADLINE)
        for process in stack_processes(state):
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
        processes.stop_all()
        admin = sa.create_engine(SUPERUSER + "postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            for key in ("AIRFLOW_DB_NAME", "BROKER_DB_NAME"):
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{names[key]}" WITH (FORCE)'))
            for key in ("AIRFLOW_DB_USER", "BROKER_OWNER_ROLE", "BROKER_APP_ROLE"):
                conn.execute(sa.text(f'DROP ROLE IF EXISTS "{names[key]}"'))
            conn.execute(sa.text(f'DROP ROLE IF EXISTS "{names["BROKER_MONITOR_ROLE"]}"'))
        admin.dispose()


def wait_ready(stack: Stack) -> None:
    """Airflow healthy, and the Spark cluster's two workers and two applications up."""
    try:
        wait_for(stack.api.healthy, READY, "Airflow's components healthy", check=stack.check_alive)

        def cluster() -> bool:
            try:
                master = stack.spark_master()
            except OSError:
                return False
            alive = [w for w in master.get("workers", []) if w.get("state") == "ALIVE"]
            apps = [a for a in master.get("activeapps", []) if a.get("state") == "RUNNING"]
            return len(alive) == 2 and len(apps) == 2

        wait_for(cluster, READY, "two Spark workers and two applications", check=stack.check_alive)
        # An application registers with the master before its driver serves the queue
        # (its session warms up first): wait for the line each worker prints then, as an
        # operator would.
        wait_for(
            lambda: stack.processes.log_text("stack").count("worker serving QueueAsyncTarget") >= 2,
            READY,
            "both scheduler-lib workers serving",
            check=stack.check_alive,
        )
    except HarnessError as exc:
        pytest.fail(f"{exc}\n{stack.tail()}")


def log_rows(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(SUPERUSER + stack.broker_db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT * FROM execution_log WHERE run_id = :run ORDER BY log_id"),
                {"run": run_id},
            )
            return [dict(r._mapping) for r in rows]
    finally:
        engine.dispose()


def test_make_stack_runs_both_example_dags_over_two_workers_and_stops_on_ctrl_c(
    stack: Stack, chromium: tuple[str, str], tmp_path: Path
) -> None:
    api = stack.api
    wait_ready(stack)
    secrets = read_env_file(REPO / ".env")
    api.login(secrets["AIRFLOW_ADMIN_USERNAME"], secrets["AIRFLOW_ADMIN_PASSWORD"])
    for dag_id in (ETL, BLOG):
        api.wait_dag(dag_id, check=stack.check_alive)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium[0]
    for flag in (*CHROME_FLAGS, "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(chromium[1]))
    try:
        driver.get(f"{api.base}/api/v2/version")
        driver.add_cookie({"name": "_token", "value": api.token, "path": "/"})

        def open_in_airflow(url: str) -> dict[str, Any]:
            driver.switch_to.default_content()
            driver.get(url)
            frame = WebDriverWait(driver, BROWSER_WAIT).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, "iframe")
            )[0]
            driver.switch_to.frame(frame)
            return dict(
                WebDriverWait(driver, BROWSER_WAIT).until(
                    lambda d: (state := d.execute_script(PAGE_STATE))["updated"] and state
                )
            )

        # When both example DAGs are unpaused and triggered through the REST API (no logical
        # date), one after the other: the four readers of the queue are all the stack has,
        # and the ETL DAG's daily run (made when it is unpaused) goes first
        runs = {}
        for dag_id in (ETL, BLOG):
            api.unpause(dag_id)

        def scheduled_run_ended() -> bool:
            # Unpausing makes it (the latest daily interval): it exists, then it ends.
            found = api.expect("GET", f"/api/v2/dags/{ETL}/dagRuns")["dag_runs"]
            return bool(found) and all(r["state"] in ("success", "failed") for r in found)

        try:
            wait_for(
                scheduled_run_ended,
                RUN_DEADLINE,
                "the ETL DAG's scheduled run ended",
                check=stack.check_alive,
            )
        except HarnessError as exc:
            pytest.fail(f"{exc}\n{stack.tail()}")
        runs[BLOG] = api.trigger(BLOG)["dag_run_id"]
        api.wait_run(BLOG, runs[BLOG], RUN_DEADLINE, check=stack.check_alive)
        runs[ETL] = api.trigger(ETL)["dag_run_id"]

        # Then the Execution Status page follows the ETL run to its end ...
        page = (
            f"{api.base}/plugin/execution-status/scheduler-lib/"
            f"?dag_id={ETL}&run_id={quote(runs[ETL])}&refresh=1"
        )
        first = open_in_airflow(page)
        assert first["problem"] is None, first["problem"]

        def all_succeeded() -> bool:
            state = driver.execute_script(PAGE_STATE)
            assert state["problem"] is None, state["problem"]
            succeeded = [r for r in state["log"] if r["status"] == "SUCCEEDED"]
            return len({r["task"] for r in succeeded}) == 8

        try:
            wait_for(all_succeeded, RUN_DEADLINE, "the page shows the ETL run's 8 tasks done")
        except HarnessError as exc:
            pytest.fail(f"{exc}\n{stack.tail()}")
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "stack_execution_status.png"))

        # ... and both runs succeed in Airflow
        for dag_id, run_id in runs.items():
            finished = api.wait_run(dag_id, run_id, RUN_DEADLINE, check=stack.check_alive)
            assert finished["state"] == "success", (dag_id, api.task_instances(dag_id, run_id))

        # And the run's own tab shows its rows
        tab = open_in_airflow(
            f"{api.base}/dags/{ETL}/runs/{quote(runs[ETL])}/plugin/execution-status-run"
        )
        assert {r["task"] for r in tab["log"] if r["status"] == "SUCCEEDED"} >= {
            "load orders",
            "sales report",
        }
    finally:
        driver.quit()

    # And the load wave's four tasks ran at once, over both worker applications, and the
    # later waves found the tables the load wave made on either
    rows = [r for r in log_rows(stack, runs[ETL]) if r["status"] == "SUCCEEDED"]
    load = [r for r in rows if r["wave"] == 1]
    assert len(load) == 4, rows
    assert max(r["start_time"] for r in load) < min(r["end_time"] for r in load), load
    applications = {r["spark_application_id"] for r in load}
    assert len(applications) == 2, applications
    assert {r["wave"] for r in rows} == {1, 2, 3, 4}
    assert all(r["spark_application_id"] in applications for r in rows)
    assert {r["status"] for r in log_rows(stack, runs[BLOG])} == {"SUCCEEDED"}

    # When the operator presses Ctrl-C in make stack's terminal
    state = stack.env["STACK_DIR"]
    assert len(stack_processes(state)) > 20  # honcho, the JVMs, Airflow's, the workers
    os.killpg(stack.make.pid, signal.SIGINT)
    stack.make.wait(STOP_DEADLINE)

    # Then nothing of the stack is left running
    deadline = time.monotonic() + 30
    while stack_processes(state) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [" ".join(p.cmdline()[:4]) for p in stack_processes(state)]
    assert left == [], left
