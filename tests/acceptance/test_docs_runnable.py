"""The commands of docs/operations.md, run as a reader would run them.

A fenced block preceded by ``<!-- runnable ... -->`` is run, in the order of the page, in
one scratch folder, with ``scheduler-lib`` and ``python`` of this environment first on the
PATH: ``bash`` blocks with ``bash -euo pipefail``, ``python`` blocks with this
interpreter. The marker's words: ``postgresql`` / ``sqlite`` (that backend only),
``fails`` (the block must exit non-zero: a refusal the page promises), ``expect="..."``
(text the output must contain; repeatable). Every block must exit 0 otherwise.

The settings the page asks the reader to export ("Settings used below") are provided:
on SQLite every URL is one fresh database file; on PostgreSQL the roles and databases are
the ones ``docker/postgres-init.sh`` makes, under names unique to the test (the script
reads them from the environment), dropped afterwards.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BLOCK_TIMEOUT = 120  # seconds for one block
_BLOCK = re.compile(
    r"^<!-- runnable(?P<attrs>[^>]*)-->\n```(?P<lang>\w+)[^\n]*\n(?P<body>.*?)^```$",
    re.S | re.M,
)


@dataclass
class Block:
    lang: str
    body: str
    line: int
    backends: set[str] = field(default_factory=set)
    fails: bool = False
    expect: list[str] = field(default_factory=list)


def runnable_blocks(path: Path) -> list[Block]:
    """The runnable blocks of a page, in order."""
    text = path.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        block = Block(match["lang"], match["body"], text.count("\n", 0, match.start()) + 1)
        for word, value in re.findall(r'(\w+)(?:="([^"]*)")?', match["attrs"]):
            if word in ("postgresql", "sqlite"):
                block.backends.add(word)
            elif word == "fails":
                block.fails = True
            elif word == "expect":
                block.expect.append(value)
            else:
                raise AssertionError(f"{path.name}:{block.line}: unknown marker word {word!r}")
        assert block.lang in ("bash", "python"), f"{path.name}:{block.line}: {block.lang}"
        blocks.append(block)
    # every marker is followed by a block it describes
    markers = re.findall(r"^<!-- runnable", text, re.M)
    assert len(markers) == len(blocks), f"{path.name}: a marker without its block"
    return blocks


def run_blocks(blocks: list[Block], backend: str, env: dict[str, str], cwd: Path) -> int:
    """Run the blocks for one backend; returns how many ran."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    ran = 0
    for block in blocks:
        if block.backends and backend not in block.backends:
            continue
        if block.lang == "bash":
            argv = ["bash", "-euo", "pipefail", "-c", block.body]
        else:
            argv = [sys.executable, "-c", block.body]
        done = subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
        )
        output = done.stdout + done.stderr
        where = f"operations.md:{block.line} on {backend} (exit {done.returncode}):\n{output}"
        if block.fails:
            assert done.returncode != 0, f"expected a refusal, {where}"
        else:
            assert done.returncode == 0, where
        for text in block.expect:
            assert text in output, f"{text!r} not in the output of {where}"
        ran += 1
    return ran


def test_the_guide_marks_its_commands() -> None:
    # Given the page, Then it has runnable blocks for both backends and refusals
    blocks = runnable_blocks(OPERATIONS)
    assert len(blocks) >= 15
    assert any(b.fails for b in blocks)
    assert any("sqlite" in b.backends for b in blocks)
    assert any("scheduler-lib status" in b.body for b in blocks)


def test_operations_guide_runs_on_sqlite(tmp_path: Path) -> None:
    # Given a fresh SQLite file as every URL of the page
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    env = {"SCHEDULER_LIB_DB": url, "OWNER_URL": url, "MONITOR_URL": url}
    # When every block for SQLite runs, Then each exits as the page says, with its output
    ran = run_blocks(runnable_blocks(OPERATIONS), "sqlite", env, tmp_path)
    assert ran >= 12


