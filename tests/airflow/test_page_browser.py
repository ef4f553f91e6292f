"""The Execution Status page for triage, in headless Chromium inside Airflow's UI (issue 26
§3): the error readable in place, the filters, the links, the timeline's failures and the
actions, which obey Airflow's permissions.

Given ``airflow standalone`` (the fixtures of ``test_standalone.py``, plus a user ``vera``
with Airflow's *viewer* role), ``scheduler-lib serve`` on a SQLite broker, a run of the
blog's DAG, and tasks this test sends to the same broker — one that fails at once with a
long error, inside that DAG run; one that sleeps and one that fails, outside Airflow —
the page is driven as an administrator and as the viewer, and what it shows is read from
the DOM.
"""

from __future__ import annotations

import json
import secrets
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
    wait_for,
)
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Target, Task, TaskScheduler, init, monitor
from tests.airflow.test_standalone import CHROME_FLAGS, DAG_ID, chromium  # noqa: F401 (a fixture)

STARTUP = 180.0  # seconds for standalone to come up healthy
RUN_DEADLINE = 150.0  # seconds for the blog's DAG run to finish
WAIT = 30.0  # seconds for the page to show what it was asked
WIDTH = 1400  # pixels: the window the issue found the error off-screen in
PARKED = "ParkedTarget"  # a target service nobody serves
TEARDOWN = "release_scheduler"  # the blog DAG's last task
VERA = secrets.token_hex(8)  # the viewer's password, after "vera-"

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(480)]


