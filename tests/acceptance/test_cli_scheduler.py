"""`scheduler-lib init`, `run PLAN.yaml` and `status`, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lib.broker import Broker


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_lib.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**os.environ, "SCHEDULER_LIB_EXECUTOR_IDLE": "2"},
    )


GOOD = """\
policy: fail_fast
waves:
  - name: first
    tasks:
      - {kind: python, callable: "time:sleep", args: [0.2], name: nap-a}
      - {kind: python, callable: "time:sleep", args: [0.2], name: nap-b}
  - - {kind: sql, sql: "SELECT 1", name: check}
"""

FAILING = """\
waves:
  - - {kind: python, callable: "builtins:int", args: ["x"], name: broken}
  - - {kind: python, callable: "time:sleep", args: [0.01], name: never-sent}
"""


@pytest.fixture
def initialised(db_url: str) -> str:
    result = _cli("init", "--db", db_url)
    assert result.returncode == 0, result.stderr
    assert "scheduler catalog ready" in result.stdout
    return db_url


def test_run_executes_a_plan_and_prints_the_log(initialised: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(GOOD)
    result = _cli("run", str(plan), "--db", initialised, "--serve")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("nap-a", "nap-b", "check"):
        assert name in result.stdout
    assert result.stdout.count("SUCCEEDED") == 3
    assert "all tasks succeeded" in result.stdout
    # The status command sees the same rows
    status = _cli("status", "--db", initialised, "--json")
    assert status.returncode == 0, status.stderr
    recent = json.loads(status.stdout)["recent"]
    assert sorted(r["task_name"] for r in recent) == ["check", "nap-a", "nap-b"]
    assert {r["status"] for r in recent} == {"SUCCEEDED"}


def test_run_reports_as_json(initialised: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(GOOD)
    result = _cli("run", str(plan), "--db", initialised, "--serve", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert [t["wave"] for t in report["tasks"]] == [1, 1, 2]  # the first wave is 1


def test_a_failing_plan_exits_non_zero_and_says_what_failed(
    initialised: str, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(FAILING)
    result = _cli("run", str(plan), "--db", initialised, "--serve")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "broken" in result.stdout and "FAILED" in result.stdout
    assert "invalid literal" in result.stdout
    assert "1 failed" in result.stdout and "1 not sent" in result.stdout
    assert "never-sent" not in result.stdout  # not sent, so not in the log
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("waves: [[{kind: python, callable: x.y}]\n", "plan.yaml:2: not valid YAML"),
        ("wavez: []\n", "plan.yaml:1: unknown field 'wavez'"),
        ("policy: fail_fast\n", "plan.yaml:1: field 'waves' is missing"),
        ("policy: maybe\nwaves: [[{kind: sql, sql: x}]]\n", "plan.yaml:1: field 'policy'"),
        ("waves:\n  - []\n", "plan.yaml:2: wave 1 must be a non-empty list"),
        (
            "waves:\n  - - kind: python\n      callable: time:sleep\n      args: 3\n",
            "plan.yaml:4: wave 1, task 1: field 'args' must be a list",
        ),
        ("waves:\n  - - {kind: teleport}\n", "plan.yaml:2: wave 1, task 1"),
        (
            "max_in_flight: 0\nwaves: [[{kind: sql, sql: x}]]\n",
            "plan.yaml:1: field 'max_in_flight'",
        ),
    ],
)
def test_an_invalid_plan_names_the_line_and_field(
    initialised: str, tmp_path: Path, text: str, expected: str
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    result = _cli("run", str(plan), "--db", initialised)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    with Broker(initialised, migrate=False, timers=False) as broker:
        assert broker.conversation_endpoints() == []  # nothing half-sent


def test_an_unknown_kind_in_a_plan_is_refused_before_sending(
    initialised: str, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("waves:\n  - - {kind: sql, sql: 'SELECT 1'}\n  - - {kind: teleport}\n")
    result = _cli("run", str(plan), "--db", initialised)
    assert result.returncode == 2
    assert "unknown task kind 'teleport'" in result.stderr
    with Broker(initialised, migrate=False, timers=False) as broker:
        assert broker.conversation_endpoints() == []


def test_command_line_options_override_the_plan(initialised: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(FAILING)  # fail_fast by default
    result = _cli(
        "run",
        str(plan),
        "--db",
        initialised,
        "--serve",
        "--policy",
        "continue",
        "--max-in-flight",
        "1",
        "--target",
        "ServiceAsyncTarget",
    )
    # continue: the second wave ran although the first failed
    assert result.returncode == 1, result.stdout + result.stderr
    assert "never-sent" in result.stdout and "1 failed" in result.stdout
    status = _cli("status", "--db", initialised, "--limit", "5")
    assert status.returncode == 0, status.stderr
    assert "execution_log: the last 5" in status.stdout
    assert "never-sent" in status.stdout and "broken" in status.stdout
