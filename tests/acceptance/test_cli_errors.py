"""What a user who got something wrong sees: one line naming what was wrong and how to
fix it, a documented exit code (2: bad input or a refused operation, 3: the database could
not be reached or opened), never a traceback nor a password — and, for `run` with nothing
serving its target, a refusal after a short wait instead of a run that hangs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from bench.processes import CLI, Processes

PLAN = 'waves:\n  - - {kind: python, callable: "time:sleep", args: [0.1], name: nap}\n'


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scheduler-lib: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("command", "url", "says"),
    [
        # (status refuses a missing SQLite file before opening it: test_cli_output.py)
        ("init", "sqlite:////no/such/dir/x.db", "unable to open database file"),
        (
            "status",
            "postgresql://nobody_here:S3cretPW@127.0.0.1:5432/postgres",
            'role "nobody_here"',
        ),
        (
            "status",
            "postgresql://postgres:S3cretPW@127.0.0.1:5432/no_such_db_here",
            "does not exist",
        ),
        ("status", "postgresql://postgres:S3cretPW@no-such-host.invalid:5432/x", "resolve host"),
    ],
)
def test_a_database_that_cannot_be_opened_is_one_line_and_exit_3(
    command: str, url: str, says: str
) -> None:
    started = time.monotonic()
    line = _one_line(_cli(command, "--db", url), 3)
    assert says in line and "cannot connect to" in line
    assert "S3cretPW" not in line
    assert time.monotonic() - started < 30  # a setting to fix is said at once, not retried


@pytest.mark.parametrize("url", ["postgresql://alice:S3cretPW@host:notaport/db", "bogus"])
def test_a_malformed_url_is_one_line_without_its_password(url: str) -> None:
    line = _one_line(_cli("status", "--db", url), 2)
    assert "not a database URL" in line and "S3cretPW" not in line


def test_verbose_shows_the_traceback() -> None:
    result = _cli("--verbose", "status", "--db", "sqlite:////no/such/dir/x.db")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_run_with_nothing_serving_refuses_after_a_short_wait(
    sqlite_url: str, tmp_path: Path
) -> None:
    assert _cli("init", "--db", sqlite_url).returncode == 0
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    started = time.monotonic()
    result = _cli("run", str(plan), "--db", sqlite_url, "--reader-wait", "1")
    # (the line before says that it waits, and for what)
    waiting, error = result.stderr.strip().splitlines()
    assert "nothing serves 'QueueAsyncTarget' yet: waiting up to 1 s" in waiting
    line = _one_line(subprocess.CompletedProcess(result.args, result.returncode, "", error), 2)
    assert time.monotonic() - started < 60
    assert "nothing served 'QueueAsyncTarget' within 1 s" in line
    assert f"scheduler-lib serve --db {sqlite_url}" in line and "--wait-for-readers" in line
    # And nothing was sent
    assert json.loads(_cli("status", "--db", sqlite_url, "--json").stdout)["recent"] == []


def test_run_waits_for_a_reader_that_starts_later(sqlite_url: str, tmp_path: Path) -> None:
    assert _cli("init", "--db", sqlite_url).returncode == 0
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = subprocess.Popen(
        [CLI, "run", str(plan), "--db", sqlite_url, "--wait-for-readers"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with Processes(tmp_path) as processes:  # serve is stopped (SIGTERM) at the end
        try:
            # Given run waits (it says so), When serve starts later, Then the plan runs
            assert run.stderr is not None
            first = run.stderr.readline()
            assert "nothing serves 'QueueAsyncTarget' yet: waiting for ever" in first
            processes.start("serve", "serve", "--db", sqlite_url)
            out, _ = run.communicate(timeout=120)
            assert run.returncode == 0 and "all tasks succeeded" in out
        finally:
            if run.poll() is None:
                run.kill()
    assert os.path.exists(sqlite_url.removeprefix("sqlite:///"))
