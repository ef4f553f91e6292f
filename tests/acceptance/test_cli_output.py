"""What the `scheduler-lib` command prints (issue 21, point 4), run as a user runs it: in a
subprocess.

- The commands that read (`status`, `queues`, `poison list|show`, `routes`) and those that
  administer an existing broker (`poison replay|drop`, `routes create|drop`) never create a
  database or a schema: a missing SQLite file, a database without the schema or with an
  older one is one line naming the URL and `scheduler-lib init --db URL`, exit 3. Those
  that read write nothing at all.
- Every command that prints a table takes `--json`.
- Every time printed is ISO 8601 in UTC (the subprocesses run with a local time zone
  5 h 45 min ahead of UTC, so a local time would be caught).
- Durations given on the command line are finite and not negative.
- No URL is printed with its password.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from scheduler_lib import __version__
from scheduler_lib.broker import Broker, Message, Transaction
from scheduler_lib.broker import schema as broker_schema
from scheduler_lib.broker.poison import Log, PoisonDetector, PoisonPolicy
from scheduler_lib.scheduler import Target, Task, TaskScheduler
from tests.scrape import samples

CLI = str(Path(sys.executable).parent / "scheduler-lib")
AHEAD_OF_UTC = {"TZ": "XYZ-5:45"}  # POSIX: local time = UTC + 5:45 (no tz database needed)
TABLE_TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{3})?Z"  # seconds, or milliseconds
JSON_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?Z")
PASSWORD = "S3cretPW"
MALFORMED = f"postgresql://alice:{PASSWORD}@host:notaport/db"
DB = "<db>"  # where a command line below takes the URL
PLAN = (
    "waves:\n"
    '  - - {kind: python, name: nap, callable: "time:sleep", args: [0.05]}\n'
    '  - - {kind: python, name: after, callable: "os:getpid"}\n'
)

READING = {
    "status": ("status", "--db", DB),
    "queues": ("queues", "--db", DB),
    "poison list": ("poison", "list", "--db", DB),
    "poison show": ("poison", "show", "--db", DB, "1"),
    "routes": ("routes", "--db", DB),
}
ADMINISTERING = {
    "poison replay": ("poison", "replay", "--db", DB, "1"),
    "poison drop": ("poison", "drop", "--db", DB, "1"),
    "routes create": ("routes", "--db", DB, "create", "to far", "Far", "tcp://127.0.0.1:9"),
    "routes drop": ("routes", "--db", DB, "drop", "to far"),
}
# Every command that takes --db (run's plan file is written by the test).
EVERY = {
    **READING,
    **ADMINISTERING,
    "init": ("init", "--db", DB),
    "serve": ("serve", "--db", DB),
    "worker": ("worker", "--db", DB),
    "run": ("run", "plan.yaml", "--db", DB, "--reader-wait", "0"),
}


def _cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def _ok(*args: str) -> str:
    """Standard output of a command that must succeed (in a time zone ahead of UTC)."""
    result = _cli(*args, env=AHEAD_OF_UTC)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scheduler-lib: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _line(command: tuple[str, ...], url: str) -> list[str]:
    return [url if arg == DB else arg for arg in command]


def _utc(text: str, before: float, after: float) -> float:
    """The time ``text`` says, checked to be ISO 8601 in UTC and between ``before`` and
    ``after`` (time.time() around what wrote it), within what its precision drops."""
    assert re.fullmatch(TABLE_TIME, text) or JSON_TIME.fullmatch(text), text
    seconds = datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    assert before - 1 <= seconds <= after + 0.001, (text, before, after)
    return seconds


def _with_password(url: str) -> str:
    return sa.make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def _shown(url: str) -> str:
    """The URL as the command names it: normalised, the password masked."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=True)


def _tables(url: str) -> list[str]:
    eng = sa.create_engine(url)
    try:
        inspector = sa.inspect(eng)
        return sorted(inspector.get_table_names() + inspector.get_view_names())
    finally:
        eng.dispose()


