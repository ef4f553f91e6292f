"""The Execution Status page: a FastAPI app that Airflow's api-server mounts (see
:mod:`scheduler_lib.airflow.plugin`), shown inside Airflow's UI as a page of its own and
as a tab of every DAG run.

Routes, relative to the mount point (``/scheduler-lib``):

- ``GET /`` — the page: what runs now (``execution_status``), the newest
  ``execution_log`` rows, filters by scheduler handle / DAG / run / target / kind / time
  range / failed only, a timeline of the rows by worker, refreshed every few seconds.
- ``GET /dags/{dag_id}/runs/{run_id}`` — the same page, fixed to one DAG run.
- ``GET /api/snapshot`` and ``GET /api/dags/{dag_id}/runs/{run_id}/snapshot`` — the JSON
  the pages poll; each row says whether the user may act on it (``editable``).
- ``POST /api/tasks/{log_id}/cancel`` and ``POST /api/tasks/{log_id}/retry`` — the
  actions (docs/airflow.md, "The Execution Status page: triage").
- ``GET /static/{name}`` — the page's script and style sheet.

Every route needs an Airflow login, through Airflow's own dependencies: the JWT in the
``Authorization`` header or in the UI's ``_token`` cookie (an anonymous request gets
401). A DAG run's routes need read access to that DAG's runs; on the top-level page a row
of a DAG is shown only to users who may read that DAG's runs, and rows sent outside
Airflow (no DAG) only to users who may see the cluster activity view. Cancel and retry
need edit access to the DAG's task instances (what clearing one in Airflow's UI needs),
or for rows sent outside Airflow edit access to Airflow's configuration; each is written
to Airflow's audit log (a ``Log`` row naming the user).

The broker is the one of the ``scheduler_lib`` connection named by ``[scheduler_lib]
ui_conn_id`` in Airflow's configuration (default ``scheduler_lib_default``), looked up
through Airflow's secrets backends: environment variables, then the metastore.

While the broker's database is unavailable (stopped, restarting, failing over) the JSON
routes answer 503 within ``[scheduler_lib] ui_reconnect_timeout`` seconds (default 5),
with one line naming the database and the reason; the page itself needs no database, so
it stays up, shows that line and keeps polling. The first request after the database is
back answers 200 again: nothing is cached in a broken state.
"""

from __future__ import annotations

import contextlib
import functools
import html
import importlib.resources
import json
import string
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal

import sqlalchemy as sa
from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import (
    AccessView,
    DagAccessEntity,
    DagDetails,
)
from airflow.api_fastapi.core_api.security import (
    GetUserDep,
    requires_access_dag,
    requires_authenticated,
)
from airflow.configuration import conf
from airflow.exceptions import AirflowNotFoundException
from airflow.models.connection import Connection
from airflow.models.dag import DagModel
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response, status
from fastapi.responses import HTMLResponse

from scheduler_lib.airflow import hooks
from scheduler_lib.broker import Broker
from scheduler_lib.broker.db import engine
from scheduler_lib.broker.exceptions import BrokerError, InvalidArgument
from scheduler_lib.scheduler import TaskScheduler, monitor
from scheduler_lib.scheduler.errors import SchedulerEnded

URL_PREFIX = "/scheduler-lib"  # where the api-server mounts the app
CONFIG_SECTION = "scheduler_lib"
REFRESH_INTERVAL = 3  # seconds between the page's polls (``?refresh=N`` to change)
# Seconds a request rides through a database outage before it answers 503. Short, unlike
# the broker's default (120 s): the page polls on its own, so a request that waited for
# the database would only hold one of the api-server's threads (shared with Airflow's own
# routes) and leave the browser with a page that hangs. A restart shorter than this goes
# unnoticed; a longer outage shows its reason until the database is back.
UI_RECONNECT_TIMEOUT = 5.0
# Filters the page takes from its query string (``failed=true`` too), as the snapshot does
# (``range``: the last so many seconds, chosen in the page).
PAGE_FILTERS = ("scheduler_handle", "dag_id", "run_id", "target", "kind", "range")
STATIC_FILES = {  # name -> media type: the only files the static route serves
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}

# Airflow's dependencies. Sync routes: FastAPI runs them in its thread pool, so database
# work does not block the api-server's event loop.
Authenticated = Depends(requires_authenticated())
# The header the page's actions send: a cross-site form or image cannot set one (a
# script on another origin would need CORS, which the api-server does not grant).
ACTION_HEADER = "X-Scheduler-Lib-Action"


