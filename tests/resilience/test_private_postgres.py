"""The private PostgreSQL fixture: connections work, and restarts, crashes and outages
do what resilience tests expect of them — without touching the shared server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from private_postgres import PrivatePostgres
from psycopg.rows import TupleRow

pytestmark = pytest.mark.postgres


def _connect(url: str) -> psycopg.Connection[TupleRow]:
    return psycopg.connect(url, autocommit=True, connect_timeout=5)


def _committed_row(url: str, value: str) -> None:
    with _connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS kept (value text)")
        conn.execute("INSERT INTO kept VALUES (%s)", (value,))


def _rows(url: str) -> list[str]:
    with _connect(url) as conn:
        return [str(row[0]) for row in conn.execute("SELECT value FROM kept ORDER BY value")]


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie its adoptive parent has not reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_connects_to_a_private_postgresql(
    private_postgres: PrivatePostgres, private_db_url: str
) -> None:
    assert private_postgres.port != 5432
    assert (
        private_postgres.url == f"postgresql://postgres@127.0.0.1:{private_postgres.port}/postgres"
    )
    with _connect(private_db_url) as conn:
        row = conn.execute("SELECT current_database(), current_setting('server_version_num')")
        dbname, version = row.fetchone() or ("", "0")
    assert private_db_url.endswith(f"/{dbname}")
    assert int(str(version)) >= 150000
    assert private_postgres.is_accepting()


def test_restart_breaks_old_connections_and_keeps_committed_data(
    private_postgres: PrivatePostgres, private_db_url: str
) -> None:
    _committed_row(private_db_url, "before restart")
    old = _connect(private_db_url)
    try:
        private_postgres.restart()
        assert private_postgres.is_accepting()
        with pytest.raises(psycopg.OperationalError):
            old.execute("SELECT 1")
    finally:
        old.close()
    assert _rows(private_db_url) == ["before restart"]


def test_kill_then_start_recovers_committed_data(
    private_postgres: PrivatePostgres, private_db_url: str
) -> None:
    _committed_row(private_db_url, "before crash")
    old = _connect(private_db_url)
    try:
        private_postgres.kill()
        assert not private_postgres.is_accepting()
        with pytest.raises(psycopg.OperationalError):
            _connect(private_db_url)
        private_postgres.start()
        with pytest.raises(psycopg.OperationalError):
            old.execute("SELECT 1")
    finally:
        old.close()
    assert _rows(private_db_url) == ["before crash"]
    assert "automatic recovery in progress" in private_postgres.log_tail(200)


def test_stop_for_is_an_outage_of_that_length(
    private_postgres: PrivatePostgres, private_db_url: str
) -> None:
    seen: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(private_postgres.is_accepting())
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        started = time.monotonic()
        stopped_at, accepting_again_at = private_postgres.stop_for(1.0)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert started <= stopped_at < accepting_again_at <= time.monotonic()
    assert accepting_again_at - stopped_at >= 1.0
    assert False in seen, "the watcher never saw the server down"
    assert private_postgres.is_accepting()
    with _connect(private_db_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_terminate_backends_disconnects_that_database_only(
    private_postgres: PrivatePostgres, private_db_url: str
) -> None:
    dbname = private_db_url.rsplit("/", 1)[1]
    victims = [_connect(private_db_url), _connect(private_db_url)]
    bystander = _connect(private_postgres.url)
    try:
        assert private_postgres.terminate_backends(dbname) == 2
        for conn in victims:
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)
    finally:
        for conn in [*victims, bystander]:
            conn.close()


def test_close_stops_the_server_and_removes_its_files(private_postgres_available: None) -> None:
    server = PrivatePostgres()
    root = server.root
    pid = int((server.datadir / "postmaster.pid").read_text().split()[0])
    assert server.is_accepting()
    server.close()
    server.close()  # idempotent
    assert not Path(root).exists()
    assert not _running(pid)
    assert not server.is_accepting()
    with pytest.raises(RuntimeError, match="closed"):
        server.start()
