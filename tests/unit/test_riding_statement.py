"""``Store.riding``: a layer's ``INSERT ... SELECT`` (no FROM) becomes a CTE of the
one-statement SEND that selects FROM its ``sender`` row, with its binds renamed apart
from the SEND's; any other statement cannot ride (the caller pipelines it instead)."""

from __future__ import annotations

import re

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from scheduler_lib.broker.db import store


def _store(**layer: str) -> store.Store:
    s = store.Store(postgresql.psycopg.dialect())
    s._queries.update({name: sa.text(sql) for name, sql in layer.items()})
    return s


def test_an_insert_select_rides_inside_the_send_guarded_by_its_sender_row() -> None:
    s = _store(row="INSERT INTO t (a, b) SELECT CAST(:a AS bigint), :body;")
    name = s.riding("send_fast", "row")
    assert name == "send_fast+row"
    text = s._queries[name].text
    # The row is a CTE of the SEND that writes only with its sender row
    assert re.search(
        r"before_row AS \(\s*INSERT INTO t \(a, b\) SELECT .*\s+FROM sender\s*\)", text, re.S
    )
    # Its binds are renamed apart from the SEND's (which has a :body of its own)
    assert ":before_a" in text and ":before_body" in text and ":body" in text
    assert store.before_binds({"a": 1, "body": "x"}) == {"before_a": 1, "before_body": "x"}
    # The SEND's own final SELECT still answers (its row, or none: take the checked path)
    assert text.rstrip().endswith("AS c")
    assert s.riding("send_fast", "row") == name  # built once


def test_a_statement_with_a_from_or_values_does_not_ride() -> None:
    s = _store(
        values="INSERT INTO t (a) VALUES (:a)",
        from_=("INSERT INTO t (a) SELECT x FROM unnest(CAST(:xs AS int[])) AS u(x)"),
        update="UPDATE t SET a = :a",
    )
    assert s.riding("send_fast", "values") is None
    assert s.riding("send_fast", "from_") is None
    assert s.riding("send_fast", "update") is None


def test_an_update_with_a_where_rides_from_the_sender_row_without_its_columns() -> None:
    s = _store(
        finish="UPDATE t SET status = :status, end_time = :now WHERE id = :id AND who = :w;",
        joined="UPDATE t SET a = u.a FROM u WHERE t.id = u.id AND u.k = :k",
    )
    name = s.riding("send_fast", "finish")
    assert name == "send_fast+finish"
    text = s._queries[name].text
    # Written only where the sender row is: an UPDATE FROM it, under a name of no column
    # of the sender's (message_sequence_number, fair_at), then its own WHERE
    assert re.search(
        r"before_row AS \(\s*UPDATE t SET status = :before_status, end_time = :before_now\s+"
        r"FROM \(SELECT 1 AS before_sent FROM sender\) AS before_sent\s+"
        r"WHERE id = :before_id AND who = :before_w\s*\)",
        text,
    )
    assert text.rstrip().endswith("AS c")
    # An UPDATE that reads another table already cannot ride
    assert s.riding("send_fast", "joined") is None