def from_the_page(request: Request) -> None:
    """An action authenticated by the UI's cookie came from the page itself: it carries
    :data:`ACTION_HEADER` (the cookie alone would let another site's form post it — a
    cross-site request forgery). A request with its own ``Authorization`` header (a
    script, the REST way) needs none."""
    if "authorization" in request.headers or request.headers.get(ACTION_HEADER) == "1":
        return
    raise HTTPException(
        status.HTTP_403_FORBIDDEN,
        f"an action needs the {ACTION_HEADER}: 1 header (the page sends it) or an "
        "Authorization header",
    )


FromThePage = Depends(from_the_page)
CanReadRun = Depends(requires_access_dag("GET", DagAccessEntity.RUN))
Limit = Annotated[int, Query(ge=1, le=monitor.MAX_LIMIT)]
LogId = Annotated[int, Path(ge=1, le=monitor.LAST_LOG_ID)]


def conn_id() -> str:
    """The connection whose broker the page shows (``[scheduler_lib] ui_conn_id``)."""
    return conf.get(CONFIG_SECTION, "ui_conn_id", fallback=hooks.DEFAULT_CONN_ID)


def reconnect_timeout() -> float:
    """Seconds a request waits for an unavailable database before answering 503
    (``[scheduler_lib] ui_reconnect_timeout``, default :data:`UI_RECONNECT_TIMEOUT`)."""
    raw = conf.get(CONFIG_SECTION, "ui_reconnect_timeout", fallback=None)
    if raw is None or not str(raw).strip():
        return UI_RECONNECT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"[{CONFIG_SECTION}] ui_reconnect_timeout must be a number of seconds >= 0, "
            f"got {raw!r}",
        )
    return seconds


def get_broker() -> Broker:
    """The broker of the page's connection, ready to read.

    The connection is looked up on every call (cheap next to a refresh) so an edited
    connection takes effect without restarting the api-server. Airflow's server-side
    lookup is used: the Task SDK's (``BaseHook.get_connection``) reads the metastore only
    in a process that declares itself a server, which a test client or an app embedded
    elsewhere does not.

    The broker is the process's, opened without a round trip (its schema is made ready
    here, through :func:`database`), with the page's short reconnect deadline.

    :raises HTTPException: 503 naming the connection when it is missing or unusable, or
        naming the database when it is unavailable
    """
    name = conn_id()
    try:
        conn = Connection.get_connection_from_secrets(name)
    except AirflowNotFoundException:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"connection {name!r} is not defined: add a scheduler_lib connection holding "
            "the broker's SQLAlchemy URL (or set [scheduler_lib] ui_conn_id)",
        ) from None
    try:
        url, options = hooks.broker_url(conn), hooks.connection_options(conn)
    except InvalidArgument as exc:
        # It quotes the host: the URL, password included.
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, _without_passwords(str(exc), conn)
        ) from None
    except ValueError as exc:
        # A URL that only fails as it is parsed further (a port that is not a number).
        shown = f"{(conn.host or '').strip()!r} is not a usable SQLAlchemy URL ({exc})"
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            _without_passwords(f"connection {name!r}: host {shown}", conn),
        ) from None
    try:
        # The page only reads: no timer thread (it would write, and the connection may
        # use a role that can only SELECT). Opened without migrating, so that opening it
        # never waits for the database (nor holds the process's lock of shared brokers
        # meanwhile): the schema is brought up to date below, as a call that may 503.
        broker = hooks.shared_broker(
            url, migrate=False, timers=False, reconnect_timeout=reconnect_timeout()
        )
    except BrokerError as exc:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            _without_passwords(f"connection {name!r}: {exc}", conn),
        ) from None
    with database(broker):
        hooks.ready(broker, migrate=options["migrate"])
    return broker


@contextlib.contextmanager
def database(broker: Broker) -> Iterator[None]:
    """Run the block's reads of ``broker``; an unavailable database is a 503 with one line
    naming it (never a traceback, never a password).

    While the database is away, one request at a time waits for it (up to
    :func:`reconnect_timeout`) and the others answer 503 at once: an outage holds one of
    the api-server's threads, not one per open page.
    """
    with hooks.turn(broker) as mine:
        if not mine:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, _unavailable(broker))
        try:
            yield
        except InvalidArgument as exc:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
        except Exception as exc:
            if hooks.is_outage(exc):
                raise HTTPException(
                    status.HTTP_503_SERVICE_UNAVAILABLE, _unavailable(broker, exc)
                ) from None
            if isinstance(exc, BrokerError | sa.exc.SQLAlchemyError):
                # Anything else the database said (a missing table, a refused
                # permission): its first line, not a 500 with a traceback.
                raise HTTPException(
                    status.HTTP_503_SERVICE_UNAVAILABLE, _database_error(broker, exc)
                ) from None
            raise