@pytest.fixture
def postgres_deployment(postgres_server: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The page's settings on PostgreSQL: names for docker/postgres-init.sh, unique to
    this test, and the URLs of its three roles; everything dropped afterwards."""
    suffix = uuid.uuid4().hex[:10]
    admin = sa.make_url(postgres_server)
    names = {
        "AIRFLOW_DB_NAME": f"sl_docs_airflow_{suffix}",
        "AIRFLOW_DB_USER": f"sl_docs_airflow_{suffix}",
        "BROKER_DB_NAME": f"sl_docs_broker_{suffix}",
        "BROKER_OWNER_ROLE": f"sl_docs_owner_{suffix}",
        "BROKER_APP_ROLE": f"sl_docs_app_{suffix}",
        "BROKER_MONITOR_ROLE": f"sl_docs_monitor_{suffix}",
    }
    passwords = {
        "AIRFLOW_DB_PASSWORD": "airflow-pw",
        "BROKER_OWNER_PASSWORD": "owner-pw",
        "BROKER_APP_PASSWORD": "app-pw",
        "BROKER_MONITOR_PASSWORD": "monitor-pw",
    }
    restore_db = f"sl_docs_restored_{suffix}"

    def url(role: str, password: str, database: str) -> str:
        return (
            f"postgresql://{role}:{password}@{admin.host or '127.0.0.1'}:{admin.port or 5432}"
            f"/{database}"
        )

    env = {
        **names,
        **passwords,
        "PGHOST": admin.host or "127.0.0.1",
        "PGPORT": str(admin.port or 5432),
        "PGUSER": admin.username or "postgres",
        "PGDATABASE": admin.database or "postgres",
        "OWNER_URL": url(names["BROKER_OWNER_ROLE"], "owner-pw", names["BROKER_DB_NAME"]),
        "SCHEDULER_LIB_DB": url(names["BROKER_APP_ROLE"], "app-pw", names["BROKER_DB_NAME"]),
        "MONITOR_URL": url(names["BROKER_MONITOR_ROLE"], "monitor-pw", names["BROKER_DB_NAME"]),
        "RESTORE_URL": url(names["BROKER_OWNER_ROLE"], "owner-pw", restore_db),
        "_RESTORE_DB": restore_db,
    }
    if admin.password:
        env["PGPASSWORD"] = admin.password
    (tmp_path / "docker").symlink_to(ROOT / "docker")  # the page names docker/ of a checkout
    engine = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    try:
        yield env
    finally:
        with engine.connect() as conn:
            for database in (names["BROKER_DB_NAME"], names["AIRFLOW_DB_NAME"], restore_db):
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            for key in ("BROKER_OWNER_ROLE", "BROKER_APP_ROLE", "BROKER_MONITOR_ROLE"):
                conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{names[key]}"')
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{names["AIRFLOW_DB_USER"]}"')
        engine.dispose()


@pytest.mark.postgres
def test_operations_guide_runs_on_postgresql(
    postgres_deployment: dict[str, str], postgres_server: str, tmp_path: Path
) -> None:
    blocks = runnable_blocks(OPERATIONS)
    # Given the roles and databases the page's first block makes (docker/postgres-init.sh)
    first = [b for b in blocks if "postgresql" in b.backends or not b.backends]
    assert "docker/postgres-init.sh" in first[0].body
    run_blocks(first[:1], "postgresql", postgres_deployment, tmp_path)
    engine = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        owners = dict(
            conn.exec_driver_sql(
                "SELECT datname, pg_get_userbyid(datdba) FROM pg_database WHERE datname IN "
                f"('{postgres_deployment['BROKER_DB_NAME']}', "
                f"'{postgres_deployment['AIRFLOW_DB_NAME']}')"
            ).all()
        )
        assert owners == {
            postgres_deployment["BROKER_DB_NAME"]: postgres_deployment["BROKER_OWNER_ROLE"],
            postgres_deployment["AIRFLOW_DB_NAME"]: postgres_deployment["AIRFLOW_DB_USER"],
        }
        # And the empty database, owned by the owner role, that the restore block expects
        conn.exec_driver_sql(
            f'CREATE DATABASE "{postgres_deployment["_RESTORE_DB"]}" '
            f'OWNER "{postgres_deployment["BROKER_OWNER_ROLE"]}"'
        )
    engine.dispose()
    # When the other blocks run, Then each exits as the page says, with its output
    ran = run_blocks(first[1:], "postgresql", postgres_deployment, tmp_path)
    assert ran >= 18


def test_the_roles_sql_in_the_guide_is_the_init_scripts() -> None:
    # Given the statements the guide shows and the ones the init script runs
    page = OPERATIONS.read_text()
    shown = re.search(
        r"<!-- the SQL of docker/postgres-init.sh -->\n```sql\n(.*?)^```", page, re.S | re.M
    )
    script = (ROOT / "docker" / "postgres-init.sh").read_text()
    runs = re.search(r"<<'SQL'\n(.*?)^SQL$", script, re.S | re.M)
    # Then they are the same
    assert shown and runs
    assert shown[1] == runs[1]


def _schema_identifiers() -> tuple[set[str], set[tuple[str, str]]]:
    """Tables and views, and (table, column) pairs, of the schema the migrations make
    (the reference DDL in sql/, which a test keeps identical to the migrations)."""
    db = sqlite3.connect(":memory:")
    for name in ("schema_sqlite.sql", "scheduler_sqlite.sql"):
        db.executescript((ROOT / "sql" / name).read_text())
    tables = {
        row[0]
        for row in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
    }
    columns = {
        (table, row[1]) for table in tables for row in db.execute(f'PRAGMA table_info("{table}")')
    }
    return tables, columns


def test_tables_and_columns_named_in_the_architecture_exist() -> None:
    tables, columns = _schema_identifiers()
    text = ARCHITECTURE.read_text()
    # Given every `table.column` the page names (modules of the package aside), Then the
    # schema has it
    pairs = {p for p in re.findall(r"`([a-z_]+)\.([a-z_]+)`", text) if p[0] != "scheduler_lib"}
    assert len(pairs) >= 10
    for table, column in pairs:
        assert (table, column) in columns, f"architecture.md names {table}.{column}"
    # And every table of the diagrams (participants, and [(table)] nodes) exists
    named = set(re.findall(r"participant \w+ as ([a-z_]+)", text))
    named |= set(re.findall(r"\[\(([a-z_]+)\)\]", text))
    assert len(named) >= 6
    assert named <= tables, f"not in the schema: {named - tables}"
    # And every other `snake_case` name is a table, a column, or a word of the package's
    # code (a function, a named query, a task kind)
    code = " ".join(
        path.read_text()
        for ext in ("py", "sql")
        for path in (ROOT / "scheduler_lib").rglob(f"*.{ext}")
    )
    column_names = {column for _, column in columns}
    for name in set(re.findall(r"`([a-z][a-z0-9_]*_[a-z0-9_]*)`", text)):
        if name not in tables and name not in column_names:
            assert re.search(rf"\b{name}\b", code), f"architecture.md names {name}"
    # And every `scheduler-lib <command>` it names is a command
    from scheduler_lib.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for command in re.findall(r"scheduler-lib ([a-z]+)", text):
        assert command in commands, f"architecture.md names scheduler-lib {command}"
