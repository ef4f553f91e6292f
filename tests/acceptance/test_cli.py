"""The scheduler-lib command, run as a user would: in a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import sqlalchemy as sa

from scheduler_lib.broker import Broker, Message, Transaction, schema
from scheduler_lib.broker.db import engine
from scheduler_lib.broker.poison import Log, PoisonDetector, PoisonPolicy


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_lib.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_init_creates_the_schema_then_is_idempotent(db_url: str) -> None:
    # Given an empty database
    # When init runs twice
    first = _cli("init", "--db", db_url)
    second = _cli("init", "--db", db_url)
    # Then the first creates the schema, the second changes nothing, both succeed
    assert first.returncode == 0, first.stderr
    assert "upgraded from empty to" in first.stdout
    assert second.returncode == 0, second.stderr
    assert "already at revision" in second.stdout
    eng = engine.create_engine(db_url)
    try:
        assert schema.current(eng) == schema.head()
    finally:
        eng.dispose()
    # And the broker works on it without migrating again
    with Broker(db_url, migrate=False, timers=False) as broker:
        assert "DEFAULT" in broker.message_types()


def test_init_reads_the_url_from_the_environment(sqlite_url: str) -> None:
    # Given SCHEDULER_LIB_DB set and no --db
    result = _cli("init", env={"SCHEDULER_LIB_DB": sqlite_url})
    # Then that database is initialised
    assert result.returncode == 0, result.stderr
    eng = sa.create_engine(sqlite_url)
    try:
        assert "queue_messages" in sa.inspect(eng).get_table_names()
    finally:
        eng.dispose()


def test_init_with_a_bad_url_names_the_problem() -> None:
    # Given a URL of a backend the broker does not support
    result = _cli("init", "--db", "mysql://localhost/x")
    # Then the command fails with a clear message and no traceback
    assert result.returncode == 2
    assert "unsupported database backend 'mysql'" in result.stderr
    assert "Traceback" not in result.stderr


def _poison_catalog(broker: Broker) -> None:
    broker.create_queue("InitiatorQueue")
    broker.create_queue("TargetQueue", poison_message_handling=False)
    broker.create_service("InitiatorService", "InitiatorQueue")
    broker.create_service("TargetService", "TargetQueue", ["DEFAULT"])


def test_poison_list_show_replay_drop(db_url: str) -> None:
    # Given three poison messages logged by a detector (one per conversation)
    with Broker(db_url, timers=False) as broker:
        _poison_catalog(broker)
        for body in ("alpha", "bravo", "charlie"):
            handle = broker.begin_dialog("InitiatorService", "TargetService")
            broker.send(handle, "DEFAULT", f"body of {body}")

        def fail(tx: Transaction, message: Message) -> None:
            raise ValueError(f"cannot parse {message.text}")

        detector = PoisonDetector(
            broker, "TargetQueue", PoisonPolicy(threshold=1, dispositions=(Log(),))
        )
        while detector.handle_next(fail, timeout=0):
            pass
        ids = {p.message.text: p.poison_id for p in broker.poison_messages()}
    assert len(ids) == 3
    # When an operator lists them
    listed = _cli("poison", "list", "--db", db_url)
    assert listed.returncode == 0, listed.stderr
    for poison_id in ids.values():
        assert re.search(rf"^{poison_id}\s+LOGGED\s+TargetQueue", listed.stdout, re.MULTILINE)
    assert "ValueError: cannot parse" in listed.stdout
    # ... shows one: its body and failure history
    shown = _cli("poison", "show", "--db", db_url, str(ids["body of bravo"]))
    assert shown.returncode == 0, shown.stderr
    assert "body of bravo" in shown.stdout and "FAILED" in shown.stdout
    assert "body of alpha" not in shown.stdout
    # ... replays exactly two of them
    replayed = _cli(
        "poison", "replay", "--db", db_url, str(ids["body of alpha"]), str(ids["body of charlie"])
    )
    assert replayed.returncode == 0, replayed.stderr
    assert "replayed 2 poison message(s)" in replayed.stdout
    # Then exactly those are back on their queue, and only the third stays logged
    with Broker(db_url, migrate=False, timers=False) as broker:
        assert sorted(m.text or "" for m in broker.peek("TargetQueue")) == [
            "body of alpha",
            "body of charlie",
        ]
        assert [p.poison_id for p in broker.poison_messages()] == [ids["body of bravo"]]
    # When the operator drops the third, and names one that does not exist
    dropped = _cli("poison", "drop", "--db", db_url, str(ids["body of bravo"]))
    assert dropped.returncode == 0, dropped.stderr
    missing = _cli("poison", "replay", "--db", db_url, "999")
    # Then it is gone, and the unknown id is named without a traceback
    assert _cli("poison", "list", "--db", db_url).stdout.strip() == "no poison messages"
    assert missing.returncode == 2
    assert "poison message 999 does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = _cli("poison", "drop", "--db", db_url, "abc")
    assert bad.returncode == 2 and "a poison id is a positive integer" in bad.stderr


def test_queues_shows_a_disabled_queue_and_why(db_url: str) -> None:
    # Given a queue that poison message handling turned off
    with Broker(db_url, timers=False) as broker:
        _poison_catalog(broker)
        broker.alter_queue("TargetQueue", poison_message_handling=True)
        handle = broker.begin_dialog("InitiatorService", "TargetService")
        broker.send(handle, "DEFAULT", "poison")
        for _ in range(5):
            with contextlib.suppress(RuntimeError), broker.transaction() as tx:
                assert tx.receive("TargetQueue", timeout=0)
                raise RuntimeError("handler failed")
        assert not broker.queue("TargetQueue").is_receive_enabled
    # When the operator looks at the queues
    result = _cli("queues", "--db", db_url)
    # Then the queue shows as off, with the reason
    assert result.returncode == 0, result.stderr
    assert re.search(r"^TargetQueue\s+OFF", result.stdout, re.MULTILINE)
    assert re.search(
        r"^TargetQueue\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\s+"
        r"poison message handling: 5 consecutive rollbacks",
        result.stdout,
        re.MULTILINE,
    )
    assert "alter_queue(name, status=True)" in result.stdout


def test_routes_command_creates_lists_and_drops_and_shows_what_waits(db_url: str) -> None:
    # Given a broker (made by init) with a dialog to a service reached by a route nobody serves
    assert _cli("init", "--db", db_url, "--no-scheduler").returncode == 0
    create = _cli("routes", "--db", db_url, "create", "to spark", "Far", "tcp://127.0.0.1:9")
    assert create.returncode == 0, create.stderr
    assert re.search(r"to spark\s+Far\s+ANY\s+tcp://127\.0\.0\.1:9", create.stdout)
    with Broker(db_url, timers=False) as broker:
        instance = broker.broker_instance
        broker.create_queue("Q")
        broker.create_service("Near", "Q")
        handle = broker.begin_dialog("Near", "Far")
        broker.send(handle, "DEFAULT", b"waiting")
    # When the routes are listed
    listing = _cli("routes", "--db", db_url)
    # Then the broker's id, the route and the waiting message are shown
    assert listing.returncode == 0, listing.stderr
    assert f"broker instance {instance}" in listing.stdout
    assert re.search(r"\bFar\s+0\s+DEFAULT\b.*in flight", listing.stdout)
    # And a bad address is refused by name; drop removes the route
    bad = _cli("routes", "--db", db_url, "create", "bad", "Far", "nowhere")
    assert bad.returncode == 2 and "route address must be" in bad.stderr
    dropped = _cli("routes", "--db", db_url, "drop", "to spark")
    assert dropped.returncode == 0, dropped.stderr
    assert "to spark" not in dropped.stdout


def test_serve_listen_needs_a_transport_key(sqlite_url: str) -> None:
    env = {"SCHEDULER_LIB_TRANSPORT_KEY": ""}
    result = _cli("serve", "--db", sqlite_url, "--listen", "127.0.0.1:0", env=env)
    assert result.returncode == 2
    assert "needs a key" in result.stderr and "--key-file" in result.stderr