def _without_passwords(text: str, conn: Connection) -> str:
    """``text`` about ``conn`` with its password hidden: in any URL (``engine.mask_password``)
    and wherever else it appears — a host without a scheme (``alice:pw@host/db``) is no URL
    to the mask, and the connection's password field may be quoted on its own."""
    text = engine.mask_password(text)
    host = (conn.host or "").strip()
    # The userinfo of the host, read leniently (the host did not parse): what precedes the
    # last '@', after the scheme; the password follows its first ':'.
    userinfo = host.split("://", 1)[-1].rpartition("@")[0]
    for secret in (conn.password, userinfo.partition(":")[2]):
        if secret:
            text = text.replace(secret, "***")
    return text


def _unavailable(broker: Broker, exc: BaseException | None = None) -> str:
    return f"{hooks.outage_line(broker, exc)}; the page asks again at its next refresh"


def _database_error(broker: Broker, exc: BaseException) -> str:
    if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
        exc = exc.orig
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    database = broker.url.render_as_string(hide_password=True)
    text = f"database {database}: {first}"
    password = broker.url.password
    return text.replace(str(password), "***") if password else text


BrokerDep = Annotated[Broker, Depends(get_broker)]


def create_app() -> FastAPI:
    """The Execution Status app, for ``AirflowPlugin.fastapi_apps``."""
    app = FastAPI(
        title="scheduler_lib Execution Status",
        description="The scheduler's execution_status and execution_log, for Airflow's UI.",
        # The api-server's own docs cover Airflow; these routes are the page's plumbing.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/", response_class=HTMLResponse, dependencies=[Authenticated])
    def page(request: Request) -> HTMLResponse:
        """The top-level page (filters come from the query string)."""
        return _page(request, fixed=None)

    @app.get(
        "/dags/{dag_id}/runs/{run_id:path}", response_class=HTMLResponse, dependencies=[CanReadRun]
    )
    def run_page(request: Request, dag_id: str, run_id: str) -> HTMLResponse:
        """The per-DAG-run tab: the page fixed to one run."""
        return _page(request, fixed=(dag_id, run_id))

    @app.get("/api/snapshot", dependencies=[Authenticated])
    def snapshot(
        broker: BrokerDep,
        user: GetUserDep,
        scheduler_handle: str | None = None,
        dag_id: str | None = None,
        run_id: str | None = None,
        failed: bool = False,
        target: str | None = None,
        kind: str | None = None,
        since: str | None = None,
        until: str | None = None,
        limit: Limit = monitor.DEFAULT_LIMIT,
    ) -> dict[str, Any]:
        """What runs now and the newest log rows the user may see, filtered (the limit
        counts the rows the user may see)."""
        filters = _filters(scheduler_handle, dag_id, run_id, failed, target, kind, since, until)
        visible = _permission(user, "GET")
        with database(broker):
            data = monitor.snapshot(
                broker, filters, limit=limit, visible=lambda row: visible(row.get("dag_id"))
            )
        return _with_actions(data, user)

    @app.get("/api/dags/{dag_id}/runs/{run_id:path}/snapshot", dependencies=[CanReadRun])
    def run_snapshot(
        broker: BrokerDep,
        user: GetUserDep,
        dag_id: str,
        run_id: str,
        scheduler_handle: str | None = None,
        failed: bool = False,
        target: str | None = None,
        kind: str | None = None,
        since: str | None = None,
        until: str | None = None,
        limit: Limit = monitor.DEFAULT_LIMIT,
    ) -> dict[str, Any]:
        """What one DAG run's tasks run now and sent (the dependency checked the DAG)."""
        filters = _filters(scheduler_handle, dag_id, run_id, failed, target, kind, since, until)
        with database(broker):
            data = monitor.snapshot(broker, filters, limit=limit)
        return _with_actions(data, user)

    @app.post("/api/tasks/{log_id}/cancel", dependencies=[Authenticated, FromThePage])
    def cancel_task(broker: BrokerDep, user: GetUserDep, log_id: LogId) -> dict[str, Any]:
        """Cancel one task: it will not run, or its worker is asked to stop it."""
        row = _editable_row(broker, user, log_id)
        with database(broker):
            outcome = _scheduler(broker).cancel_task(log_id, f"cancelled by {user.get_name()}")
        message = {
            "cancelled": f"log id {log_id} had not started: it will not run",
            "stopping": f"log id {log_id} is running: its worker was asked to stop it",
        }.get(outcome, f"log id {log_id} had ended already ({outcome}): nothing was done")
        return _audited(user, "cancel", row, outcome, message)

    @app.post("/api/tasks/{log_id}/retry", dependencies=[Authenticated, FromThePage])
    def retry_task(broker: BrokerDep, user: GetUserDep, log_id: LogId) -> dict[str, Any]:
        """Retry one failed (or cancelled) task: clear its Airflow task instance, or send
        it again on its scheduler when it was sent outside Airflow."""
        row = _editable_row(broker, user, log_id)
        if row["status"] not in ("FAILED", "CANCELLED"):
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"log id {log_id} is {row['status']}: only a failed or cancelled task is retried",
            )
        if row.get("dag_id") and row.get("run_id") and row.get("task_id"):
            outcome, message = _clear_task_instance(row)
        else:
            with database(broker):
                try:
                    new_id = _scheduler(broker).resend_task(log_id)
                except SchedulerEnded as exc:
                    raise HTTPException(
                        status.HTTP_409_CONFLICT,
                        f"log id {log_id} cannot be sent again: {exc} (its sender is done "
                        "with it; send the task anew)",
                    ) from None
            outcome = "resent"
            message = (
                f"log id {log_id} was sent again on scheduler {row['scheduler_handle']} "
                f"as log id {new_id}"
            )
        return _audited(user, "retry", row, outcome, message)

    @app.get("/static/{name}", dependencies=[Authenticated])
    def static(name: str) -> Response:
        """The page's script and style sheet (no CDN, no build step)."""
        if name not in STATIC_FILES:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
        return Response(
            _static_text(name),
            media_type=STATIC_FILES[name],
            headers={"Cache-Control": "no-cache"},
        )

    return app


