"""Processes SIGKILLed while the PostgreSQL server is down.

The documented commands (`scheduler-lib serve`, `scheduler-lib run PLAN --json`,
`scheduler-lib worker`) run in subprocesses of their own; the private server (never the
shared one) is stopped, one of them is killed with SIGKILL (no handler runs, and its
connections are gone already), and the server is started again. What the dead process
held must come back truthfully: a task whose worker lived is SUCCEEDED; a task whose
worker died is FAILED with "worker lost", and no sooner than a whole lease (30 s) after
the restart; nothing stays RUNNING or QUEUED; no task runs twice (retries=0, the default
target's).

The marks the tasks leave outside the database (``marking_tasks``) are the ground truth:
who started a task (the pid), and whether it ended. Tasks that must be running at the
moment of the kill wait on a gate file the test opens (or never opens), so what runs when
is decided by the test, not by how fast readers ramp up. Every wait polls a condition
with a deadline; the outages are the intended waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from multiproc import poll

from bench.processes import CLI, TARGET_QUEUE, Processes, alive, init
from scheduler_lib.broker import Broker, EndpointState
from scheduler_lib.broker.activation import HEARTBEAT_EXPIRY
from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.scheduler.executor import LEASE

if TYPE_CHECKING:  # (readers import this module for its tasks: keep that light)
    from private_postgres import PrivatePostgres

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = Path(sys.executable).parent  # scheduler-lib and spark-submit live next to python
INITIATOR_QUEUE = "QueueAsyncInitiator"
SERVED = 60.0  # seconds for `serve` to monitor the target queue
STARTED = 60.0  # seconds for a task to start (readers ramp up every few seconds)
LOST = 120.0  # seconds after the restart for a dead worker's task to be failed (~LEASE)
SPARK_UP = 240.0  # seconds for a Spark worker to serve: a JVM takes 10-20 s, more if busy
# Seconds the server stays down after a kill: a lease expired by its own clock (at most
# LEASE after the kill) would fail its task OUTAGE s sooner than a whole lease after the
# restart, which the tests tell apart.
OUTAGE = 5.0
GATE_TIMEOUT = 300.0  # seconds a gated task waits for its gate before it raises
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")
LEFT_BEHIND = 10.0  # seconds a lease may take to end once nothing runs (well under LEASE)


# --- tasks (run by the readers of `serve` and `worker`: this module is on their path) ---


def _append(path: str, line: str) -> None:
    # As marking_tasks does: one write of one short line, opened for appending.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def gated_mark(path: str, name: str, gate: str) -> str:
    """``marking_tasks.mark``, ending when the file ``gate`` exists instead of after a
    fixed time: ``start NAME PID TIME``, wait for the gate, ``end NAME PID TIME``."""
    _append(path, f"start {name} {os.getpid()} {time.time():.3f}")
    deadline = time.monotonic() + GATE_TIMEOUT
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {GATE_TIMEOUT} s")
        time.sleep(0.05)
    _append(path, f"end {name} {os.getpid()} {time.time():.3f}")
    return name


def spark_gated_mark(spark: Any, path: str, name: str, gate: str) -> str:
    """A ``pyspark`` task: a Spark job on the worker's session, then :func:`gated_mark`."""
    spark.range(100).count()
    return gated_mark(path, name, gate)


def _marking(marks: Path, name: str, seconds: float) -> dict[str, Any]:
    return {
        "kind": "python",
        "callable": "marking_tasks:mark",
        "args": [str(marks), name, seconds],
        "name": name,
    }


def _gated(marks: Path, name: str, gate: Path, *, kind: str = "python") -> dict[str, Any]:
    function = "gated_mark" if kind == "python" else "spark_gated_mark"
    return {
        "kind": kind,
        "callable": f"test_killed_processes:{function}",
        "args": [str(marks), name, str(gate)],
        "name": name,
    }


# --- helpers ------------------------------------------------------------------------


def _plan(path: Path, waves: Sequence[Sequence[Mapping[str, Any]]]) -> Path:
    """A fail_fast plan file (each task a JSON object, which YAML reads as it is)."""
    lines = ["policy: fail_fast", "waves:"]
    for wave in waves:
        for t, task in enumerate(wave):
            lines.append(("  - - " if t == 0 else "    - ") + json.dumps(task))
    path.write_text("\n".join(lines) + "\n")
    return path


def _marks(path: Path) -> list[tuple[str, str, int]]:
    """The marks the tasks left: (start|end, task name, pid of the process that ran it)."""
    if not path.exists():
        return []
    return [
        (what, name, int(pid))
        for what, name, pid, _ in (line.split() for line in path.read_text().splitlines())
    ]


