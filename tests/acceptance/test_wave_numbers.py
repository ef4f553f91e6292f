"""Wave numbers start at 1 wherever a user reads them (issue 21, point 4): the JSON of
`scheduler-lib run --json` and `status --json` says ``"wave": 1`` for the first wave, as
the tables do, through the real commands in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLAN = """\
policy: fail_fast
waves:
  - name: first
    tasks:
      - {kind: python, callable: "time:sleep", args: [0.05], name: nap-a}
      - {kind: python, callable: "time:sleep", args: [0.05], name: nap-b}
  - - {kind: sql, sql: "SELECT 1", name: check}
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_lib.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "SCHEDULER_LIB_EXECUTOR_IDLE": "2"},
    )


def _waves_shown(text: str) -> dict[str, str]:
    """Task name -> the wave cell, from the table of ``text`` that has a wave column."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "┃" in line and " wave " in line]
    header = [cell.strip() for cell in lines[at].split("┃")[1:-1]]
    shown = {}
    for line in lines[at + 2 :]:
        if "│" not in line:
            break  # the table's last border
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        shown[cells[header.index("task")]] = cells[header.index("wave")]
    return shown


@pytest.fixture
def ran(db_url: str, tmp_path: Path) -> tuple[str, dict[str, object]]:
    """A database where `run --serve --json` ran the plan: (its URL, the run's JSON)."""
    init = _cli("init", "--db", db_url)
    assert init.returncode == 0, init.stderr
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    result = _cli("run", str(plan), "--db", db_url, "--serve", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return db_url, json.loads(result.stdout)


def test_run_json_numbers_the_first_wave_1(ran: tuple[str, dict[str, object]]) -> None:
    # Given a plan of two waves (two naps, then a check)
    # When `scheduler-lib run --json` runs it
    _, report = ran
    # Then its rows say wave 1 for the naps and wave 2 for the check
    tasks = report["tasks"]
    assert isinstance(tasks, list)
    assert {t["task_name"]: t["wave"] for t in tasks} == {"nap-a": 1, "nap-b": 1, "check": 2}


def test_status_json_and_the_tables_say_the_same_wave(
    ran: tuple[str, dict[str, object]], tmp_path: Path
) -> None:
    db_url, _ = ran
    # When `scheduler-lib status --json` reads the log
    status = _cli("status", "--db", db_url, "--json")
    assert status.returncode == 0, status.stderr
    recent = json.loads(status.stdout)["recent"]
    # Then the first wave is 1 there too
    assert {r["task_name"]: r["wave"] for r in recent} == {"nap-a": 1, "nap-b": 1, "check": 2}
    # And the tables show the very same numbers: status's, and run's (with the wave's name)
    table = _cli("status", "--db", db_url)
    assert table.returncode == 0, table.stderr
    assert _waves_shown(table.stdout) == {"nap-a": "1", "nap-b": "1", "check": "2"}, table.stdout
    plan = tmp_path / "again.yaml"
    plan.write_text(PLAN)
    again = _cli("run", str(plan), "--db", db_url, "--serve")
    assert again.returncode == 0, again.stdout + again.stderr
    assert _waves_shown(again.stdout) == {"nap-a": "1 first", "nap-b": "1 first", "check": "2"}
    # And the progress lines (run_waves' on_completion) count the same way
    done = [line for line in again.stderr.splitlines() if line.endswith(" done")]
    assert done == ["wave 1/2 done", "wave 2/2 done"], again.stderr
