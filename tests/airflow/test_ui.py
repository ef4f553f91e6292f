"""The Execution Status page: its data (:mod:`scheduler_lib.scheduler.monitor`) on SQLite
and PostgreSQL, and its routes mounted by Airflow's own api-server app, in process.

The api-server is Airflow's real ``create_app`` on the suite's temporary, migrated
``AIRFLOW_HOME`` (``conftest.py``), with the plugin loaded from ``plugins/`` and Airflow's
own auth manager (the simple one) signing the JWTs the tests present. What it proves:

- every route of the plugin answers 401 to an anonymous request, and uses Airflow's
  authorization (a user without a role sees no DAG's rows and may not open a run's tab;
  a DAG the auth manager refuses is left out of the top-level page);
- the page and its JSON show the broker's rows, filtered by scheduler handle, DAG and
  run, with the connection read from an environment variable or from the metastore;
- each filtered log query reads an index (no full scan), checked on the query plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from multiproc import poll  # tests/integration, on the path by this folder's conftest

from scheduler_lib.broker import Broker, activation
from scheduler_lib.broker.db import queries as broker_queries
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import Target, Task, TaskScheduler, init, monitor

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
WAIT = 30.0  # seconds: deadline for conditions that hold within a second or two
PREFIX = "/scheduler-lib"
RUN_1 = "manual__2026-11-24T10:00:00+00:00"  # run ids carry ':' and '+': URLs must quote them
RUN_2 = "scheduled__2026-11-24T11:00:00+00:00"


# --- rows to show -----------------------------------------------------------------------


class Sent:
    """What :func:`send_rows` wrote: the handles and log ids of each sender."""

    def __init__(self) -> None:
        self.handles: dict[str, str] = {}
        self.log_ids: dict[str, list[int]] = {}

    def everything(self) -> list[int]:
        """Every log id sent, newest first."""
        return sorted((i for ids in self.log_ids.values() for i in ids), reverse=True)


def send_rows(broker: Broker) -> Sent:
    """Given four schedulers — DAG ``etl`` runs 1 and 2, DAG ``other`` run 1, and one
    outside Airflow — each sends three tasks (nobody serves the queue: they stay
    QUEUED)."""
    init(broker, targets=[Target(activation=False)])
    senders = {
        "etl-1": {"dag_id": "etl", "run_id": RUN_1, "task_id": "exec_async_1"},
        "etl-2": {"dag_id": "etl", "run_id": RUN_2, "task_id": "exec_async_1"},
        "other-1": {"dag_id": "other", "run_id": RUN_1, "task_id": "load"},
        "plain": None,
    }
    sent = Sent()
    for name, context in senders.items():
        scheduler = TaskScheduler(broker, context=context)
        handle = scheduler.get_scheduler()
        sent.handles[name] = str(handle.conversation_handle)
        sent.log_ids[name] = [
            scheduler.exec_async(handle, Task.sql("SELECT 1", name=f"{name} task {i}"), wave=1)
            for i in range(1, 4)
        ]
    return sent


def ids(rows: list[dict[str, Any]]) -> list[int]:
    return [r["log_id"] for r in rows]


# --- the data: scheduler_lib.scheduler.monitor (SQLite and PostgreSQL) ------------------


def test_execution_log_filters_by_handle_dag_and_run(broker: Broker) -> None:
    sent = send_rows(broker)
    newest_first = sent.everything()

    def log(**filters: str) -> list[int]:
        return ids(monitor.execution_log(broker, monitor.Filters.of(**filters)))

    assert log() == newest_first
    assert log(scheduler_handle=sent.handles["etl-2"]) == sent.log_ids["etl-2"][::-1]
    assert log(dag_id="etl") == (sent.log_ids["etl-1"] + sent.log_ids["etl-2"])[::-1]
    assert log(dag_id="etl", run_id=RUN_1) == sent.log_ids["etl-1"][::-1]
    assert log(dag_id="other", run_id=RUN_1) == sent.log_ids["other-1"][::-1]
    assert log(scheduler_handle=sent.handles["etl-1"], dag_id="etl") == sent.log_ids["etl-1"][::-1]
    # A handle and a run that do not belong together: nothing.
    assert log(scheduler_handle=sent.handles["etl-1"], dag_id="etl", run_id=RUN_2) == []
    assert log(dag_id="nope") == []
    # Blanks (an empty filter box) mean "any".
    assert log(scheduler_handle=" ", dag_id="", run_id="") == newest_first
    assert ids(monitor.execution_log(broker, limit=2)) == newest_first[:2]

    row = monitor.execution_log(broker, monitor.Filters(dag_id="other"), limit=1)[0]
    assert row["status"] == "QUEUED" and row["task_name"] == "other-1 task 3"
    assert (row["dag_id"], row["run_id"], row["task_id"], row["wave"]) == (
        "other",
        RUN_1,
        "load",
        1,
    )
    assert isinstance(row["start_time"], float) and row["end_time"] is None
    assert "task_body" not in row and "result" not in row  # large: not for a screen


def test_bad_filters_are_refused_with_a_reason(broker: Broker) -> None:
    with pytest.raises(InvalidArgument, match="run_id 'r' needs dag_id"):
        monitor.Filters.of(run_id="r")
    for limit in (0, monitor.MAX_LIMIT + 1, True):
        with pytest.raises(InvalidArgument, match="limit must be"):
            monitor.execution_log(broker, limit=limit)


def test_execution_log_filters_failed_target_kind_and_time(broker: Broker) -> None:
    # Given two targets, each sent an sql and a python task, and one task of each failed
    init(
        broker,
        targets=[
            Target(activation=False),
            Target(service="Reports", queue="ReportsQueue", activation=False),
        ],
    )
    sent: dict[tuple[str, str], int] = {}
    for target in ("ServiceAsyncTarget", "Reports"):
        scheduler = TaskScheduler(broker, target=target)
        handle = scheduler.get_scheduler()
        sent[target, "sql"] = scheduler.exec_async(handle, Task.sql("SELECT 1", name="q"))
        sent[target, "python"] = scheduler.exec_async(handle, Task.python("time:sleep", 0))
    for log_id in (sent["ServiceAsyncTarget", "python"], sent["Reports", "sql"]):
        broker.run("log_fail", log_id=log_id, error="boom\nline 2", now=time.time())

    def log(**filters: Any) -> list[int]:
        return ids(monitor.execution_log(broker, monitor.Filters.of(**filters)))

    # When the page filters, then each filter narrows the rows (and combines with others)
    failed = [sent["Reports", "sql"], sent["ServiceAsyncTarget", "python"]]
    assert log(failed=True) == failed
    assert log(target="Reports") == [sent["Reports", "python"], sent["Reports", "sql"]]
    assert log(kind="sql") == [sent["Reports", "sql"], sent["ServiceAsyncTarget", "sql"]]
    assert log(failed=True, kind="sql") == [sent["Reports", "sql"]]
    assert log(failed=True, target="ServiceAsyncTarget") == [sent["ServiceAsyncTarget", "python"]]
    handle = monitor.task(broker, sent["Reports", "sql"])
    assert handle is not None and handle["error"] == "boom\nline 2"
    assert log(failed=True, scheduler_handle=handle["scheduler_handle"]) == [sent["Reports", "sql"]]
    # A time range of sent_at: [since, until)
    times = {i: monitor.task(broker, i)["sent_at"] for i in sent.values()}  # type: ignore[index]
    newest = max(sent.values())
    assert log(since=times[newest]) == [i for i in ids_desc(sent) if times[i] >= times[newest]]
    assert newest not in log(until=times[newest])
    assert log(since=0, until=times[newest] + 1) == ids_desc(sent)
    for bad, says in (
        ({"since": "yesterday"}, "since must be a time in seconds"),
        ({"until": "-1"}, "until must be a time in seconds"),
        ({"since": 5, "until": 5}, "the time range is empty"),
    ):
        with pytest.raises(InvalidArgument, match=says):
            monitor.Filters.of(**bad)


def ids_desc(sent: dict[Any, int]) -> list[int]:
    return sorted(sent.values(), reverse=True)


def test_snapshot_limit_counts_the_rows_the_user_may_see(broker: Broker) -> None:
    sent = send_rows(broker)
    # Given a user who may not see DAG "other" (whose rows are among the newest)
    visible = lambda row: row["dag_id"] != "other"  # noqa: E731
    # When they ask for 6 rows, then they get 6 they may see: the log is read on
    data = monitor.snapshot(broker, limit=6, visible=visible)
    assert ids(data["log"]) == (sent.log_ids["etl-2"] + sent.log_ids["plain"])[::-1]
    assert data["complete"] is True
    # And when too few are visible within the reads a refresh may make, it says so
    nothing = monitor.snapshot(broker, limit=1, visible=lambda row: False)
    assert nothing["log"] == [] and nothing["complete"] is False
    everything = monitor.snapshot(broker, limit=100, visible=lambda row: False)
    assert everything["log"] == [] and everything["complete"] is True


def test_cancel_task_cancels_one_queued_task_only(broker: Broker) -> None:
    sent = send_rows(broker)
    scheduler = TaskScheduler(broker)
    first, second, _ = sent.log_ids["plain"]
    # When one queued task is cancelled, then it alone is, once
    assert scheduler.cancel_task(first, "not needed") == "cancelled"
    rows = {r["log_id"]: r for r in scheduler.log(sent.handles["plain"])}
    assert (rows[first]["status"], rows[first]["error"]) == ("CANCELLED", "not needed")
    assert rows[second]["status"] == "QUEUED"
    assert scheduler.cancel_task(first) == "CANCELLED"  # ended already: nothing done
    with pytest.raises(InvalidArgument, match="no such row"):
        scheduler.cancel_task(10**9)


def test_execution_status_shows_the_running_task_of_a_run(broker: Broker) -> None:
    init(broker, targets=[Target(max_readers=1)])
    context = {"dag_id": "etl", "run_id": RUN_1, "task_id": "exec_async_1"}
    scheduler = TaskScheduler(broker, context=context)
    with (
        activation.running(broker, empty_grace=0.1, check_interval=0.2),
        scheduler.scheduler() as handle,
    ):
        log_id = scheduler.exec_async(handle, Task.python("time:sleep", 2.0, name="long"))
        # Given the task runs, when the page asks for its run, then it is there.
        this_run = monitor.Filters(dag_id="etl", run_id=RUN_1)
        (row,) = poll(
            lambda: [r for r in monitor.execution_status(broker, this_run) if r["log_id"]],
            WAIT,
            "the running task shows for its run",
        )
        assert (row["log_id"], row["status"], row["task_name"]) == (log_id, "RUNNING", "long")
        assert row["reader_task_id"] and row["queue_name"] == "QueueAsyncTarget"
        assert monitor.execution_status(broker, monitor.Filters(dag_id="other")) == []
        assert log_id in ids(monitor.execution_status(broker))
        snapshot = monitor.snapshot(broker, this_run)
        assert ids(snapshot["running"]) == [log_id] and ids(snapshot["log"]) == [log_id]
        assert abs(snapshot["now"] - time.time()) < 5
        assert scheduler.synchronization(handle, timeout=WAIT).ok


# Each filter shape, with the indexes that can serve it (the planner picks one).
BY_HANDLE = ("ix_execution_log_scheduler",)
BY_RUN = ("ix_execution_log_airflow",)
BY_FAILED = ("ix_execution_log_failed",)
NARROWED = {"target": "t", "kind": "sql", "since": 1.0, "until": 2e9}
INDEXED_QUERIES = {
    "monitor_log_of_scheduler": ({"handle": "h"}, BY_HANDLE),
    "monitor_log_of_scheduler_in_dag": ({"handle": "h", "dag_id": "d"}, BY_HANDLE + BY_RUN),
    "monitor_log_of_scheduler_in_run": (
        {"handle": "h", "dag_id": "d", "run_id": "r"},
        BY_HANDLE + BY_RUN,
    ),
    "monitor_log_of_dag": ({"dag_id": "d"}, BY_RUN),
    "monitor_log_of_run": ({"dag_id": "d", "run_id": "r"}, BY_RUN),
    "monitor_log_failed": ({"handle": None, "dag_id": None, "run_id": None}, BY_FAILED),
    "monitor_log_failed in a run": (
        {"handle": None, "dag_id": "d", "run_id": "r"},
        BY_FAILED + BY_RUN,
    ),
    "monitor_log_of_run narrowed": ({"dag_id": "d", "run_id": "r", **NARROWED}, BY_RUN),
}


@pytest.mark.parametrize("query", sorted(INDEXED_QUERIES))
def test_filtered_log_queries_read_an_index(broker: Broker, query: str) -> None:
    send_rows(broker)
    params, indexes = INDEXED_QUERIES[query]
    params = {"before": 2**63 - 1, **dict.fromkeys(NARROWED), **params, "limit": 9}
    sql = broker_queries.for_dialect(broker.dialect, "scheduler_lib.scheduler")[query.split()[0]]
    engine = sa.create_engine(broker.url)
    try:
        with engine.connect() as conn:
            if broker.dialect == "postgresql":
                # A few rows make a sequential scan the cheapest plan; forbid it to see
                # whether an index can serve the query at all (a plan without one still
                # shows "Seq Scan", with a prohibitive cost).
                conn.exec_driver_sql("SET enable_seqscan = off")
                plan = "\n".join(r[0] for r in conn.execute(sa.text(f"EXPLAIN {sql.text}"), params))
                assert "Seq Scan" not in plan, plan
            else:
                plan = "\n".join(
                    r[-1] for r in conn.execute(sa.text(f"EXPLAIN QUERY PLAN {sql.text}"), params)
                )
                assert "SCAN execution_log" not in plan, plan
    finally:
        engine.dispose()
    assert any(index in plan for index in indexes), plan


# --- Airflow's api-server, in process ---------------------------------------------------


@pytest.fixture(scope="session")
def api_server(airflow_home: Path) -> Iterator[Any]:
    """Airflow's api-server app (core API and UI plugins) on the suite's Airflow home
    (``conftest.py``), with our plugin loaded from ``plugins/``, behind a test client."""
    # Long enough for SHA512 (PyJWT warns below 64 bytes); read when tokens are signed.
    os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", secrets.token_hex(48))
    from airflow import plugins_manager, settings
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    # Plugins are found once per process: make sure it is our folder they come from.
    settings.PLUGINS_FOLDER = str(PLUGINS)
    for value in vars(plugins_manager).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    with TestClient(create_app("core")) as client:
        yield client


def token_for(role: str | None, name: str = "tester") -> str:
    """A JWT that Airflow's auth manager signed, for a user of the simple auth manager
    (``role=None``: logged in, but allowed nothing)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=name, role=role))


