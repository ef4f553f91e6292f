"""``make stack`` refuses what it cannot run with one line naming what is wrong and how to
fix it, before it has made anything (no traceback, no secret, no database half made)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.stack.harness import REPO, SUPERUSER


def make_stack(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``python -m stack`` (what ``make stack`` runs) with names of its own; the database
    names it would have made."""
    broker = f"stack_{uuid.uuid4().hex[:8]}_broker"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SPARK"))}
    env = {**inherited, "STACK_DIR": str(tmp_path / "stack"), "BROKER_DB_NAME": broker}
    done = subprocess.run(
        [sys.executable, "-m", "stack"],
        cwd=REPO,
        env={**env, **settings},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, broker


def database_exists(name: str) -> bool:
    admin = sa.create_engine(SUPERUSER + "postgres")
    try:
        with admin.connect() as conn:
            found = conn.execute(
                sa.text("SELECT count(*) FROM pg_database WHERE datname = :name"), {"name": name}
            ).scalar_one()
    finally:
        admin.dispose()
    return bool(found)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        # The metastore clients' JDBC driver is not installed
        (
            {"POSTGRES_JDBC_JAR": "/nonexistent/postgresql.jar"},
            "/nonexistent/postgresql.jar does not exist: install PostgreSQL's JDBC driver",
        ),
        # The env file is not there
        ({"STACK_ENV_FILE": "/nonexistent/.env"}, "/nonexistent/.env does not exist: copy .env"),
    ],
)
def test_what_make_stack_cannot_run_is_one_line(
    tmp_path: Path, setting: dict[str, str], said: str
) -> None:
    # When make stack starts with a setting it cannot run with
    done, broker = make_stack(tmp_path, **setting)
    # Then it exits 1 with one line saying what and how to fix it
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "change-me" not in done.stdout + done.stderr  # no password of .env
    # And nothing was made
    assert not database_exists(broker)