def _count(path: Path, what: str, name: str) -> int:
    return sum(1 for m in _marks(path) if m[:2] == (what, name))


def _rows(url: str) -> dict[str, dict[str, Any]]:
    """The execution_log rows by task name (each name is used once)."""
    with Broker(url, timers=False) as broker:
        broker.use_queries("scheduler_lib.scheduler")
        rows = broker.fetch("log_recent", limit=1000)
    by_name = {r["task_name"]: dict(r) for r in rows}
    assert len(by_name) == len(rows), [r["task_name"] for r in rows]
    return by_name


def _status(url: str, env: Mapping[str, str]) -> dict[str, Any]:
    """`scheduler-lib status --db URL --json`."""
    result = subprocess.run(
        [CLI, "status", "--db", url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    status: dict[str, Any] = json.loads(result.stdout)
    return status


def _activated(url: str) -> list[Mapping[str, Any]]:
    with Broker(url, timers=False) as broker:
        return broker.activated_tasks()


@pytest.fixture
def env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYSPARK_PYTHON": sys.executable,  # the Spark driver's Python: this one
        # this module, which the readers import for its tasks, imports multiproc
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), str(HERE.parent / "integration")]),
    }


@pytest.fixture
def processes(tmp_path: Path, env: dict[str, str]) -> Iterator[Processes]:
    with Processes(tmp_path, env) as started:
        yield started


def _serve(url: str, processes: Processes, name: str = "serve") -> subprocess.Popen[bytes]:
    """`scheduler-lib serve --db URL`, once it monitors the target queue."""
    since = time.time()
    serve = processes.start(name, "serve", "--db", url)
    processes.wait_monitored(serve, url, SERVED, queue=TARGET_QUEUE, since=since)
    return serve


def _report(processes: Processes, run: subprocess.Popen[bytes]) -> dict[str, Any]:
    """`run --json`'s report."""
    report: dict[str, Any] = json.loads(processes.stdout(run))
    return report


# --- 1. `run` killed while the database is down --------------------------------------