def _contents(url: str) -> dict[str, list[str]]:
    """Every row of every table."""
    eng = sa.create_engine(url)
    try:
        with eng.connect() as conn:
            quote = conn.dialect.identifier_preparer.quote
            return {
                name: sorted(
                    repr(tuple(r)) for r in conn.execute(sa.text(f"SELECT * FROM {quote(name)}"))
                )
                for name in sa.inspect(conn).get_table_names()
            }
    finally:
        eng.dispose()


def _poison_messages(url: str, *bodies: bytes) -> dict[bytes, int]:
    """A queue whose detector logged one poison message per body: body -> poison id."""
    with Broker(url, migrate=False, timers=False) as broker:
        broker.create_queue("InitiatorQueue")
        broker.create_queue("TargetQueue", poison_message_handling=False)
        broker.create_service("InitiatorService", "InitiatorQueue")
        broker.create_service("TargetService", "TargetQueue", ["DEFAULT"])
        for body in bodies:
            handle = broker.begin_dialog("InitiatorService", "TargetService")
            broker.send(handle, "DEFAULT", body)

        def fail(tx: Transaction, message: Message) -> None:
            raise ValueError("cannot parse it")

        policy = PoisonPolicy(threshold=1, dispositions=(Log(),))
        detector = PoisonDetector(broker, "TargetQueue", policy)
        while detector.handle_next(fail, timeout=0):
            pass
        return {p.message.body or b"": p.poison_id for p in broker.poison_messages()}


# --- 1. Commands on a database scheduler-lib did not make: refused, nothing created ----


@pytest.mark.parametrize("name", [*READING, *ADMINISTERING])
def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path: Path, name: str) -> None:
    # Given no database file
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    # When a command that reads or administers is given it
    line = _one_line(_cli(*_line(READING.get(name) or ADMINISTERING[name], url)), 3)
    # Then one line says so and how to make it, and no file was made
    assert f"{url}: no such database file: create it with: scheduler-lib init --db {url}" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.postgres
@pytest.mark.parametrize("name", [*READING, *ADMINISTERING])
def test_an_empty_postgresql_database_is_refused_and_left_empty(
    postgres_url: str, name: str
) -> None:
    # Given an empty database, reached with a password
    url = _with_password(postgres_url)
    # When a command that reads or administers is given it
    result = _cli(*_line(READING.get(name) or ADMINISTERING[name], url))
    # Then one line names it (without the password) and the fix, and it stays empty
    line = _one_line(result, 3)
    shown = _shown(url)
    assert line.endswith(
        f"{shown} has no scheduler_lib schema: create it with: scheduler-lib init --db {shown}"
    ), line
    assert PASSWORD not in result.stdout + result.stderr and ":***@" in line
    assert _tables(postgres_url) == []


def test_status_does_not_make_the_scheduler_schema(db_url: str) -> None:
    # Given a broker made without the scheduler's schema
    assert _cli("init", "--db", db_url, "--no-scheduler").returncode == 0
    before = _tables(db_url)
    # When status looks at it
    line = _one_line(_cli("status", "--db", db_url), 3)
    # Then it says what is missing and how to make it, and made nothing
    assert f"{_shown(db_url)} has no scheduler schema: create it with: scheduler-lib init" in line
    assert _tables(db_url) == before and "execution_log" not in before


def test_an_older_or_unknown_schema_is_refused_not_upgraded(db_url: str) -> None:
    # Given a broker whose schema is at the first revision (as an older version left it)
    assert _cli("init", "--db", db_url, "--no-scheduler").returncode == 0
    head = broker_schema.head()
    assert head != "0001"
    eng = sa.create_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(sa.text("UPDATE broker_alembic_version SET version_num = '0001'"))
        # When a command reads it
        line = _one_line(_cli("queues", "--db", db_url), 3)
        # Then it says which revision it is at, which it needs, and how to upgrade
        assert (
            f"its broker schema is at revision 0001, scheduler-lib {__version__} needs "
            f"{head}: upgrade it with: scheduler-lib init --db {_shown(db_url)}"
        ) in line
        # And it did not upgrade it
        with eng.connect() as conn:
            version = conn.execute(sa.text("SELECT version_num FROM broker_alembic_version"))
            assert version.scalar_one() == "0001"
            conn.rollback()
        # Given a revision this version does not know (a newer one made it)
        with eng.begin() as conn:
            conn.execute(sa.text("UPDATE broker_alembic_version SET version_num = 'f9999'"))
        line = _one_line(_cli("poison", "list", "--db", db_url), 3)
        assert "at revision f9999, which scheduler-lib" in line and "does not know" in line
    finally:
        eng.dispose()