@pytest.fixture
def triage(tmp_path: Path) -> Iterator[tuple[Api, Processes, Broker]]:
    """``airflow standalone`` with an admin and a viewer, ``scheduler-lib serve``, and
    this process's broker on the same SQLite file."""
    broker_url = f"sqlite:///{tmp_path / 'broker.db'}"
    with Processes(tmp_path / "logs") as processes:
        airflow = Standalone(
            processes,
            tmp_path,
            dags_folder=Path(__file__).resolve().parents[2] / "dags",
            plugins_folder=Path(__file__).resolve().parents[2] / "plugins",
            env={
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT": json.dumps(
                    {"conn_type": "scheduler_lib", "host": broker_url}
                ),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,vera:viewer",
            },
        )
        passwords = airflow.home / "passwords.json"
        passwords.write_text(json.dumps({"admin": airflow.password, "vera": "vera-" + VERA}))
        subprocess.run(
            [str(BIN / "scheduler-lib"), "init", "--db", broker_url],
            env=airflow.env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        # A target nobody serves: what is sent to it stays queued.
        with Broker(broker_url) as setup:
            init(
                setup, targets=[Target(), Target(service=PARKED, queue="Parked", activation=False)]
            )
        processes.start(
            "serve", [str(BIN / "scheduler-lib"), "serve", "--db", broker_url], airflow.env
        )
        try:
            api = airflow.start(STARTUP)
        except HarnessError as exc:
            pytest.fail(str(exc))
        broker = Broker(broker_url)
        try:
            yield api, processes, broker
        finally:
            broker.close()


# The log's rows as the page shows them, read in one go (the page redraws its tables on
# every refresh: elements held across a refresh would go stale).
ROWS = """
return [...document.querySelectorAll("#log tbody tr[data-log-id]")].map((r) => ({
  log_id: Number(r.dataset.logId), status: r.dataset.status,
  task: r.querySelector("td.task-name .name").textContent,
  actions: [...r.querySelectorAll("button.action")].map((b) => b.dataset.action),
  stopping: !!r.querySelector("button.action.cancel:disabled"),
  ti_log: r.querySelector("a.ti-log") && r.querySelector("a.ti-log").href,
  spark: r.querySelector("a.spark-ui") && [r.querySelector("a.spark-ui").href,
                                          r.querySelector("a.spark-ui").textContent],
}));
"""

RESULT = """const e = document.getElementById("action-result");
return e.hidden ? "" : e.textContent;"""

# One row's error cell: what shows, and where (the frame's width is the screen's edge).
ERROR_CELL = """
const row = document.querySelector(`#log tbody tr[data-log-id="${arguments[0]}"]`);
if (!row) return null;
const details = row.querySelector("td.error details");
const summary = details.querySelector("summary"), pre = details.querySelector("pre");
const box = (e) => { const b = e.getBoundingClientRect();
                     return {left: b.left, right: b.right, width: b.width, height: b.height}; };
return {open: details.open, summary: summary.textContent, summary_box: box(summary),
        pre: pre.textContent, pre_box: box(pre), viewport: document.documentElement.clientWidth,
        // text wider than its box would be cut off or scrolled out of sight
        pre_hidden: pre.scrollWidth - pre.clientWidth};
"""


def test_the_page_serves_triage_in_a_browser(
    triage: tuple[Api, Processes, Broker],
    chromium: tuple[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    api, processes, broker = triage
    api.wait_dag(DAG_ID, check=processes.check_alive)
    api.unpause(DAG_ID)
    run_id = api.trigger(DAG_ID)["dag_run_id"]

    # Given a task of that DAG run that fails at once with a long error (sent, as far as
    # the page knows, by its teardown task: clearing it again is harmless), and outside
    # Airflow a task that sleeps and one that fails
    in_run = TaskScheduler(
        broker, context={"dag_id": DAG_ID, "run_id": run_id, "task_id": TEARDOWN}
    )
    failing = in_run.exec_async(
        in_run.get_scheduler(), Task.python("builtins:int", "not a number " * 60, name="bad int")
    )
    plain = TaskScheduler(broker)
    handle = plain.get_scheduler()
    sleeper = plain.exec_async(handle, Task.python("time:sleep", 300, name="sleeper"))
    doomed = plain.exec_async(handle, Task.python("json:loads", "{", name="doomed"))
    parked = TaskScheduler(broker, target=PARKED)
    parked_handle = parked.get_scheduler()
    queued = [
        parked.exec_async(parked_handle, Task.sql("SELECT 1", name=f"parked {i}")) for i in range(3)
    ]

    def row(log_id: int) -> dict[str, Any]:
        found = monitor.task(broker, log_id)
        assert found is not None
        return found

    wait_for(
        lambda: (
            row(failing)["status"] == "FAILED"
            and row(doomed)["status"] == "FAILED"
            and row(sleeper)["status"] == "RUNNING"
        ),
        WAIT * 2,
        "the tasks failed and the sleeper runs",
        check=processes.check_alive,
    )
    error = row(failing)["error"]
    assert error.startswith("ValueError: invalid literal") and "\n" in error

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium[0]
    for flag in (*CHROME_FLAGS, f"--window-size={WIDTH},1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(chromium[1]))

    def until(condition: Any, what: str, timeout: float = WAIT) -> Any:
        return WebDriverWait(driver, timeout).until(lambda d: condition(), message=what)

    def login(token: str) -> None:
        driver.switch_to.default_content()
        driver.get(f"{api.base}/api/v2/version")
        driver.delete_all_cookies()
        driver.add_cookie({"name": "_token", "value": token, "path": "/"})

    def open_in_airflow(url: str) -> None:
        driver.switch_to.default_content()
        driver.get(url)
        frame = until(lambda: driver.find_elements(By.CSS_SELECTOR, "iframe"), "the frame")[0]
        driver.switch_to.frame(frame)
        until(lambda: driver.execute_script(ROWS), "the page drew its rows")
        # Actions ask for a confirmation: say yes.
        driver.execute_script("window.confirm = () => true;")

    def click(selector: str) -> None:
        """Click an element of the page where it is now (a selenium element found first
        could be redrawn by a refresh before the click)."""
        assert driver.execute_script(
            "const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e;",
            selector,
        ), selector

    def result_text() -> str:
        return str(driver.execute_script(RESULT))

    def rows() -> dict[int, dict[str, Any]]:
        return {r["log_id"]: r for r in driver.execute_script(ROWS)}

    try:
        login(str(api.token))
        # --- the error, in the run's own tab of Airflow's UI at 1400 px ---------------
        open_in_airflow(
            f"{api.base}/dags/{DAG_ID}/runs/{quote(run_id)}/plugin/execution-status-run"
        )
        cell = until(lambda: driver.execute_script(ERROR_CELL, failing), "the failed row")
        # Then its first line shows in the table, inside the screen
        assert cell["summary"] == error.splitlines()[0] and not cell["open"]
        assert cell["summary_box"]["width"] > 200 and cell["summary_box"]["height"] > 0, cell
        assert cell["summary_box"]["right"] <= cell["viewport"], cell
        # When it is clicked, the whole text opens in place, wrapped inside the screen
        click(f'#log tr[data-log-id="{failing}"] td.error summary')
        cell = driver.execute_script(ERROR_CELL, failing)
        assert cell["open"] and cell["pre"] == error
        assert cell["pre_box"]["height"] > 40 and cell["pre_box"]["right"] <= cell["viewport"]
        assert cell["pre_hidden"] <= 1, cell
        # and it stays open across refreshes (the page redraws every few seconds)
        before = driver.find_element(By.ID, "updated").get_attribute("data-age")
        until(
            lambda: driver.find_element(By.ID, "updated").get_attribute("data-age") != before,
            "the data's age moves on",
        )
        assert driver.execute_script(ERROR_CELL, failing)["open"]
        # The timeline shows the 10 ms failure: a bar of a few pixels and a mark
        bar = driver.find_element(By.CSS_SELECTOR, f'#timeline rect.bar[data-log-id="{failing}"]')
        assert float(bar.get_attribute("width")) >= 4
        marks = driver.find_elements(
            By.CSS_SELECTOR, f'#timeline text.fail-mark[data-log-id="{failing}"]'
        )
        assert len(marks) == 1 and marks[0].is_displayed()
        assert "s old" in driver.find_element(By.ID, "updated").text
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "triage_run_tab.png"))

        # --- filters, on the top-level page ----------------------------------------------
        open_in_airflow(f"{api.base}/plugin/execution-status/scheduler-lib/?refresh=1")
        form = driver.find_element(By.ID, "filters")
        form.find_element(By.NAME, "failed").click()
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until(lambda: set(rows()) == {failing, doomed}, "only the failed rows")
        form.find_element(By.NAME, "kind").send_keys("sql")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until(lambda: not rows(), "no failed sql task")
        driver.find_element(By.ID, "clear").click()
        until(lambda: {failing, doomed, sleeper, *queued} <= set(rows()), "every row")
        form.find_element(By.NAME, "target").send_keys(PARKED)
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until(lambda: set(rows()) == set(queued), "the parked target's rows only")
        # A time range: from a day ahead (the form's own inputs, set as a user's typing
        # would), nothing; the last hour, the rows again
        driver.execute_script(
            """const form = document.getElementById("filters");
            form.elements.range.value = "custom";
            form.elements.range.dispatchEvent(new Event("change"));
            const ahead = new Date(Date.now() + 86400e3 - new Date().getTimezoneOffset() * 60e3);
            form.elements.from.value = ahead.toISOString().slice(0, 19);"""
        )
        assert form.find_element(By.NAME, "from").is_displayed()
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until(lambda: not rows(), "nothing sent from tomorrow on")
        driver.execute_script('document.getElementById("filters").elements.range.value = "3600";')
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until(lambda: set(rows()) == set(queued), "the last hour's rows")
        driver.find_element(By.ID, "clear").click()
        until(lambda: {failing, doomed, sleeper, *queued} <= set(rows()), "every row again")

        # --- the timeline: queued rows (all waiting until now) each in a lane of its own --
        lanes = driver.execute_script(
            """return arguments[0].map((id) => document.querySelector(
                 `#timeline rect.bar[data-log-id="${id}"]`).getAttribute("y"));""",
            queued,
        )
        assert len(set(lanes)) == len(queued), lanes

        # --- actions, as an administrator ------------------------------------------------
        assert rows()[queued[0]]["actions"] == ["cancel"]
        click(f'tr[data-log-id="{queued[0]}"] button.cancel')
        until(lambda: rows()[queued[0]]["status"] == "CANCELLED", "the queued task cancelled")
        until(lambda: "will not run" in result_text(), "the cancel's answer")
        assert [rows()[i]["status"] for i in queued[1:]] == ["QUEUED", "QUEUED"]
        shown = rows()
        assert shown[sleeper]["actions"] == ["cancel"] and shown[doomed]["actions"] == ["retry"]
        click(f'tr[data-log-id="{sleeper}"] button.cancel')
        # (a python task cannot be interrupted: its worker is asked to stop it, and the
        # page says so until it ends)
        until(lambda: rows()[sleeper]["stopping"], "the sleeper shown stopping")
        until(lambda: "asked to stop" in result_text(), "the cancel's answer")
        assert row(sleeper)["cancel_requested_at"] is not None
        click(f'tr[data-log-id="{doomed}"] button.retry')
        until(
            lambda: [i for i, r in rows().items() if r["task"] == "doomed" and i != doomed],
            "the retried task's new row",
        )
        until(lambda: "sent again" in result_text(), "the retry's answer")
        audit = api.call("GET", "/api/v2/eventLogs?event_pattern=scheduler_lib")[1]
        assert {(e["event"], e["owner"]) for e in audit["event_logs"]} >= {
            ("scheduler_lib_cancel_task", "admin"),
            ("scheduler_lib_retry_task", "admin"),
        }

        # --- links: the Airflow task instance, and Spark's UI ----------------------------
        broker.run(
            "log_spark",
            log_id=sleeper,
            application_id="app-20261128-0001",
            job_group="scheduler-lib-7",
            ui_url="http://127.0.0.1:4040",
        )
        until(lambda: rows()[sleeper]["spark"], "the Spark link")
        assert rows()[sleeper]["spark"] == ["http://127.0.0.1:4040/jobs/", "Spark scheduler-lib-7"]
        finished = api.wait_run(DAG_ID, run_id, RUN_DEADLINE, check=processes.check_alive)
        assert finished["state"] == "success", finished
        blog = until(
            lambda: [r for r in rows().values() if r["ti_log"] and r["log_id"] != failing],
            "a row of the blog's run",
        )[0]
        task_id = row(blog["log_id"])["task_id"]
        expected = f"{api.base}/dags/{DAG_ID}/runs/{quote(run_id)}/tasks/{task_id}"
        assert blog["ti_log"] == expected
        click(f'tr[data-log-id="{blog["log_id"]}"] a.ti-log')
        driver.switch_to.default_content()
        until(lambda: driver.current_url == expected, "Airflow's task instance page")
        until(
            lambda: task_id in driver.find_element(By.TAG_NAME, "body").text,
            "the task instance page names its task",
        )
        status, ti = api.call(
            "GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}"
        )
        assert status == 200 and ti["state"] == "success", ti

        # --- retry of a row an Airflow task sent: its ended task instance is cleared ------
        teardown = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{TEARDOWN}"
        tries = api.call("GET", teardown)[1]["try_number"]
        open_in_airflow(f"{api.base}/plugin/execution-status/scheduler-lib/?refresh=1")
        assert rows()[failing]["actions"] == ["retry"]
        click(f'tr[data-log-id="{failing}"] button.retry')
        until(lambda: "was cleared" in result_text(), "the retry's answer")
        wait_for(
            lambda: (
                api.call("GET", teardown)[1]["try_number"] > tries
                and api.call("GET", teardown)[1]["state"] == "success"
            ),
            RUN_DEADLINE,
            "Airflow ran the cleared task instance again",
            check=processes.check_alive,
        )

        # --- the viewer: rows, no actions, and a refused POST -------------------------------
        viewer = Api(api.base)
        viewer.login("vera", "vera-" + VERA)
        login(str(viewer.token))
        open_in_airflow(f"{api.base}/plugin/execution-status/scheduler-lib/?refresh=1")
        shown = rows()
        assert failing in shown and not any(r["actions"] for r in shown.values()), shown
        refused = driver.execute_async_script(
            """const done = arguments[arguments.length - 1];
            const settings = JSON.parse(document.getElementById("settings").textContent);
            fetch(`${settings.actions}/${arguments[0]}/retry`,
                  {method: "POST", headers: {"X-Scheduler-Lib-Action": "1"}})
              .then(async (r) => done([r.status, await r.text()]));""",
            failing,
        )
        assert refused[0] == 403 and "edit access to DAG" in refused[1], refused
    finally:
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "triage_last.png"))
        driver.quit()