def test_run_killed_while_the_database_is_down(
    private_db_url: str,
    private_postgres: PrivatePostgres,
    processes: Processes,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """SIGKILL of `scheduler-lib run` during an outage, its first wave running in
    `serve` (2 waves of 2 tasks): the tasks' worker lived, so they finish (while the
    server is still down) and their rows say SUCCEEDED; the second wave was never sent (no
    rows, no marks); nothing stays RUNNING or QUEUED and `status` shows nothing running;
    `serve` rides on.

    What is truthful for the scheduler's conversation left behind: `run` died before its
    ReleaseScheduler, and nothing in the product ends a conversation whose caller
    vanished (it has no lifetime), so it stays — open, neither ended nor in error. Its
    answers are all there and say what the rows say: one ``AsyncDone`` per first-wave
    task (no duplicate for an outcome committed through the outage), SUCCEEDED, unread
    on the initiator queue; nothing about the second wave; no lease left. And it is not
    an orphan nobody can handle: another process attaches to it by the handle in
    ``execution_log.scheduler_handle``, reads its wave as done from the log, and releases
    it, after which none of its endpoints is left.
    """
    url = private_db_url
    marks, gate = tmp_path / "marks", tmp_path / "gate"
    init(url, env)
    serve = _serve(url, processes)
    first, second = ["w1a", "w1b"], ["w2a", "w2b"]
    plan = _plan(
        tmp_path / "plan.yaml",
        [[_gated(marks, n, gate) for n in first], [_marking(marks, n, 2.0) for n in second]],
    )
    # Given `run` with both tasks of its first wave running in `serve`
    run = processes.start("run", "run", str(plan), "--db", url, "--json")
    poll(
        lambda: all(_count(marks, "start", n) for n in first) or run.poll() is not None,
        STARTED,
        "both first-wave tasks to start",
    )
    assert run.poll() is None, processes.output(run)
    # When the server stops, `run` is SIGKILLed, and the tasks end while it is down
    private_postgres.stop()
    processes.kill(run)
    gate.touch()
    poll(
        lambda: all(_count(marks, "end", n) for n in first),
        30,
        "the first-wave tasks to end while the server is down",
    )
    private_postgres.start()

    # Then the first wave's rows say SUCCEEDED, one attempt each, run by `serve`
    def ended() -> dict[str, dict[str, Any]] | None:
        rows = _rows(url)
        return rows if all(rows[n]["status"] in ENDED for n in first) else None

    rows = poll(ended, 60, "the first wave's rows to end")
    for name in first:
        row = rows[name]
        assert (row["status"], row["attempts"], row["error"]) == ("SUCCEEDED", 1, None), row
        assert row["end_time"] is not None and row["worker_id"].split(":")[1] == str(serve.pid)
    # And the second wave was never sent: no row, no mark
    assert sorted(rows) == sorted(first), sorted(rows)
    assert [m for m in _marks(marks) if m[1] in second] == []
    # And the tasks that ran, ran once, in `serve`
    for name in first:
        assert (_count(marks, "start", name), _count(marks, "end", name)) == (1, 1)
    assert {pid for *_, pid in _marks(marks)} == {serve.pid}
    # And `scheduler-lib status` shows nothing running, no row RUNNING or QUEUED
    status = _status(url, env)
    assert [r for r in status["execution_status"] if r["log_id"] is not None] == [], status
    assert sorted(r["status"] for r in status["recent"]) == ["SUCCEEDED"] * len(first), status
    # And `serve` rides on
    assert serve.poll() is None, processes.output(serve)
    # And the conversation left behind tells the truth (see the docstring)
    handle = rows[first[0]]["scheduler_handle"]
    assert {rows[n]["scheduler_handle"] for n in first} == {handle}
    with Broker(url, timers=False) as broker:
        (mine,) = [
            e for e in broker.conversation_endpoints() if str(e.conversation_handle) == handle
        ]
        assert mine.is_initiator, mine

        def endpoints() -> list[Any]:
            return [
                e
                for e in broker.conversation_endpoints()
                if e.conversation_id == mine.conversation_id
            ]

        open_states = {EndpointState.STARTED_OUTBOUND, EndpointState.CONVERSING}
        assert len(endpoints()) == 2 and {e.state for e in endpoints()} <= open_states, endpoints()
        answers = [m for m in broker.peek(INITIATOR_QUEUE) if str(m.conversation_handle) == handle]
        assert [m.message_type_name for m in answers] == ["AsyncDone"] * len(first), answers
        said = {m.json()["log_id"]: m.json()["status"] for m in answers}
        assert said == {rows[n]["log_id"]: "SUCCEEDED" for n in first}, said
        assert broker.leases() == []
        # And another process can take it over: attach, read the wave as done, release
        scheduler = TaskScheduler(broker)
        attached = scheduler.attach(handle)
        progress = scheduler.wave_progress(attached, [rows[n]["log_id"] for n in first])
        assert progress.done and {t.status for t in progress.tasks} == {"SUCCEEDED"}, progress
        scheduler.release_scheduler(attached)
        poll(lambda: not endpoints(), 60, "the released conversation's endpoints to go")
    assert _rows(url) == rows  # releasing a finished scheduler changes no row
    assert serve.poll() is None, processes.output(serve)


# --- 2. `serve` killed while the database is down ------------------------------------


@pytest.mark.timeout(600)
def test_serve_killed_while_the_database_is_down(
    private_db_url: str,
    private_postgres: PrivatePostgres,
    processes: Processes,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """SIGKILL of `scheduler-lib serve` during an outage, with a task running in it and
    `run` waiting for it; a new `serve` once the server is back.

    The first wave is ``lost`` (runs until a gate the test never opens) and ``quick``
    (1 s, done before the outage); the second wave is ``never``. The orphaned ``lost``
    ends FAILED with "worker lost" — not SUCCEEDED, not stuck RUNNING — no sooner than a
    whole lease (LEASE) after the restart (a lease gets one after an outage), and within
    LOST; it never starts again (retries=0), not in the new `serve` either. `run` exits
    1 and its report says ``lost`` FAILED, ``quick`` SUCCEEDED, ``never`` not sent
    (fail_fast). The dead `serve`'s activated_tasks rows are gone (the new runtime's
    heartbeat expires them), and `status` shows nothing running.
    """
    url = private_db_url
    marks, gate = tmp_path / "marks", tmp_path / "gate"  # the gate is never opened
    init(url, env)
    doomed = _serve(url, processes, "serve-killed")
    plan = _plan(
        tmp_path / "plan.yaml",
        [
            [_gated(marks, "lost", gate), _marking(marks, "quick", 1.0)],
            [_marking(marks, "never", 1.0)],
        ],
    )
    # Given `run` waiting for `lost`, running in `serve` (and `quick` done)
    run = processes.start("run", "run", str(plan), "--db", url, "--json")

    def quick_done() -> bool:
        rows = _rows(url)
        return "quick" in rows and rows["quick"]["status"] == "SUCCEEDED"

    poll(
        lambda: (_count(marks, "start", "lost") and quick_done()) or run.poll() is not None,
        STARTED,
        "`lost` to start and `quick` to succeed",
    )
    assert run.poll() is None, processes.output(run)
    assert _rows(url)["lost"]["status"] == "RUNNING"
    dead_readers = {t["task_id"] for t in _activated(url) if t["process_id"] == doomed.pid}
    assert dead_readers, _activated(url)
    # When the server stops, `serve` is SIGKILLed, the server starts, and a new `serve`
    private_postgres.stop()
    processes.kill(doomed)
    time.sleep(OUTAGE)  # the outage itself
    restarted_at = time.time()  # the postmaster starts after this
    private_postgres.start()
    serve = _serve(url, processes)

    # Then `lost` ends FAILED, "worker lost", no sooner than a whole lease after the restart
    def lost_ended() -> dict[str, Any] | None:
        row = _rows(url)["lost"]
        return row if row["status"] != "RUNNING" else None

    lost = poll(
        lost_ended,
        LOST,
        "the orphaned task's row to end",
        explain=lambda: (_rows(url)["lost"], _marks(marks), processes.output(serve)),
    )
    print(f"`lost` failed {lost['end_time'] - restarted_at:.1f} s after the restart")
    assert lost["status"] == "FAILED" and "worker lost" in (lost["error"] or ""), lost
    assert lost["end_time"] is not None and lost["attempts"] == 1, lost
    assert lost["end_time"] >= restarted_at + LEASE - 0.5, (lost["end_time"] - restarted_at, lost)
    # And `run` exits 1, reporting `lost` failed, `quick` succeeded, `never` not sent
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run did not exit after the failure:\n{processes.output(run)}")
    assert run.returncode == 1, processes.output(run)
    report = _report(processes, run)
    assert report["ok"] is False
    reported = {t["task_name"]: t for t in report["tasks"]}
    assert sorted(reported) == ["lost", "quick"], report
    assert reported["lost"]["status"] == "FAILED" and "worker lost" in reported["lost"]["error"]
    assert reported["quick"]["status"] == "SUCCEEDED", reported["quick"]
    assert [[t["name"] for t in wave] for wave in report["not_sent"]] == [[], ["never"]], report
    # And the log agrees: no row RUNNING or QUEUED, nothing of the second wave
    rows = _rows(url)
    assert {n: r["status"] for n, r in rows.items()} == {"lost": "FAILED", "quick": "SUCCEEDED"}
    # And no task started more than once; `lost` never ended (its worker died)
    found = _marks(marks)
    assert sorted((what, name) for what, name, _ in found) == [
        ("end", "quick"),
        ("start", "lost"),
        ("start", "quick"),
    ], found
    assert {pid for *_, pid in found} == {doomed.pid}, found
    # And the dead `serve`'s readers are gone from activated_tasks, and from `status`
    poll(
        lambda: not dead_readers & {t["task_id"] for t in _activated(url)},
        HEARTBEAT_EXPIRY + 30,
        "the dead serve's activated_tasks rows to go",
        explain=lambda: _activated(url),
    )
    status = _status(url, env)
    assert [r for r in status["execution_status"] if r["process_id"] == doomed.pid] == []
    assert [r for r in status["execution_status"] if r["log_id"] is not None] == [], status
    # And no lease is left behind. The live reader ends the released scheduler's side of
    # the conversation: its EndDialog is under a lease for a moment; a lease left behind
    # would stay until it expired (LEASE), past this deadline.
    with Broker(url, timers=False) as broker:
        poll(lambda: not broker.leases(), LEFT_BEHIND, "the leases to end", explain=broker.leases)
    assert serve.poll() is None, processes.output(serve)


# --- 3. a Spark worker killed while the database is down ------------------------------


@pytest.mark.timeout(900)
def test_spark_worker_killed_while_the_database_is_down(
    private_db_url: str,
    private_postgres: PrivatePostgres,
    processes: Processes,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """SIGKILL of `scheduler-lib worker --master local[1]` (a Spark driver) during an
    outage, with a ``pyspark`` task running on it and `run` waiting; a new worker once
    the server is back.

    Chosen outcome: FAILED, not a rerun. The worker (re)writes its target with the
    default retries=0 on every start, so a lost task is not run again: its row ends
    FAILED with "worker lost", no sooner than a whole lease after the restart; the
    new worker does not run it, `run` exits 1 with it failed and the second wave not
    sent, and the dead driver's readers leave activated_tasks (the new worker's
    heartbeat expires them). Its Spark job ran in the dead driver's application.
    """
    url = private_db_url
    marks, gate = tmp_path / "marks", tmp_path / "gate"  # the gate is never opened
    init(url, env)
    worker_args = ["--db", url, "--master", "local[1]", "--max-readers", "1"]
    worker_args += ["--conf", "spark.ui.enabled=false"]

    def start_worker(name: str) -> subprocess.Popen[bytes]:
        worker = processes.start(name, "worker", *worker_args)
        processes.wait_said(worker, "worker serving", SPARK_UP)
        return worker

    doomed = start_worker("worker-killed")
    plan = _plan(
        tmp_path / "plan.yaml",
        [[_gated(marks, "lost", gate, kind="pyspark")], [_marking(marks, "never", 1.0)]],
    )
    # Given `run` waiting for a pyspark task running on the worker
    run = processes.start("run", "run", str(plan), "--db", url, "--json")
    poll(
        lambda: _count(marks, "start", "lost") or run.poll() is not None,
        STARTED,
        "the pyspark task to start",
    )
    assert run.poll() is None, processes.output(run)
    running = _rows(url)["lost"]
    assert running["status"] == "RUNNING" and running["spark_application_id"], running
    dead_readers = {t["task_id"] for t in _activated(url) if t["process_id"] == doomed.pid}
    assert dead_readers, _activated(url)
    # When the server stops, the worker is SIGKILLed, the server starts, and a new worker
    private_postgres.stop()
    jvm = processes.kill(doomed)
    assert jvm, "the Spark driver had no JVM child"
    time.sleep(OUTAGE)  # the outage itself
    restarted_at = time.time()  # the postmaster starts after this
    private_postgres.start()
    worker = start_worker("worker")

    # Then the task ends FAILED, "worker lost", no sooner than a whole lease after the restart
    def lost_ended() -> dict[str, Any] | None:
        row = _rows(url)["lost"]
        return row if row["status"] != "RUNNING" else None

    lost = poll(
        lost_ended,
        LOST,
        "the orphaned pyspark task's row to end",
        explain=lambda: (_rows(url)["lost"], _marks(marks), processes.output(worker)),
    )
    print(f"`lost` failed {lost['end_time'] - restarted_at:.1f} s after the restart")
    assert lost["status"] == "FAILED" and "worker lost" in (lost["error"] or ""), lost
    assert lost["attempts"] == 1 and lost["end_time"] is not None, lost
    assert lost["end_time"] >= restarted_at + LEASE - 0.5, (lost["end_time"] - restarted_at, lost)
    assert lost["spark_application_id"] == running["spark_application_id"], lost
    # And `run` exits 1 with it failed and the second wave not sent
    try:
        run.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run did not exit after the failure:\n{processes.output(run)}")
    assert run.returncode == 1, processes.output(run)
    report = _report(processes, run)
    assert [(t["task_name"], t["status"]) for t in report["tasks"]] == [("lost", "FAILED")]
    assert [[t["name"] for t in wave] for wave in report["not_sent"]] == [[], ["never"]]
    # And it ran once, in the dead driver; nothing is RUNNING
    found = _marks(marks)
    assert [(what, name, pid) for what, name, pid in found] == [("start", "lost", doomed.pid)]
    assert {n: r["status"] for n, r in _rows(url).items()} == {"lost": "FAILED"}
    # And the dead driver's readers leave activated_tasks; `status` shows nothing running
    poll(
        lambda: not dead_readers & {t["task_id"] for t in _activated(url)},
        HEARTBEAT_EXPIRY + 30,
        "the dead worker's activated_tasks rows to go",
        explain=lambda: _activated(url),
    )
    status = _status(url, env)
    assert [r for r in status["execution_status"] if r["log_id"] is not None] == [], status
    # And no lease is left behind. The live reader ends the released scheduler's side of
    # the conversation: its EndDialog is under a lease for a moment; a lease left behind
    # would stay until it expired (LEASE), past this deadline.
    with Broker(url, timers=False) as broker:
        poll(lambda: not broker.leases(), LEFT_BEHIND, "the leases to end", explain=broker.leases)
    assert worker.poll() is None, processes.output(worker)
    # (and the dead driver's JVM followed it: Spark's gateway exits when its Python
    # parent is gone, so a killed driver leaves nothing running behind)
    poll(lambda: not [p for p in jvm if alive(p)], 60, "the dead driver's JVM to exit")
