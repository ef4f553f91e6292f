"""`scheduler-lib run` beside a `scheduler-lib serve` of its own process, used as the README
gives them: a `serve` started a while ago, and a `run` the user stops with Ctrl-C or
that a supervisor (`timeout`, systemd) stops with SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.processes import CLI, Processes, wait_for
from scheduler_lib.scheduler.reporting import MONITOR_FRESH

NAP = 'waves:\n  - - {kind: python, callable: "time:sleep", args: [0.1], name: nap}\n'
# Six tasks for serve's four readers (max_queue_readers): four run, two wait in the queue;
# then a second wave, which an interrupted run must never send.
WAVES = (
    "waves:\n  - - "
    + "\n    - ".join(
        f'{{kind: python, callable: "time:sleep", args: [10], name: long{i}}}' for i in range(6)
    )
    + '\n  - - {kind: python, callable: "time:sleep", args: [0.1], name: after}\n'
)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def _rows(url: str) -> list[dict[str, Any]]:
    result = _cli("status", "--db", url, "--json", "--limit", "100")
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["recent"])


def _serve(processes: Processes, url: str) -> subprocess.Popen[bytes]:
    assert _cli("init", "--db", url).returncode == 0
    serve = processes.start("serve", "serve", "--db", url)
    processes.wait_monitored(serve, url, 60)
    return serve


def test_run_sees_a_serve_that_was_idle_for_a_while(db_url: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(NAP)
    with Processes(tmp_path) as processes:
        serve = _serve(processes, db_url)
        # Given a serve that idled past the window in which run trusts what it last wrote
        # (the scenario itself: a user starts serve, and runs a plan later)
        time.sleep(MONITOR_FRESH + 2)
        processes.check_alive(serve)
        # When a plan is run, Then it runs at once: before, run waited its reader wait
        # and refused ("nothing served 'QueueAsyncTarget'"), serve running beside it
        result = _cli("run", str(plan), "--db", db_url, "--reader-wait", "1")
        assert result.returncode == 0, result.stderr
        assert "all tasks succeeded" in result.stdout
        assert "nothing serves" not in result.stderr


# The serving host's clock behind the running host's: by more than the window in which run
# trusts a monitor's stamp, and well under a task's lease and a reader's heartbeat expiry
# (30 s each), which compare the two clocks too (docs/poison.md, "Leases are
# at-least-once for the work"): run's timers must not take serve's readers for dead.
SKEW = MONITOR_FRESH + 5


def test_run_sees_a_serve_whose_clock_is_behind(db_url: str, tmp_path: Path) -> None:
    # Given a serve on a host whose clock is SKEW seconds behind this one's (its process
    # sees time.time() that far back: every stamp it writes is that old to us)
    skewed = tmp_path / "skewed"
    skewed.mkdir()
    (skewed / "sitecustomize.py").write_text(
        f"import time\n_time = time.time\ntime.time = lambda: _time() - {SKEW}\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(skewed), *sys.path]))
    plan = tmp_path / "plan.yaml"
    plan.write_text(NAP)
    assert _cli("init", "--db", db_url).returncode == 0
    with Processes(tmp_path, env=env) as processes:
        serve = processes.start("serve", "serve", "--db", db_url)
        processes.wait_monitored(serve, db_url, 60)
        # When a plan is run here, Then it runs: its monitor's stamp is stale by this
        # clock, but it moves (each heartbeat); before, run refused after its reader
        # wait ("nothing served 'QueueAsyncTarget'"), serve running beside it
        result = _cli("run", str(plan), "--db", db_url, "--reader-wait", "15")
        processes.check_alive(serve)
        assert result.returncode == 0, result.stderr
        assert "all tasks succeeded" in result.stdout
        # And on PostgreSQL serve said its clock is off the server's, once (on SQLite
        # every process is on the database's host: one clock)
        said = re.findall(
            r"this host's clock is ([\d.]+) s behind the database server's",
            processes.output(serve),
        )
        if db_url.startswith("postgresql"):
            assert len(said) == 1 and abs(float(said[0]) - SKEW) < 1, processes.output(serve)
        else:
            assert said == [], processes.output(serve)


def _interrupted_run(
    processes: Processes, url: str, plan: Path
) -> tuple[subprocess.Popen[bytes], list[dict[str, Any]]]:
    """A run of ``plan`` whose first wave is running: four tasks started, two queued.

    The tasks sleep 10 s: the two queued ones must still be queued when the interrupt
    cancels them, which on a loaded machine can be seconds after ``status`` saw them so
    (with 4-s tasks, CI once saw the first four end and the last two start before it)."""
    run = processes.start("run", "run", str(plan), "--db", url)

    def started() -> list[dict[str, Any]] | None:
        rows = _rows(url)
        running = [r for r in rows if r["status"] == "RUNNING"]
        return rows if len(running) == 4 and len(rows) == 6 else None

    rows = wait_for(
        started, 60, "four tasks of wave 1 to run", check=lambda: processes.check_alive(run)
    )
    return run, rows


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_releases_its_scheduler_and_says_so_in_one_line(
    db_url: str, tmp_path: Path, signum: signal.Signals
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(WAVES)
    with Processes(tmp_path) as processes:
        _serve(processes, db_url)
        run, rows = _interrupted_run(processes, db_url, plan)
        [handle] = {r["scheduler_handle"] for r in rows}
        # When the run is interrupted mid-wave (Ctrl-C; SIGTERM as `timeout` sends it)
        run.send_signal(signum)
        assert run.wait(30) == 128 + signum
        # Then one line says what became of its tasks, and no traceback
        err = (tmp_path / "run.err").read_text()
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == (
            f"scheduler-lib: interrupted: scheduler {handle} released: its queued tasks were "
            "cancelled and its running ones asked to stop; `scheduler-lib status --db "
            f"{db_url}` shows how they ended"
        )

        # And the queued tasks never run, the running ones end (a sleep does not stop
        # when asked: it ends as it finishes), the next wave is never sent
        def ended() -> list[dict[str, Any]] | None:
            now = _rows(db_url)
            return now if all(r["end_time"] is not None for r in now) else None

        rows = wait_for(ended, 60, "every task of the interrupted run to end")
        by_status = {r["task_name"]: r["status"] for r in rows}
        assert sorted(by_status) == [f"long{i}" for i in range(6)]  # no "after"
        assert sorted(by_status.values()) == ["CANCELLED"] * 2 + ["SUCCEEDED"] * 4
        # (no worker ran the cancelled ones)
        assert all(r["worker_id"] is None for r in rows if r["status"] == "CANCELLED")


def test_a_run_interrupted_before_it_sent_anything_says_so(sqlite_url: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(NAP)
    assert _cli("init", "--db", sqlite_url).returncode == 0
    with Processes(tmp_path) as processes:
        # Given a run waiting for a reader (nothing serves its target)
        run = processes.start("run", "run", str(plan), "--db", sqlite_url, "--wait-for-readers")
        processes.wait_said(run, "nothing serves 'QueueAsyncTarget' yet", 60)
        # When it is interrupted, Then it says nothing was sent, and nothing was
        run.send_signal(signal.SIGINT)
        assert run.wait(30) == 130
        err = (tmp_path / "run.err").read_text()
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == (
            "scheduler-lib: interrupted before the plan's scheduler began: nothing was sent"
        )
    assert _rows(sqlite_url) == []


def test_any_command_interrupted_says_so_in_one_line(tmp_path: Path) -> None:
    """A command stuck on a server that accepts connections and never answers (a hung
    proxy): Ctrl-C ends it with one line, not a traceback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        url = f"postgresql://postgres:S3cretPW@127.0.0.1:{port}/hung"
        with Processes(tmp_path) as processes:
            status = processes.start("status", "status", "--db", url)
            # Given it is connecting (the server took its connection), When interrupted
            server.settimeout(60)
            connection, _ = server.accept()
            with connection:
                status.send_signal(signal.SIGINT)
                assert status.wait(30) == 130
    err = (tmp_path / "status.err").read_text()
    assert err.strip() == "scheduler-lib: interrupted", err
