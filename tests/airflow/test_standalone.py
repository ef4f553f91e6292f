"""End to end: ``airflow standalone`` runs the blog's DAG on a scheduler_lib worker, and
the Execution Status page shows its rows in a real browser, inside Airflow's UI.

Given ``airflow standalone`` (scheduler, dag-processor, triggerer, api-server) on a free
local port with ``dags/`` and ``plugins/`` of this repository, a ``scheduler_lib_default``
connection to a SQLite broker, ``scheduler-lib serve`` on that broker, and headless
Chromium logged in to Airflow's UI with its ``_token`` cookie; when the
``scheduler_lib_blog_waves`` DAG is unpaused and triggered through the REST API; then the
top-level *Execution Status* page (inside Airflow's UI) follows the run without a reload
— a task running, then every task SUCCEEDED, one timeline bar each — the run's own tab
shows the same rows, screenshots land in the test's tmp dir, and the same URLs without a
login get 401.

Needs Debian's ``chromium`` and ``chromium-driver``: installed with apt-get when missing
and this process may (root); otherwise skipped locally and failed under ``CI``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.airflow_standalone import (
    BIN,
    Api,
    HarnessError,
    Processes,
    Standalone,
    quote,
    run_path,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "dags" / "blog_waves.py"
DAG_ID = "scheduler_lib_blog_waves"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
STARTUP = 180.0  # seconds for standalone to come up healthy (about 15 on a quiet machine)
RUN_DEADLINE = 150.0  # seconds for the DAG run to finish (about 30)
BROWSER_WAIT = 30.0  # seconds for the page to show the rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]


# --- the machine: a browser ------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Debian's chromium and its driver, installed with apt-get when missing."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        problem = _install_chromium()
        if problem is not None:
            if IN_CI:
                pytest.fail(f"chromium is mandatory under CI but could not be installed: {problem}")
            pytest.skip(f"chromium missing and not installable here: {problem}")
    return CHROMIUM, CHROMEDRIVER


def _install_chromium() -> str | None:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "needs root and apt-get: apt-get install -y chromium chromium-driver"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
    return None


def expected_task_names() -> set[str]:
    """The names of the tasks the DAG sends, read from its file (importing it would
    import Airflow into this process): ``wave N task i (U units)``."""
    tree = ast.parse(DAG_FILE.read_text())
    (waves,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "WAVES" for t in node.targets)
    ]
    return {
        f"wave {number} task {i} ({units} units)"
        for number, lengths in enumerate(waves, start=1)
        for i, units in enumerate(lengths, start=1)
    }


# --- the test ---------------------------------------------------------------------------


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[tuple[Api, Processes]]:
    """``airflow standalone`` (the benchmarks' harness) and ``scheduler-lib serve`` on a
    fresh home and broker, healthy, with a logged-in API client."""
    broker_url = f"sqlite:///{tmp_path / 'broker.db'}"
    with Processes(tmp_path / "logs") as processes:
        airflow = Standalone(
            processes,
            tmp_path,
            dags_folder=REPO / "dags",
            plugins_folder=REPO / "plugins",
            env={
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT": json.dumps(
                    {"conn_type": "scheduler_lib", "host": broker_url}
                ),
            },
        )
        subprocess.run(
            [str(BIN / "scheduler-lib"), "init", "--db", broker_url],
            env=airflow.env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        processes.start(
            "serve", [str(BIN / "scheduler-lib"), "serve", "--db", broker_url], airflow.env
        )
        try:
            api = airflow.start(STARTUP)
        except HarnessError as exc:
            pytest.fail(str(exc))
        yield api, processes


# What the page shows, read in one go inside its frame (the page redraws its tables on
# every refresh: elements held across a refresh would go stale).
PAGE_STATE = """
const rows = [...document.querySelectorAll("#log tbody tr[data-log-id]")];
const problem = document.getElementById("problem");
return {
  updated: document.getElementById("updated").textContent,
  log: rows.map((r) => ({status: r.dataset.status,
                         task: r.querySelector("td.task-name .name").textContent})),
  running: [...document.querySelectorAll("#running tbody tr")].filter((r) => r.dataset.logId)
    .length,
  bars: document.querySelectorAll("#timeline rect.bar").length,
  problem: problem.hidden ? null : problem.textContent,
};
"""


def test_execution_status_page_follows_a_dag_run_in_a_browser(
    standalone: tuple[Api, Processes], chromium: tuple[str, str], tmp_path: Path
) -> None:
    api, processes = standalone
    names = expected_task_names()

    # Given the blog's DAG, parsed by the dag-processor, and a browser logged in to
    # Airflow's UI.
    api.wait_dag(DAG_ID, check=processes.check_alive)

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
        # Log in as Airflow's UI does: the JWT in the _token cookie of the api-server's
        # origin (a cookie can only be set on a page of that origin).
        driver.get(f"{api.base}/api/v2/version")
        driver.add_cookie({"name": "_token", "value": api.token, "path": "/"})

        def open_in_airflow(url: str) -> dict[str, Any]:
            """Open a page of Airflow's UI, enter the plugin's frame, and return what it
            shows once it has drawn a snapshot."""
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

        def screenshot(name: str) -> None:
            driver.switch_to.default_content()
            driver.save_screenshot(str(tmp_path / name))
            driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe"))

        # When the DAG is unpaused and triggered through the REST API ...
        api.unpause(DAG_ID)
        run_id = api.trigger(DAG_ID)["dag_run_id"]
        path_of_run = run_path(DAG_ID, run_id)

        # ... then the top-level page, filtered to the run and refreshing every second,
        # follows it without a reload: tasks appear, run, and succeed.
        page = (
            f"{api.base}/plugin/execution-status/scheduler-lib/"
            f"?dag_id={DAG_ID}&run_id={quote(run_id)}&refresh=1"
        )
        first = open_in_airflow(page)
        assert first["problem"] is None, first["problem"]
        seen_running = False

        def run_shown_succeeded() -> bool:
            nonlocal seen_running
            state = driver.execute_script(PAGE_STATE)
            assert state["problem"] is None, state["problem"]
            if not seen_running and (
                state["running"] or any(r["status"] == "RUNNING" for r in state["log"])
            ):
                seen_running = True
                screenshot("execution_status_running.png")
            if api.call("GET", path_of_run)[1].get("state") == "failed":
                _, tis = api.call("GET", f"{path_of_run}/taskInstances")
                pytest.fail(
                    f"run {run_id} failed: "
                    f"{[(t['task_id'], t['state']) for t in tis['task_instances']]}\n"
                    f"{processes.tail('serve')}"
                )
            return len(state["log"]) == len(names) and all(
                r["status"] == "SUCCEEDED" for r in state["log"]
            )

        wait_for(
            run_shown_succeeded,
            RUN_DEADLINE,
            "the page shows every task of the run succeeded",
            check=processes.check_alive,
        )
        done = dict(driver.execute_script(PAGE_STATE))
        screenshot("execution_status_page.png")
        assert sum(r["status"] == "SUCCEEDED" for r in first["log"]) < len(names), first
        assert seen_running, "no refresh of the page showed a task running"
        assert sorted(r["task"] for r in done["log"]) == sorted(names)
        assert done["bars"] == len(names)  # the timeline draws every row

        finished = api.wait_run(DAG_ID, run_id, 60, check=processes.check_alive)
        assert finished["state"] == "success", finished

        # And the run's own tab in Airflow's UI shows the same rows.
        tab = open_in_airflow(
            f"{api.base}/dags/{DAG_ID}/runs/{quote(run_id)}/plugin/execution-status-run"
        )
        screenshot("execution_status_run_tab.png")
        assert sorted(r["task"] for r in tab["log"]) == sorted(names)
        assert {r["status"] for r in tab["log"]} == {"SUCCEEDED"}
        assert tab["bars"] == len(names) and tab["running"] == 0
    finally:
        driver.quit()
    for name in ("execution_status_page.png", "execution_status_run_tab.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name

    # And without a login, the same URLs get 401.
    for path in (
        f"/scheduler-lib/dags/{DAG_ID}/runs/{quote(run_id)}",
        f"/scheduler-lib/api/dags/{DAG_ID}/runs/{quote(run_id)}/snapshot",
        f"/scheduler-lib/?dag_id={DAG_ID}&run_id={quote(run_id)}",
        f"/scheduler-lib/api/snapshot?dag_id={DAG_ID}",
    ):
        status, body = api.call("GET", path, auth=False)
        assert status == 401, (path, status, body)