def test_commands_that_read_write_nothing(db_url: str) -> None:
    # Given a broker with a poison message, a route and a disabled queue, whose identity
    # was never named (a database an older version made)
    assert _cli("init", "--db", db_url).returncode == 0
    ids = _poison_messages(db_url, b"poison")
    assert _cli("routes", "--db", db_url, "create", "to far", "Far", "tcp://127.0.0.1:9").stdout
    eng = sa.create_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM broker_settings WHERE setting_name = 'broker_instance'")
            )
    finally:
        eng.dispose()
    before = _contents(db_url)
    # When every command that reads runs, as tables and as JSON
    for command in READING.values():
        line = _line(command, db_url)
        if command[0] == "poison" and command[1] == "show":
            line[-1] = str(ids[b"poison"])
        table, document = _ok(*line), json.loads(_ok(*line, "--json"))
        if command[0] == "routes":
            # Then routes says the broker has no name yet, rather than making one
            assert "broker instance not named yet" in table
            assert document["broker_instance"] is None
    # Then not a row changed
    assert _contents(db_url) == before


# --- 2. --json on every command that prints a table ---------------------------------


def test_queues_json(db_url: str) -> None:
    # Given a queue turned off, and one on
    with Broker(db_url, timers=False) as broker:
        broker.create_queue("On")
        broker.create_queue("Off")
        before = time.time()
        broker.alter_queue("Off", status=False)
        after = time.time()
    # When queues prints JSON
    document = json.loads(_ok("queues", "--db", db_url, "--json"))
    # Then it has each queue (as named in the table), the monitors and the readers
    assert set(document) == {"queues", "queue_monitors", "activated_tasks"}
    queues = {q["queue_name"]: q for q in document["queues"]}
    assert queues["On"]["is_receive_enabled"] is True and queues["On"]["disabled_at"] is None
    off = queues["Off"]
    assert off["is_receive_enabled"] is False
    assert off["disabled_reason"] == "turned off by alter_queue"
    _utc(off["disabled_at"], before, after)
    assert document["activated_tasks"] == []
    # And the table says the same time, to the second
    table = _ok("queues", "--db", db_url)
    since = re.search(rf"^Off\s+({TABLE_TIME})\s+turned off", table, re.MULTILINE)
    assert since is not None, table
    _utc(since.group(1), before, after)