@pytest.fixture
def admin(api_server: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for('admin')}"}


@pytest.fixture
def ui_broker(scheduler_lib_conn: str, api_server: Any) -> Iterator[tuple[Broker, Sent]]:
    """The rows of :func:`send_rows` in a fresh broker (both backends), which the page's
    connection (``scheduler_lib_default``, an environment variable) points at."""
    broker = Broker(scheduler_lib_conn)
    try:
        yield broker, send_rows(broker)
    finally:
        broker.close()


def plugin_paths(api_server: Any) -> list[tuple[str, str]]:
    """The method and a concrete URL of every route of the plugin's app, as the
    api-server mounts it."""
    from fastapi import FastAPI
    from fastapi.routing import APIRoute
    from starlette.routing import Mount

    (mount,) = [r for r in api_server.app.routes if isinstance(r, Mount) and r.path == PREFIX]
    assert isinstance(mount.app, FastAPI)
    paths = []
    for route in mount.app.routes:
        assert isinstance(route, APIRoute), route
        path = route.path.replace("{run_id:path}", "{run_id}")
        path = path.format(
            dag_id="etl", run_id=urllib.parse.quote(RUN_1, safe=""), name="page.js", log_id=10**9
        )
        (method,) = route.methods
        paths.append((method, PREFIX + path))
    return paths


