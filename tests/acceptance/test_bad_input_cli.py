"""Bad input on the command line (issue 21, section 4): integers no database holds, and
plan files that are bombs, ambiguous, not UTF-8 or nested without bound. Each is one line
(`scheduler-lib: error: ...`, naming the argument, or the file, line and field), exit 2,
no traceback, and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "scheduler-lib")
TASK = '{kind: python, callable: "time:sleep", args: [0.01], name: nap}'


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def _refused(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scheduler-lib: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def initialised(sqlite_url: str) -> str:
    result = _cli("init", "--db", sqlite_url)
    assert result.returncode == 0, result.stderr
    return sqlite_url


def _nothing_ran(db: str) -> None:
    status = _cli("status", "--db", db, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["recent"] == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("status", "--limit", str(10**21)), "argument --limit"),
        (("status", "--limit", "0"), "argument --limit"),
        (("poison", "replay", str(10**23)), "a poison id"),
        (("poison", "drop", "1", str(2**63)), "a poison id"),
        (("poison", "show", "-1"), "a poison id"),
        (("routes", "--limit", str(2**31)), "argument --limit"),
        (("run", "plan.yaml", "--max-in-flight", str(2**40)), "argument --max-in-flight"),
    ],
)
def test_integers_out_of_range_are_refused_as_they_are_parsed(
    initialised: str, args: tuple[str, ...], says: str
) -> None:
    # Given a count, limit or id no column holds (or below 1)
    # When a command is given it
    line = _refused(_cli(*args, "--db", initialised))
    # Then one line names the argument and the range, and nothing ran
    assert says in line and ("from 1 to" in line or "up to" in line), line
    _nothing_ran(initialised)


def _bomb() -> str:
    """A billion laughs: 9**9 copies of 'lol' from nine lines of aliases."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return 'waves:\n  - - {kind: python, callable: "builtins:len", args: [*a8]}\nx:\n' + "".join(
        f"  {line}\n" for line in lines
    )


PLANS = {
    "alias bomb": (_bomb().encode(), ":2: field 'args': YAML aliases (*a8) are not allowed"),
    "alias in args": (
        f"waves:\n  - - {TASK}\n  - - {{kind: python, callable: 'builtins:len', "
        "args: &x [1]}\n  - - {kind: python, callable: 'builtins:len', args: *x}\n".encode(),
        ":4: field 'args': YAML aliases (*x) are not allowed",
    ),
    "waves twice": (
        f"waves:\n  - - {TASK}\npolicy: continue\nwaves:\n  - - {TASK}\n".encode(),
        ":4: field 'waves' is given twice (first on line 1)",
    ),
    "a task field twice": (
        b'waves:\n  - - kind: sql\n      sql: "SELECT 1"\n      sql: "SELECT 2"\n',
        ":4: field 'sql' is given twice (first on line 3)",
    ),
    "not UTF-8": (
        f"waves:\n  - - {TASK}\n  - - {{kind: sql, sql: \"SELECT 'caf\xe9'\"}}\n".encode("latin-1"),
        ":3: a plan is UTF-8 text; byte 0xe9",
    ),
    "nested 5,000 deep": (
        b"waves:\n  - - {kind: python, callable: 'builtins:len', args: "
        + b"[" * 5000
        + b"]" * 5000
        + b"}\n",
        ":2: field 'args': the plan nests more than 200 levels deep",
    ),
    "args nested 150 deep": (
        b"waves:\n  - - {kind: python, callable: 'builtins:len', args: "
        + b"[" * 150
        + b"]" * 150
        + b"}\n",
        ":2: wave 1, task 1: field 'args' nests lists and objects more than 100 levels deep",
    ),
    "over 1 MiB": (
        f"waves:\n  - - {TASK}\n".encode() + b"# padding\n" * 110_000,
        ": a plan is at most 1048576 bytes",
    ),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_a_bad_plan_file_is_one_line_naming_the_file_and_line(
    initialised: str, tmp_path: Path, case: str
) -> None:
    # Given a plan file that is a bomb, ambiguous, not UTF-8, or nested without bound
    content, says = PLANS[case]
    plan = tmp_path / "plan.yaml"
    plan.write_bytes(content)
    # When it is run
    line = _refused(_cli("run", str(plan), "--db", initialised, "--serve"))
    # Then one line names the file, the line and what is wrong, and nothing ran
    assert f"scheduler-lib: error: {plan}{says}" in line, line
    _nothing_ran(initialised)