def _filters(
    scheduler_handle: str | None,
    dag_id: str | None,
    run_id: str | None,
    failed: bool,
    target: str | None,
    kind: str | None,
    since: str | None,
    until: str | None,
) -> monitor.Filters:
    try:
        return monitor.Filters.of(
            scheduler_handle,
            dag_id,
            run_id,
            failed=failed,
            target=target,
            kind=kind,
            since=since,
            until=until,
        )
    except InvalidArgument as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None


def _permission(user: BaseUser, method: Literal["GET", "PUT"]) -> Callable[[str | None], bool]:
    """Whether the user may see (``GET``) or act on (``PUT``) rows of a DAG (``None``:
    rows sent outside Airflow).

    Asked once per DAG id and request, with the DAG's team (multi-team deployments), as
    Airflow's own routes ask: ``GET`` is read access to the DAG's runs, ``PUT`` edit
    access to its task instances (what clearing one in Airflow's UI needs). Rows sent
    outside Airflow need the cluster activity view to be seen and edit access to
    Airflow's configuration (an administrator's right) to be acted on.
    """
    auth_manager = get_auth_manager()
    answers: dict[str | None, bool] = {}

    def allowed(dag_id: str | None) -> bool:
        if dag_id not in answers:
            if dag_id is None and method == "GET":
                answers[None] = auth_manager.is_authorized_view(
                    access_view=AccessView.CLUSTER_ACTIVITY, user=user
                )
            elif dag_id is None:
                answers[None] = auth_manager.is_authorized_configuration(method="PUT", user=user)
            else:
                answers[dag_id] = auth_manager.is_authorized_dag(
                    method=method,
                    access_entity=DagAccessEntity.RUN
                    if method == "GET"
                    else DagAccessEntity.TASK_INSTANCE,
                    details=DagDetails(id=dag_id, team_name=_team_names([dag_id]).get(dag_id)),
                    user=user,
                )
        return answers[dag_id]

    return allowed


def _with_actions(data: dict[str, Any], user: BaseUser) -> dict[str, Any]:
    """The snapshot with, on each row, whether the user may cancel or retry it."""
    editable = _permission(user, "PUT")
    for row in (*data["running"], *data["log"]):
        row["editable"] = row.get("log_id") is not None and editable(row.get("dag_id"))
    return data


def _scheduler(broker: Broker) -> TaskScheduler:
    return TaskScheduler(broker)


def _editable_row(broker: Broker, user: BaseUser, log_id: int) -> dict[str, Any]:
    """The log's row ``log_id``, when the user may act on it.

    :raises HTTPException: 404 for no such row, 403 when the user may not act on it
    """
    with database(broker):
        row = monitor.task(broker, log_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"log id {log_id}: no such row")
    if not _permission(user, "PUT")(row.get("dag_id")):
        needs = (
            f"edit access to DAG {row['dag_id']!r}'s task instances"
            if row.get("dag_id")
            else "edit access to Airflow's configuration (a row sent outside Airflow)"
        )
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"log id {log_id}: this needs {needs}")
    return row