def test_poison_list_and_show_json(db_url: str) -> None:
    # Given two poison messages, one of them not UTF-8
    assert _cli("init", "--db", db_url, "--no-scheduler").returncode == 0
    before = time.time()
    ids = _poison_messages(db_url, b"text body", b"\xff\xfe")
    after = time.time()
    # When they are listed as JSON
    listed = json.loads(_ok("poison", "list", "--db", db_url, "--json"))["poison_messages"]
    # Then each has its columns, times in UTC
    assert sorted(p["poison_id"] for p in listed) == sorted(ids.values())
    first = next(p for p in listed if p["poison_id"] == ids[b"text body"])
    assert first["state"] == "LOGGED" and first["queue_name"] == "TargetQueue"
    assert "cannot parse it" in first["last_error"] and first["redeliver_at"] is None
    for key in ("enqueued_at", "recorded_at"):
        _utc(first[key], before, after)
    assert "body" not in first and "history" not in first
    # When both are shown as JSON: their bodies and failure histories too
    shown = json.loads(_ok("poison", "show", "--db", db_url, "--json", *map(str, ids.values())))[
        "poison_messages"
    ]
    by_id = {p["poison_id"]: p for p in shown}
    text, binary = by_id[ids[b"text body"]], by_id[ids[b"\xff\xfe"]]
    assert (text["body"], text["body_encoding"]) == ("text body", "utf-8")
    assert (binary["body"], binary["body_encoding"]) == ("fffe", "hex")
    [incident] = text["history"]
    assert incident["kind"] == "FAILED" and "cannot parse it" in incident["error"]
    _utc(incident["occurred_at"], before, after)
    # And the tables say the same times in UTC
    table = _ok("poison", "list", "--db", db_url)
    row = re.search(rf"^{ids[b'text body']}\s+LOGGED\s.*?\s({TABLE_TIME})\s+-\s", table, re.M)
    assert row is not None, table
    _utc(row.group(1), before, after)
    page = _ok("poison", "show", "--db", db_url, str(ids[b"text body"]))
    for field in ("enqueued", "recorded"):
        found = re.search(rf"^{field}\s+({TABLE_TIME})$", page, re.MULTILINE)
        assert found is not None, page
        _utc(found.group(1), before, after)
    history = re.search(rf"^history:\n  ({TABLE_TIME})  FAILED ", page, re.MULTILINE)
    assert history is not None, page
    _utc(history.group(1), before, after)


def test_routes_json(db_url: str) -> None:
    # Given a route and a message waiting to go along it
    assert _cli("init", "--db", db_url, "--no-scheduler").returncode == 0
    _ok("routes", "--db", db_url, "create", "to far", "Far", "tcp://127.0.0.1:9")
    with Broker(db_url, migrate=False, timers=False) as broker:
        instance = broker.broker_instance
        broker.create_queue("Q")
        broker.create_service("Near", "Q")
        before = time.time()
        broker.send(broker.begin_dialog("Near", "Far"), "DEFAULT", b"waiting")
        after = time.time()
    # When routes prints JSON
    document = json.loads(_ok("routes", "--db", db_url, "--json"))
    # Then every list is there, in one object
    assert set(document) == {
        "broker_instance",
        "routes",
        "outgoing",
        "transport_connections",
        "transport_events",
    }
    assert document["broker_instance"] == instance
    [route] = document["routes"]
    assert (route["route_name"], route["remote_service_name"]) == ("to far", "Far")
    assert route["broker_instance"] is None and route["address"] == "tcp://127.0.0.1:9"
    assert JSON_TIME.fullmatch(route["created_at"])
    [waiting] = document["outgoing"]
    assert waiting["to_service_name"] == "Far" and waiting["message_type_name"] == "DEFAULT"
    _utc(waiting["enqueued_at"], before, after)
    assert document["transport_connections"] == [] and document["transport_events"] == []
    # And the table's "waiting since" is the same time in UTC
    table = _ok("routes", "--db", db_url)
    since = re.search(rf"\bFar\s+0\s+DEFAULT\s+({TABLE_TIME})\s+0\s+in flight", table)
    assert since is not None, table
    _utc(since.group(1), before, after)


# --- 3. run, status and serve: times in UTC -----------------------------------------


def test_run_and_status_print_times_in_utc(sqlite_url: str, tmp_path: Path) -> None:
    assert _cli("init", "--db", sqlite_url).returncode == 0
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    # When a plan runs (executors in the process), reporting as JSON, then as a table
    before = time.time()
    report = json.loads(_ok("run", str(plan), "--db", sqlite_url, "--serve", "--json"))
    table = _ok("run", str(plan), "--db", sqlite_url, "--serve")
    after = time.time()
    # Then the report's times and its tasks' are ISO 8601 in UTC, with microseconds
    started = _utc(report["started_at"], before, after)
    ended = _utc(report["ended_at"], before, after)
    assert started <= ended
    for task in report["tasks"]:
        for key in ("sent_at", "start_time", "end_time"):
            assert JSON_TIME.fullmatch(task[key]) and "." in task[key], task
            assert started - 0.001 <= _utc(task[key], before, after) <= ended + 0.001
    # And the table's start times, in milliseconds
    starts = re.findall(rf"│ ({TABLE_TIME}) │", table)
    assert len(starts) == 2 and all("." in s for s in starts), table
    for start in starts:
        _utc(start, before, after)
    # When status prints the log: the same, as a table and as JSON
    status = _cli("status", "--db", sqlite_url, env={**AHEAD_OF_UTC, "COLUMNS": "250"})
    assert status.returncode == 0, status.stderr
    logged = re.findall(rf"│ ({TABLE_TIME}) │", status.stdout)
    assert len(logged) >= 4, status.stdout  # the log's four, and any reader's "since"
    for start in logged:
        _utc(start, before, after)
    recent = json.loads(_ok("status", "--db", sqlite_url, "--json"))["recent"]
    assert len(recent) == 4
    for row in recent:
        _utc(row["start_time"], before, after)
        _utc(row["end_time"], before, after)