def test_every_route_of_the_plugin_refuses_an_anonymous_request(
    api_server: Any, admin: dict[str, str], ui_broker: tuple[Broker, Sent]
) -> None:
    from fastapi.testclient import TestClient

    from scheduler_lib.airflow import ui

    browser = TestClient(api_server.app, cookies={"_token": token_for("admin")})
    paths = plugin_paths(api_server)
    # page, run page, two snapshots, static, cancel, retry
    assert len(paths) == 7, paths
    for method, path in paths:
        anonymous = api_server.request(method, path)
        assert anonymous.status_code == 401, (path, anonymous.text)
        assert anonymous.json() == {"detail": "Not authenticated"}
        # Not any token: one Airflow did not sign is refused as well.
        forged = api_server.request(method, path, headers={"Authorization": "Bearer not.a.jwt"})
        assert forged.status_code in (401, 403), (path, forged.status_code)
        # The same route with a login answers (the actions: no such row).
        answers = 404 if method == "POST" else 200
        assert api_server.request(method, path, headers=admin).status_code == answers, path
        # Airflow's UI holds the JWT in a cookie, which the page's requests carry.
        # (the page's actions carry its header: a cookie alone is refused, see below)
        page = {ui.ACTION_HEADER: "1"} if method == "POST" else {}
        assert browser.request(method, path, headers=page).status_code == answers, path