def _clear_task_instance(row: Mapping[str, Any]) -> tuple[str, str]:
    """Retry a row an Airflow task sent: clear that task instance (Airflow's own way),
    once it has ended; its next try re-sends what its operator re-sends."""
    from airflow.models.taskinstance import TaskInstance, clear_task_instances
    from airflow.utils.session import create_session
    from airflow.utils.state import State

    dag_id, run_id, task_id = row["dag_id"], row["run_id"], row["task_id"]
    name = f"task instance {dag_id}/{run_id}/{task_id}"
    with create_session() as session:
        tis = list(
            session.scalars(
                sa.select(TaskInstance).where(
                    TaskInstance.dag_id == dag_id,
                    TaskInstance.run_id == run_id,
                    TaskInstance.task_id == task_id,
                )
            )
        )
        if not tis:
            raise HTTPException(status.HTTP_409_CONFLICT, f"{name}: no such task instance")
        unfinished = sorted({str(ti.state) for ti in tis if ti.state not in State.finished})
        if unfinished:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"{name} is {', '.join(unfinished)}: it is retried once it has ended (its "
                "own retries may send the task again meanwhile)",
            )
        clear_task_instances(tis, session)
    return "cleared", (
        f"{name} was cleared: Airflow runs it again, and its operator sends again what "
        "its retry_failed_only setting says"
    )


def _audited(
    user: BaseUser, action: str, row: Mapping[str, Any], outcome: str, message: str
) -> dict[str, Any]:
    """The action's answer, once it is in Airflow's audit log (as Airflow's own actions
    are: a ``Log`` row naming the user)."""
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    answer = {"log_id": row["log_id"], "action": action, "outcome": outcome, "message": message}
    with create_session() as session:
        session.add(
            Log(
                event=f"scheduler_lib_{action}_task",
                owner=user.get_name(),
                owner_display_name=user.get_name(),
                dag_id=row.get("dag_id"),
                run_id=row.get("run_id"),
                task_id=row.get("task_id"),
                extra=json.dumps(answer),
            )
        )
    return answer


def _team_names(dag_ids: Iterable[str]) -> dict[str, str | None]:
    if not conf.getboolean("core", "multi_team", fallback=False):
        return {}  # teams exist only in multi-team mode: save the query
    return DagModel.get_dag_id_to_team_name_mapping(list(dag_ids))


def _page(request: Request, fixed: tuple[str, str] | None) -> HTMLResponse:
    """The page's HTML, with its settings for the script.

    Links are built from the mount point the request came through (``root_path``), so the
    page works under any ``url_prefix`` and behind Airflow's ``[api] base_url`` path.
    """
    base = request.scope.get("root_path", "").rstrip("/")
    query = request.query_params
    filters: dict[str, Any] = {k: query.get(k, "") for k in PAGE_FILTERS}
    filters["failed"] = query.get("failed", "").lower() in ("1", "true", "yes", "on")
    if fixed is None:
        title, subtitle = "Execution Status", "scheduler_lib: what runs now and what ran"
        api = f"{base}/api/snapshot"
    else:
        dag_id, run_id = fixed
        title, subtitle = "Execution Status", f"{dag_id} / {run_id}"
        api = f"{base}/api/dags/{_quote(dag_id)}/runs/{_quote(run_id)}/snapshot"
        filters.update(dag_id=dag_id, run_id=run_id)
    settings = {
        "api": api,
        "actions": f"{base}/api/tasks",
        # Airflow's UI, for links to task instances: where the api-server mounted us.
        "airflowBase": base[: -len(URL_PREFIX)] if base.endswith(URL_PREFIX) else "",
        "fixedRun": fixed is not None,
        "filters": filters,
        "limit": _int(query.get("limit"), monitor.DEFAULT_LIMIT, 1, monitor.MAX_LIMIT),
        "refreshSeconds": _int(query.get("refresh"), REFRESH_INTERVAL, 1, 3600),
        "connId": conn_id(),
    }
    body = string.Template(_static_text("page.html")).substitute(
        title=html.escape(title),
        subtitle=html.escape(subtitle),
        base=html.escape(base),
        # JSON inside <script>: "<" escaped so no value can close the element.
        settings=json.dumps(settings).replace("<", "\\u003c"),
    )
    return HTMLResponse(body, headers={"Cache-Control": "no-store"})


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _int(raw: str | None, default: int, low: int, high: int) -> int:
    try:
        return min(max(int(raw), low), high) if raw else default
    except ValueError:
        return default


@functools.cache
def _static_text(name: str) -> str:
    return (importlib.resources.files("scheduler_lib.airflow") / "static" / name).read_text()