def _wait_for(path: Path, pattern: str, process: subprocess.Popen[bytes]) -> re.Match[str]:
    """The first match of ``pattern`` in what the process writes to ``path``."""
    deadline = time.monotonic() + 60
    while True:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text, re.MULTILINE)
        if found is not None:
            return found
        assert process.poll() is None, f"exited {process.returncode}:\n{text}"
        assert time.monotonic() < deadline, f"no {pattern!r} within 60 s:\n{text}"
        time.sleep(0.05)


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``scheduler-lib serve`` processes a test starts; stopped (SIGTERM) at its end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _serve(
    started: list[subprocess.Popen[bytes]], tmp_path: Path, *args: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    env = {**os.environ, **AHEAD_OF_UTC, "SCHEDULER_LIB_TRANSPORT_KEY": "k" * 32}
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen([CLI, "serve", *args], stdout=stdout, stderr=stderr, env=env)
    started.append(process)
    return process, out, err


def test_serve_logs_in_utc(
    sqlite_url: str, tmp_path: Path, serving: list[subprocess.Popen[bytes]]
) -> None:
    # When serve runs a transport endpoint, which logs where it listens
    before = time.time()
    process, _, err = _serve(serving, tmp_path, "--db", sqlite_url, "--listen", "127.0.0.1:0")
    found = _wait_for(err, rf"^({TABLE_TIME}) INFO transport endpoint .* listening at", process)
    after = time.time()
    # Then the line's time is ISO 8601 in UTC, in milliseconds
    assert "." in found.group(1)
    _utc(found.group(1), before, after)


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_serve_names_the_task_on_the_lines_logged_while_it_runs(
    sqlite_url: str, tmp_path: Path, serving: list[subprocess.Popen[bytes]], log_format: str
) -> None:
    # Given serve, its log as JSON lines or text
    _ok("init", "--db", sqlite_url)
    process, out, err = _serve(serving, tmp_path, "--db", sqlite_url, "--log-format", log_format)
    _wait_for(out, "^serving", process)
    # When a task logs a warning of its own while it runs
    with Broker(sqlite_url) as broker:
        report = TaskScheduler(broker).run_waves(
            [[Task.python("logging:warning", "disk nearly full", name="cleanup")]]
        )
    [done] = report.completions
    assert done.ok, done.error
    # Then its line names the task: its log id, conversation handle, name and kind
    if log_format == "json":
        found = _wait_for(err, r"^.*disk nearly full.*$", process)
        line = json.loads(found.group(0))
        assert line["event"] == "disk nearly full" and line["level"] == "warning", line
        assert line["log_id"] == done.log_id and line["task_name"] == "cleanup", line
        assert line["task_kind"] == "python", line
        # (the reader's side of the scheduler's conversation: each side has its handle)
        assert uuid.UUID(line["conversation_handle"]) != report.scheduler_handle, line
        assert line["timestamp"].endswith("Z"), line  # UTC
        # and every line is one JSON object
        for text in err.read_text().splitlines():
            json.loads(text)
    else:
        line = _wait_for(err, r"^.*disk nearly full.*$", process).group(0)
        assert line.endswith(f"WARNING disk nearly full [task {done.log_id}: cleanup]"), line


def test_serve_with_reader_processes_logs_and_counts_what_they_ran(
    sqlite_url: str, tmp_path: Path, serving: list[subprocess.Popen[bytes]]
) -> None:
    # Given serve running its readers as processes, its log as JSON, its metrics served
    _ok("init", "--db", sqlite_url)
    process, out, err = _serve(
        serving,
        tmp_path,
        *("--db", sqlite_url, "--readers", "process"),
        *("--log-format", "json", "--metrics-port", "0"),
    )
    said = _wait_for(out, r"^metrics on (http://127\.0\.0\.1:\d+/metrics)", process)
    # When a wave runs in a reader process: a task that logs a warning, one that fails
    with Broker(sqlite_url) as broker:
        report = TaskScheduler(broker).run_waves(
            [
                [
                    Task.python("logging:warning", "disk nearly full", name="cleanup"),
                    Task.python("math:sqrt", -1.0, name="bad"),
                ]
            ],
            policy="continue",
        )
    done = {c.task_name: c for c in report.completions}
    assert done["cleanup"].ok and not done["bad"].ok
    # Then the reader process's line names its task, as serve's own readers' do
    line = json.loads(_wait_for(err, r"^.*disk nearly full.*$", process).group(0))
    assert line["log_id"] == done["cleanup"].log_id and line["task_name"] == "cleanup", line
    # And serve's /metrics counts what the reader process ran, and what its broker received
    queue = Target.queue

    finished = "scheduler_lib_tasks_finished_total"
    labels = (("kind", "python"), ("queue", queue))
    deadline = time.monotonic() + 60
    while (seen := samples(said.group(1))).get((finished, (*labels, ("status", "FAILED")))) != 1:
        assert time.monotonic() < deadline, sorted(k for k in seen if k[0] == finished)
        time.sleep(0.1)
    assert seen[(finished, (*labels, ("status", "SUCCEEDED")))] == 1
    assert seen[("scheduler_lib_task_duration_seconds_count", labels)] == 2
    assert seen[("scheduler_lib_messages_received_total", (("queue", queue),))] >= 2


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_serve_names_the_airflow_task_instance_that_sent_the_task(
    sqlite_url: str, tmp_path: Path, serving: list[subprocess.Popen[bytes]], log_format: str
) -> None:
    # Given serve, its log as JSON lines or text
    _ok("init", "--db", sqlite_url)
    process, out, err = _serve(serving, tmp_path, "--db", sqlite_url, "--log-format", log_format)
    _wait_for(out, "^serving", process)
    # When an Airflow task instance (its try 2) sends a task that logs a line of its own
    sender = {
        "dag_id": "etl",
        "run_id": "scheduled__2026-11-27T00:00:00+00:00",
        "task_id": "wave_1",
        "try_number": 2,
        "map_index": -1,
    }
    with Broker(sqlite_url) as broker:
        report = TaskScheduler(broker, context=sender).run_waves(
            [[Task.python("logging:warning", "disk nearly full", name="cleanup")]]
        )
    [done] = report.completions
    assert done.ok, done.error
    # Then the task's line names that task instance too
    if log_format == "json":
        line = json.loads(_wait_for(err, r"^.*disk nearly full.*$", process).group(0))
        assert line["log_id"] == done.log_id and line["task_name"] == "cleanup", line
        assert line["dag_id"] == "etl" and line["task_id"] == "wave_1", line
        assert line["run_id"] == sender["run_id"] and line["try_number"] == 2, line
        # (only a task's lines name its sender)
        for text in err.read_text().splitlines():
            other = json.loads(text)
            assert "log_id" in other or "dag_id" not in other, other
    else:
        line = _wait_for(err, r"^.*disk nearly full.*$", process).group(0)
        assert line.endswith(
            f"WARNING disk nearly full [task {done.log_id}: cleanup; etl.wave_1 "
            f"{sender['run_id']} try 2]"
        ), line


# --- 4. Durations: finite, not negative ----------------------------------------------

DURATIONS = {
    "--retry-initial": ("serve", "--db", DB),
    "--retry-max": ("serve", "--db", DB),
    "--idle-timeout": ("serve", "--db", DB),
    "--idle-exit": ("worker", "--db", DB),
    "--reconnect-timeout": ("status", "--db", DB),
    "--reader-wait": ("run", "plan.yaml", "--db", DB),
}
POSITIVE = {"--retry-initial", "--retry-max", "--idle-timeout", "--idle-exit"}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "-0.5", "Infinity", "ten", "0"])
@pytest.mark.parametrize("option", sorted(DURATIONS))
def test_durations_refuse_nan_inf_and_negatives(tmp_path: Path, option: str, value: str) -> None:
    (tmp_path / "plan.yaml").write_text(PLAN)
    database = tmp_path / "broker.db"
    line = _line(DURATIONS[option], f"sqlite:///{database}")
    # (a duration taken as valid may mean a command that never ends: 30 s, not 120)
    result = _cli(*line, f"{option}={value}", cwd=tmp_path, timeout=30)
    if value == "0" and option not in POSITIVE:
        # 0 is a wait of none: accepted (the command goes on, to whatever it meets next)
        assert f"argument {option}" not in result.stderr, result.stderr
        return
    # Then one line names the option and what it takes, exit 2, and nothing ran
    line = _one_line(result, 2)
    bound = "> 0" if option in POSITIVE else ">= 0"
    assert f"argument {option}: expected a number of seconds {bound}, got '{value}'" in line
    assert not database.exists()