def test_snapshot_shows_the_rows_filtered(
    api_server: Any, admin: dict[str, str], ui_broker: tuple[Broker, Sent]
) -> None:
    _, sent = ui_broker

    def log(**params: Any) -> list[int]:
        response = api_server.get(f"{PREFIX}/api/snapshot", params=params, headers=admin)
        assert response.status_code == 200, response.text
        return ids(response.json()["log"])

    everything = sent.everything()
    assert log() == everything
    assert log(scheduler_handle=sent.handles["plain"]) == sent.log_ids["plain"][::-1]
    assert log(dag_id="etl", run_id=RUN_2) == sent.log_ids["etl-2"][::-1]
    assert log(dag_id="other") == sent.log_ids["other-1"][::-1]
    assert log(limit=4) == everything[:4]

    refused = api_server.get(f"{PREFIX}/api/snapshot", params={"run_id": RUN_1}, headers=admin)
    assert refused.status_code == 400 and "needs dag_id" in refused.json()["detail"]
    too_many = api_server.get(f"{PREFIX}/api/snapshot", params={"limit": 10**6}, headers=admin)
    assert too_many.status_code == 422
    # The triage filters, and bad ones named in one line
    assert log(failed="true") == []
    assert log(target="ServiceAsyncTarget", kind="sql", since="0") == everything
    assert log(since=str(time.time() + 3600)) == []
    for params, says in (
        ({"since": "yesterday"}, "since must be a time in seconds since the epoch"),
        ({"since": "10", "until": "5"}, "the time range is empty"),
    ):
        bad = api_server.get(f"{PREFIX}/api/snapshot", params=params, headers=admin)
        assert bad.status_code == 400 and says in bad.json()["detail"], bad.text
        assert "\n" not in bad.json()["detail"]


