"""``airflow standalone`` as a harness: a fresh home, a free port, a known login, and every
process started for it stopped however the caller ends.

    with Processes(logs) as processes:                      # stops them all on exit
        airflow = Standalone(processes, workdir, dags_folder=Path("dags"))
        processes.start("worker", [...], airflow.env)       # beside it, same environment
        api = airflow.start()                               # healthy, logged in
        api.unpause("my_dag")
        run_id = api.trigger("my_dag")["dag_run_id"]
        run = api.wait_run("my_dag", run_id, timeout=300, check=processes.check_alive)

Each process gets its own process group (``start_new_session``) and a log file; on exit
the groups get SIGTERM, then SIGKILL after ``STOP_GRACE``, and descendants that made a
session of their own are killed by pid. Waits are conditions with deadlines and fail
fast when a process died; failures raise :class:`HarnessError` (a test turns it into
``pytest.fail``). Only the standard library, ``psutil`` (Airflow's dependency) and
:mod:`bench.processes` (the waits).

Airflow settings made here, all needed to run a private instance: a temporary
``AIRFLOW_HOME`` (its SQLite metadata database unless the caller's env says otherwise),
``LOAD_EXAMPLES`` off, the DAGs folder (and plugins folder, if given), the API on
127.0.0.1 and a free port with the execution API at the same address (task runners
report there), a fresh JWT secret, and the simple auth manager's ``admin`` user with a
password written to a file. Everything else is Airflow's default; ``AIRFLOW*`` variables
of the calling environment are dropped so that they cannot leak in.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from bench import processes
from bench.processes import HarnessError

BIN = Path(sys.executable).parent  # airflow, scheduler-lib and python live together
STARTUP = 180.0  # seconds for standalone to come up healthy (about 20 on a quiet 2-core machine)
PARSE_TIMEOUT = 120.0  # seconds for the dag-processor to parse a DAG
STOP_GRACE = 20.0  # seconds a process group has to exit after SIGTERM before SIGKILL
POLL = 0.5  # seconds between two looks of wait_for
RUN_POLL = 0.2  # seconds between two looks at a DAG run's state
HTTP_TIMEOUT = 30.0  # seconds per REST call
COMPONENTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")
TERMINAL = ("success", "failed")


def free_port() -> int:
    """A TCP port nobody listens on now (on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    check: Callable[[], None] | None = None,
    interval: float = POLL,
) -> Any:
    """:func:`bench.processes.wait_for`, looking every ``POLL`` seconds by default (a look
    here is an HTTP call, or a read of a log)."""
    return processes.wait_for(condition, timeout, what, check=check, interval=interval)


class Processes:
    """Processes started in their own process groups, each logging to a file; stopped
    together, children and grandchildren included, on :meth:`stop_all` or when the
    ``with`` block ends (also on an exception or Ctrl-C).

    :param logs: the folder of the log files (``<name>.log``)
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: list[str], env: Mapping[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a new session (its own process group), output to its log.

        :param name: the process's name here and its log's
        :param argv: the command
        :param env: its whole environment
        :param cwd: its working directory (default: this process's)
        """
        if name in self.started:
            raise HarnessError(f"a process named {name!r} was started already")
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - kept open by the child
        try:
            process = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()  # the child has its own descriptor
        self.started[name] = process
        return process

    def check_alive(self) -> None:
        """Raise :class:`HarnessError` with the log's tail if a process has exited."""
        for name, process in self.started.items():
            if process.poll() is not None:
                raise HarnessError(f"{name} exited with {process.returncode}:\n{self.tail(name)}")

    def log_text(self, name: str) -> str:
        """Everything ``name`` wrote so far."""
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, name: str, lines: int = 40) -> str:
        """The last ``lines`` lines of ``name``'s log."""
        return "\n".join(self.log_text(name).splitlines()[-lines:])

    def stop_all(self) -> None:
        """SIGTERM to every group, SIGKILL to what is left after ``STOP_GRACE``."""
        # Descendants noted first, then the groups told to stop: Airflow's components and
        # the task runners they fork stay in the group, but anything that made a session
        # of its own is caught by the list.
        family: list[psutil.Process] = []
        for process in self.started.values():
            with contextlib.suppress(psutil.Error):
                family += psutil.Process(process.pid).children(recursive=True)
        for process in self.started.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for process in self.started.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for process in self.started.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _, alive = psutil.wait_procs(family, timeout=max(deadline - time.monotonic(), 1.0))
        for straggler in alive:
            with contextlib.suppress(psutil.Error):
                straggler.kill()
        self.started.clear()