def test_a_negative_duration_as_a_separate_word_is_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    line = _one_line(_cli("serve", "--db", url, "--retry-max", "-inf"), 2)
    assert "argument --retry-max" in line
    assert list(tmp_path.iterdir()) == []


# --- 5. No password, ever ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EVERY))
def test_a_malformed_url_never_shows_its_password(tmp_path: Path, name: str) -> None:
    (tmp_path / "plan.yaml").write_text(PLAN)
    result = _cli(*_line(EVERY[name], MALFORMED), cwd=tmp_path)
    line = _one_line(result, 2)
    assert "not a database URL: 'postgresql://alice:***@host:notaport/db'" in line
    assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.postgres
@pytest.mark.parametrize("name", sorted(EVERY))
def test_a_database_that_does_not_exist_never_shows_the_password(
    postgres_server: str, tmp_path: Path, name: str
) -> None:
    (tmp_path / "plan.yaml").write_text(PLAN)
    missing = sa.make_url(postgres_server).set(database=f"no_such_{uuid.uuid4().hex[:8]}")
    url = _with_password(missing.render_as_string(hide_password=False))
    result = _cli(*_line(EVERY[name], url), cwd=tmp_path)
    line = _one_line(result, 3)
    assert "does not exist" in line
    assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.postgres
def test_urls_printed_by_working_commands_hide_the_password(
    postgres_url: str, tmp_path: Path, serving: list[subprocess.Popen[bytes]]
) -> None:
    # Given a database reached with a password (the server trusts this test's user)
    url = _with_password(postgres_url)
    shown = _shown(url)
    # When init makes it, run finds nothing to serve its target, and serve serves it
    init = _cli("init", "--db", url)
    assert init.returncode == 0 and f"{shown}: schema upgraded" in init.stdout, init.stderr
    (tmp_path / "plan.yaml").write_text(PLAN)
    run = _cli("run", "plan.yaml", "--db", url, "--reader-wait", "0", cwd=tmp_path)
    assert run.returncode == 2 and f"scheduler-lib serve --db {shown}`" in run.stderr
    process, out, err = _serve(serving, tmp_path, "--db", url)
    _wait_for(out, rf"^serving {re.escape(shown)} \(runtime ", process)
    # Then each names the database without its password
    for text in (init.stdout, init.stderr, run.stdout, run.stderr, out.read_text()):
        assert PASSWORD not in text
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert PASSWORD not in out.read_text() + err.read_text()