def test_run_tab_shows_only_its_run(
    api_server: Any, admin: dict[str, str], ui_broker: tuple[Broker, Sent]
) -> None:
    _, sent = ui_broker
    run = urllib.parse.quote(RUN_1, safe="")
    data = api_server.get(f"{PREFIX}/api/dags/etl/runs/{run}/snapshot", headers=admin).json()
    assert ids(data["log"]) == sent.log_ids["etl-1"][::-1]
    assert data["filters"] == {
        **dataclasses.asdict(monitor.Filters()),
        "dag_id": "etl",
        "run_id": RUN_1,
    }

    page = api_server.get(f"{PREFIX}/dags/etl/runs/{run}", headers=admin)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # The page polls its run's snapshot through the mount point it was served from.
    assert f'"api": "{PREFIX}/api/dags/etl/runs/{run}/snapshot"' in page.text
    assert '"fixedRun": true' in page.text
    assert f"<title>Execution Status — etl / {RUN_1}</title>" in page.text


def test_page_escapes_what_it_echoes(api_server: Any, admin: dict[str, str]) -> None:
    # In the title (HTML) and in the settings (JSON inside a <script> element).
    tag = '"><img src=x onerror=alert(1)>'
    page = api_server.get(f"{PREFIX}/dags/{urllib.parse.quote(tag, safe='')}/runs/r", headers=admin)
    assert page.status_code == 200
    assert "<img" not in page.text
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in page.text
    closing = "</script><script>alert(1)</script>"
    top = api_server.get(f"{PREFIX}/", params={"dag_id": closing}, headers=admin)
    assert top.status_code == 200
    assert "<script>alert(1)" not in top.text
    assert "\\u003c/script>\\u003cscript>alert(1)" in top.text