class Api:
    """The api-server's REST API (``/api/v2``), as a client outside the process sees it.

    :param base: e.g. ``http://127.0.0.1:8080``
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self.token: str | None = None

    def call(
        self, method: str, path: str, body: Any = None, *, auth: bool = True
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON or text); status 0 when nothing listens yet."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        except OSError:  # not listening yet
            return 0, None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def expect(self, method: str, path: str, body: Any = None, *, status: int = 200) -> Any:
        """:meth:`call`, raising :class:`HarnessError` unless the status is ``status``."""
        got, answer = self.call(method, path, body)
        if got != status:
            raise HarnessError(f"{method} {path}: HTTP {got} (expected {status}): {answer}")
        return answer

    def healthy(self) -> bool:
        """Whether every component (database, scheduler, triggerer, dag-processor) is."""
        status, health = self.call("GET", "/api/v2/monitor/health", auth=False)
        return (
            status == 200
            and isinstance(health, dict)
            and all(health.get(c, {}).get("status") == "healthy" for c in COMPONENTS)
        )

    def login(self, username: str, password: str) -> None:
        """Take a JWT from the simple auth manager (``POST /auth/token``)."""
        status, answer = self.call(
            "POST", "/auth/token", {"username": username, "password": password}, auth=False
        )
        if status != 201 or not isinstance(answer, dict):
            raise HarnessError(f"login as {username}: HTTP {status}: {answer}")
        self.token = answer["access_token"]

    def wait_dag(
        self, dag_id: str, timeout: float = PARSE_TIMEOUT, check: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Wait until the dag-processor has parsed ``dag_id``; import errors in the error."""
        path = f"/api/v2/dags/{quote(dag_id)}"

        def parsed() -> dict[str, Any] | None:
            status, dag = self.call("GET", path)
            return dict(dag) if status == 200 else None

        try:
            got: dict[str, Any] = wait_for(parsed, timeout, f"DAG {dag_id} parsed", check=check)
            return got
        except HarnessError as exc:
            _, errors = self.call("GET", "/api/v2/importErrors")
            raise HarnessError(f"{exc}; import errors: {errors}") from None

    def unpause(self, dag_id: str) -> None:
        """Unpause ``dag_id``."""
        self.expect("PATCH", f"/api/v2/dags/{quote(dag_id)}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Create a run of ``dag_id`` now (no logical date); the run as the API returns it."""
        body: dict[str, Any] = {"logical_date": None}
        if conf is not None:
            body["conf"] = dict(conf)
        run: dict[str, Any] = self.expect("POST", f"/api/v2/dags/{quote(dag_id)}/dagRuns", body)
        return run

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """A DAG run as the API returns it."""
        run: dict[str, Any] = self.expect("GET", run_path(dag_id, run_id))
        return run

    def wait_run(
        self,
        dag_id: str,
        run_id: str,
        timeout: float,
        check: Callable[[], None] | None = None,
        interval: float = RUN_POLL,
    ) -> dict[str, Any]:
        """Wait until the run is ``success`` or ``failed``; the run then. The caller judges
        the state (a failed run is an answer, not an error here)."""

        def finished() -> dict[str, Any] | None:
            status, run = self.call("GET", run_path(dag_id, run_id))
            if status == 200 and run.get("state") in TERMINAL:
                return dict(run)
            return None

        got: dict[str, Any] = wait_for(
            finished, timeout, f"run {run_id} of {dag_id} finished", check=check, interval=interval
        )
        return got

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """Every task instance of a run (all pages)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.expect(
                "GET", f"{run_path(dag_id, run_id)}/taskInstances?limit=100&offset={len(out)}"
            )
            out += page["task_instances"]
            if not page["task_instances"] or len(out) >= page["total_entries"]:
                return out


def quote(segment: str) -> str:
    """A URL path segment (run ids contain ``:`` and ``+``)."""
    return urllib.parse.quote(segment, safe="")


def run_path(dag_id: str, run_id: str) -> str:
    return f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}"


def parse_time(value: str | None) -> float | None:
    """An API timestamp (ISO 8601) as seconds since the epoch."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Standalone:
    """A private ``airflow standalone``: built here, started by :meth:`start`, stopped with
    the :class:`Processes` it was started in.

    :param processes: where it is started (and so stopped)
    :param workdir: its home (``airflow_home``) goes here
    :param dags_folder: ``[core] dags_folder``
    :param plugins_folder: ``[core] plugins_folder`` (default: Airflow's, in the home)
    :param env: more environment for it and for what the caller starts beside it
        (connections as ``AIRFLOW_CONN_*``, settings as ``AIRFLOW__SECTION__KEY``)
    :param name: the process's name in ``processes``
    """

    def __init__(
        self,
        processes: Processes,
        workdir: Path,
        *,
        dags_folder: Path,
        plugins_folder: Path | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "standalone",
    ) -> None:
        self.processes = processes
        self.name = name
        self.home = workdir / "airflow_home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.username = "admin"
        self.password = secrets.token_urlsafe(16)
        passwords = self.home / "passwords.json"
        passwords.write_text(json.dumps({self.username: self.password}))
        base_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))
        }
        self.env: dict[str, str] = {
            **base_env,
            # standalone starts its components as `airflow ...` from PATH
            "PATH": f"{BIN}{os.pathsep}{base_env.get('PATH', '')}",
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.username}:admin",
            # A password we know rather than the one standalone would generate and print.
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.base,
            # Task runners report to the execution API of this api-server, not to :8080.
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(48),
        }
        if plugins_folder is not None:
            self.env["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(plugins_folder)
        self.env.update(env or {})
        self.api = Api(self.base)

    def start(self, timeout: float = STARTUP) -> Api:
        """Start ``airflow standalone``, wait until all its components are healthy, log in;
        the logged-in API client.

        :param timeout: seconds for it to come up (its database is migrated first)
        """
        self.processes.start(self.name, [str(BIN / "airflow"), "standalone"], self.env)
        wait_for(
            self.api.healthy,
            timeout,
            "airflow standalone healthy",
            check=self.processes.check_alive,
        )
        self.api.login(self.username, self.password)
        return self.api
