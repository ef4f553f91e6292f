"""``make stack``, end to end, as an operator runs it (issue 23, scenario 1).

Given ``make stack`` started as documented, in a process of its own, with the committed
``.env`` and nothing but free ports and names of its own (its databases and roles on the
machine's PostgreSQL, its state in the test's tmp dir): a Spark standalone cluster of two
workers, Airflow's api-server, scheduler, dag-processor and triggerer on PostgreSQL, two
``scheduler-lib worker`` applications on the cluster sharing a Hive metastore on
PostgreSQL, and ``scheduler-lib serve``; when both example DAGs are triggered through
Airflow's REST API as the logged-in admin (without a logical date, as the API and the UI
allow); then

- both runs succeed in Airflow;
- the ETL load wave's four tasks ran at once, spread over both worker applications, and
  the later waves read the tables the earlier ones made on the other application;
- headless Chromium follows the ETL run on the Execution Status page and its run tab;
- every port of the stack's processes is on 127.0.0.1;
- Ctrl-C (SIGINT to the terminal's process group) stops every process of the stack.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from bench.airflow_standalone import HarnessError, quote, wait_for
from tests.airflow.test_standalone import CHROME_FLAGS, PAGE_STATE
from tests.scrape import samples
from tests.stack.harness import STOP_DEADLINE, Stack, stack_processes

ETL, BLOG = "scheduler_lib_batch_etl", "scheduler_lib_blog_waves"
RUN_DEADLINE = 420.0  # seconds for both runs (about 60; a retry waits 5 s more)
BROWSER_WAIT = 60.0
GIB = 1024**3
MEMORY_BUDGET = 8 * GIB  # the whole stack's, issue 23
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
TASKS_FINISHED = "scheduler_lib_tasks_finished_total"

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]


def test_make_stack_runs_both_example_dags_over_two_workers(
    stack: Stack, chromium: tuple[str, str], tmp_path: Path
) -> None:
    api = stack.api
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
            # (An answer that does not come, on a loaded machine, is another look's job.)
            status, found = api.call("GET", f"/api/v2/dags/{ETL}/dagRuns")
            listed = found.get("dag_runs") if status == 200 and isinstance(found, dict) else None
            return bool(listed) and all(r["state"] in ("success", "failed") for r in listed)

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
    rows = [r for r in stack.log_rows(runs[ETL]) if r["status"] == "SUCCEEDED"]
    load = [r for r in rows if r["wave"] == 1]
    assert len(load) == 4, rows
    assert max(r["start_time"] for r in load) < min(r["end_time"] for r in load), load
    applications = {r["spark_application_id"] for r in load}
    assert len(applications) == 2, applications
    assert {r["wave"] for r in rows} == {1, 2, 3, 4}
    assert all(r["spark_application_id"] in applications for r in rows)
    assert {r["status"] for r in stack.log_rows(runs[BLOG])} == {"SUCCEEDED"}

    # And each scheduler-lib process says it is healthy on its metrics port, and the two
    # worker applications' own counters add up to the ETL run's Spark tasks at least
    finished = 0.0
    for process in ("WORKER_1", "WORKER_2", "SERVE"):
        port = stack.env[f"SCHEDULER_LIB_{process}_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as got:
            assert json.loads(got.read())["healthy"] is True, process
        seen = samples(f"http://127.0.0.1:{port}/metrics", timeout=30)
        if process != "SERVE":
            finished += sum(v for (name, _), v in seen.items() if name == TASKS_FINISHED)
    assert finished >= len(rows), (finished, len(rows))


@pytest.mark.stack_stop
def test_ctrl_c_in_make_stacks_terminal_stops_every_process(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the stack, after every other scenario: within its memory budget all along
    state = stack.env["STACK_DIR"]
    assert len(stack_processes(state)) > 20  # honcho, the JVMs, Airflow's, the workers
    idle = stack.memory.sample()
    with capsys.disabled():
        print(
            f"\nmake stack's memory (PSS of its processes, sampled every "
            f"{stack.memory.interval:.0f} s through every scenario): highest "
            f"{stack.memory.peak / GIB:.2f} GiB, at the end {idle / GIB:.2f} GiB"
        )
    assert stack.memory.peak < MEMORY_BUDGET, stack.memory.peak
    # And every port its processes listen on is on loopback (issue 23: "all ports on
    # 127.0.0.1"; a Hive metastore service would listen on every interface)
    listening = sorted(
        (" ".join(process.cmdline()[:3])[:80], f"{c.laddr.ip}:{c.laddr.port}")
        for process in stack_processes(state)
        for c in listeners(process)
        if c.laddr.ip not in LOOPBACK
    )
    assert listening == [], listening

    # When the operator presses Ctrl-C in make stack's terminal
    os.killpg(stack.make.pid, signal.SIGINT)
    stack.make.wait(STOP_DEADLINE)

    # Then nothing of the stack is left running
    deadline = time.monotonic() + 30
    while stack_processes(state) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [" ".join(p.cmdline()[:4]) for p in stack_processes(state)]
    assert left == [], left


def listeners(process: psutil.Process) -> list[Any]:
    """The TCP sockets ``process`` listens on (none once it has ended)."""
    try:
        return [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except (psutil.Error, OSError):
        return []