def test_a_user_sees_only_the_dags_airflow_lets_them_read(
    api_server: Any,
    admin: dict[str, str],
    ui_broker: tuple[Broker, Sent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow.api_fastapi.app import get_auth_manager

    _, sent = ui_broker
    run = urllib.parse.quote(RUN_1, safe="")
    # Given a logged-in user without a role: Airflow allows them nothing.
    nobody = {"Authorization": f"Bearer {token_for(None, 'nobody')}"}
    assert api_server.get(f"{PREFIX}/", headers=nobody).status_code == 200
    snapshot = api_server.get(f"{PREFIX}/api/snapshot", headers=nobody).json()
    assert snapshot["log"] == []
    for path in (f"/dags/etl/runs/{run}", f"/api/dags/etl/runs/{run}/snapshot"):
        assert api_server.get(PREFIX + path, headers=nobody).status_code == 403, path

    # Given an auth manager that refuses DAG "other" (to everyone): its rows go.
    auth_manager = get_auth_manager()
    allowed = auth_manager.is_authorized_dag
    asked: list[Any] = []

    def refuse_other(**kwargs: Any) -> bool:
        asked.append(kwargs["details"].id)
        return kwargs["details"].id != "other" and allowed(**kwargs)

    monkeypatch.setattr(auth_manager, "is_authorized_dag", refuse_other)
    shown = ids(api_server.get(f"{PREFIX}/api/snapshot", headers=admin).json()["log"])
    assert not set(sent.log_ids["other-1"]) & set(shown)
    assert set(sent.log_ids["etl-1"] + sent.log_ids["plain"]) <= set(shown)
    assert sorted(set(asked)) == ["etl", "other"]  # asked once per DAG, not per row
    assert api_server.get(f"{PREFIX}/dags/other/runs/{run}", headers=admin).status_code == 403


def test_connection_from_the_metastore(
    api_server: Any, admin: dict[str, str], sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session

    from scheduler_lib.airflow import hooks

    broker = Broker(sqlite_url)
    sent = send_rows(broker)
    conn_id = f"scheduler_lib_ui_{secrets.token_hex(4)}"
    with create_session() as session:
        session.add(Connection(conn_id=conn_id, conn_type="scheduler_lib", host=sqlite_url))
    monkeypatch.setenv("AIRFLOW__SCHEDULER_LIB__UI_CONN_ID", conn_id)
    try:
        data = api_server.get(f"{PREFIX}/api/snapshot", headers=admin).json()
        assert sorted(ids(data["log"])) == sorted(sent.everything())
    finally:
        with create_session() as session:
            session.query(Connection).filter(Connection.conn_id == conn_id).delete()
        broker.close()
        hooks.close_brokers()


@pytest.mark.postgres
def test_the_page_needs_only_select_and_fires_no_timers(
    api_server: Any, admin: dict[str, str], postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's monitor role (SELECT on every table) is enough for the page's
    connection: the page only reads, and its broker runs no timer thread (which would
    write, and fail for that role on every poll)."""
    from scheduler_lib.airflow import hooks

    broker = Broker(postgres_url)
    sent = send_rows(broker)
    role = f"scheduler_lib_monitor_{secrets.token_hex(4)}"
    owner = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with owner.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
        conn.exec_driver_sql(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"')
    reader = sa.make_url(postgres_url).set(username=role, password=None)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT",
        json.dumps(
            {"conn_type": "scheduler_lib", "host": reader.render_as_string(hide_password=False)}
        ),
    )

    def timer_threads() -> int:
        return sum(t.name == "broker-timers" for t in threading.enumerate())

    before = timer_threads()
    try:
        # When the page is opened through the SELECT-only role
        response = api_server.get(f"{PREFIX}/api/snapshot", headers=admin)
        # Then it shows every row, and opened its broker without a timer thread
        assert response.status_code == 200, response.text
        assert ids(response.json()["log"]) == sent.everything()
        assert hooks._brokers, "the page opened no broker"
        assert timer_threads() == before
        # (a write through that role is refused: the role really is read-only)
        with sa.create_engine(reader).connect() as conn, pytest.raises(sa.exc.ProgrammingError):
            conn.exec_driver_sql("DELETE FROM execution_log")
    finally:
        hooks.close_brokers()
        broker.close()
        with owner.connect() as conn:
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
            conn.exec_driver_sql(f'DROP ROLE "{role}"')
        owner.dispose()


def test_a_missing_connection_is_named(
    api_server: Any, admin: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__SCHEDULER_LIB__UI_CONN_ID", "no_such_connection")
    response = api_server.get(f"{PREFIX}/api/snapshot", headers=admin)
    assert response.status_code == 503
    assert "'no_such_connection' is not defined" in response.json()["detail"]


@pytest.mark.parametrize(
    ("host", "says"),
    [
        # The port is no number: the URL fails only once parsed further.
        ("postgresql://alice:S3cretPW@host:notaport/db", "'notaport'"),
        # No scheme: not a URL at all, so no URL mask would find the password in it.
        ("alice:S3cretPW@host/db", "is not a SQLAlchemy URL"),
    ],
    ids=["bad port", "no scheme"],
)
def test_a_malformed_connection_url_is_named_without_its_password(
    api_server: Any, admin: dict[str, str], monkeypatch: pytest.MonkeyPatch, host: str, says: str
) -> None:
    # Given the page's connection holds a malformed URL with a password in it
    monkeypatch.setenv(
        "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT",
        json.dumps({"conn_type": "scheduler_lib", "host": host}),
    )
    run = urllib.parse.quote(RUN_1, safe="")
    for path in ("/api/snapshot", f"/api/dags/etl/runs/{run}/snapshot"):
        # When the page asks for its data
        response = api_server.get(PREFIX + path, headers=admin)
        # Then a 503 names the connection and what is wrong with its URL, and the
        # password is nowhere in the answer
        assert response.status_code == 503, (path, response.text)
        detail = response.json()["detail"]
        assert "connection 'scheduler_lib_default'" in detail and says in detail, detail
        assert "***" in detail, detail
        assert "S3cretPW" not in response.text


def test_airflow_lists_the_page_and_the_run_tab(api_server: Any, admin: dict[str, str]) -> None:
    plugins = api_server.get("/api/v2/plugins", headers=admin).json()["plugins"]
    (plugin,) = [p for p in plugins if p["name"] == "scheduler_lib"]
    assert plugin["fastapi_apps"][0]["url_prefix"] == PREFIX
    views = {v["destination"]: v for v in plugin["external_views"]}
    assert views["nav"]["url_route"] == "execution-status"
    assert views["nav"]["href"] == f"{PREFIX}/"
    # The UI puts the run it shows into these placeholders.
    assert views["dag_run"]["href"] == f"{PREFIX}/dags/{{DAG_ID}}/runs/{{RUN_ID}}"
    assert views["dag_run"]["url_route"] == "execution-status-run"
    icon = api_server.get(views["nav"]["icon"], headers=admin)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"


# --- actions: cancel and retry ------------------------------------------------------------


def bearer(role: str | None, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(role, name)}"}


def audit_rows(event: str, owner: str) -> list[Any]:
    """Airflow's audit log rows of an event by a user."""
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(sa.select(Log).where(Log.event == event, Log.owner == owner))
        return [(r.dag_id, r.run_id, r.task_id, json.loads(r.extra)) for r in rows]


def test_cancel_needs_edit_permission_and_is_audited(
    api_server: Any, ui_broker: tuple[Broker, Sent]
) -> None:
    broker, sent = ui_broker
    etl_task, plain_task = sent.log_ids["etl-1"][0], sent.log_ids["plain"][0]
    viewer, user = bearer("viewer", "vera"), bearer("user", "ulla")
    op = bearer("op", f"olga-{secrets.token_hex(3)}")

    def cancel(log_id: int, headers: dict[str, str]) -> Any:
        return api_server.post(f"{PREFIX}/api/tasks/{log_id}/cancel", headers=headers)

    # Given a viewer (reads DAGs, edits nothing): the page shows them no action, and
    # cancel and retry are refused with a reason
    rows = api_server.get(f"{PREFIX}/api/snapshot", headers=viewer).json()["log"]
    assert rows and not any(r["editable"] for r in rows)
    for action in ("cancel", "retry"):
        refused = api_server.post(f"{PREFIX}/api/tasks/{etl_task}/{action}", headers=viewer)
        assert refused.status_code == 403, refused.text
        assert "edit access to DAG 'etl'" in refused.json()["detail"]
    # A user may edit DAGs' task instances, not a row sent outside Airflow
    editable = {
        r["log_id"]: r["editable"]
        for r in api_server.get(f"{PREFIX}/api/snapshot", headers=user).json()["log"]
    }
    assert editable[etl_task] and not editable[plain_task]
    refused = cancel(plain_task, user)
    assert refused.status_code == 403 and "configuration" in refused.json()["detail"]
    assert monitor.task(broker, plain_task)["status"] == "QUEUED"  # type: ignore[index]
    assert monitor.task(broker, etl_task)["status"] == "QUEUED"  # type: ignore[index]

    # When an op (who may edit the configuration too) cancels both
    for log_id in (etl_task, plain_task):
        done = cancel(log_id, op)
        # Then each is cancelled, says so, and Airflow's audit log names who did it
        assert done.status_code == 200, done.text
        assert done.json()["outcome"] == "cancelled"
        assert "will not run" in done.json()["message"]
        row = monitor.task(broker, log_id)
        assert row is not None and row["status"] == "CANCELLED"
        assert row["error"].startswith("cancelled by olga-")
    audited = audit_rows("scheduler_lib_cancel_task", token_owner(op))
    assert [(d, r, t, e["log_id"], e["outcome"]) for d, r, t, e in audited] == [
        ("etl", RUN_1, "exec_async_1", etl_task, "cancelled"),
        (None, None, None, plain_task, "cancelled"),
    ]
    # Bad input: one line each
    again = cancel(etl_task, op)
    assert again.status_code == 200 and again.json()["outcome"] == "CANCELLED"
    assert "nothing was done" in again.json()["message"]
    assert cancel(10**9, op).status_code == 404
    assert cancel(0, op).status_code == 422
    assert api_server.post(f"{PREFIX}/api/tasks/x/cancel", headers=op).status_code == 422
    assert api_server.post(f"{PREFIX}/api/tasks/{etl_task}/cancel").status_code == 401
    # A logged-in browser's cookie alone does not act: another site's form could post
    # it (a cross-site request forgery); the page's own request carries its header
    from fastapi.testclient import TestClient

    from scheduler_lib.airflow import ui

    browser = TestClient(api_server.app, cookies={"_token": token_for("op", "otto")})
    forged = browser.post(f"{PREFIX}/api/tasks/{plain_task}/retry")
    assert forged.status_code == 403, forged.text
    assert ui.ACTION_HEADER in forged.json()["detail"]
    from_page = browser.post(
        f"{PREFIX}/api/tasks/{plain_task}/retry", headers={ui.ACTION_HEADER: "1"}
    )
    assert from_page.status_code == 200, from_page.text


def token_owner(headers: dict[str, str]) -> str:
    """The user name a test's bearer token was made for."""
    import base64

    payload = headers["Authorization"].split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["sub"])


def test_retry_sends_a_task_sent_outside_airflow_again(
    api_server: Any, ui_broker: tuple[Broker, Sent]
) -> None:
    broker, sent = ui_broker
    admin_name = f"ada-{secrets.token_hex(3)}"
    admin = bearer("admin", admin_name)
    failed, queued = sent.log_ids["plain"][0], sent.log_ids["plain"][1]
    broker.run("log_fail", log_id=failed, error="boom", now=time.time())

    def retry(log_id: int) -> Any:
        return api_server.post(f"{PREFIX}/api/tasks/{log_id}/retry", headers=admin)

    # A task that has not ended is not retried
    refused = retry(queued)
    assert refused.status_code == 409 and "is QUEUED" in refused.json()["detail"]
    # When the failed task of an open scheduler is retried
    done = retry(failed)
    assert done.status_code == 200, done.text
    # Then it was sent again on its scheduler, as a new row of the same task
    assert done.json()["outcome"] == "resent"
    (new_id,) = {r["log_id"] for r in TaskScheduler(broker).log(sent.handles["plain"])} - set(
        sent.log_ids["plain"]
    )
    assert f"as log id {new_id}" in done.json()["message"]
    old, new = monitor.task(broker, failed), monitor.task(broker, new_id)
    assert old is not None and new is not None
    assert (new["task_name"], new["status"], new["scheduler_handle"], new["wave"]) == (
        old["task_name"],
        "QUEUED",
        old["scheduler_handle"],
        old["wave"],
    )
    (audited,) = audit_rows("scheduler_lib_retry_task", admin_name)
    assert audited[3]["log_id"] == failed and audited[3]["outcome"] == "resent"
    # When its scheduler has been released, a retry is refused, saying why
    scheduler = TaskScheduler(broker)
    scheduler.release_scheduler(scheduler.attach(sent.handles["plain"]))
    gone = retry(failed)
    assert gone.status_code == 409, gone.text
    assert "cannot be sent again" in gone.json()["detail"]
    # A row an Airflow task sent is retried by clearing its task instance: none here
    etl_failed = sent.log_ids["etl-1"][0]
    broker.run("log_fail", log_id=etl_failed, error="boom", now=time.time())
    missing = retry(etl_failed)
    assert missing.status_code == 409 and "no such task instance" in missing.json()["detail"]
