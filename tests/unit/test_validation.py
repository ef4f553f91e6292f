"""Unit tests of the argument and body checks (``validation``) and of the named-query
file parser (``queries.parse`` / ``queries.for_dialect``). No database."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest

from scheduler_lib.broker import exceptions
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import connections, queries
from scheduler_lib.broker.models import Validation

# --- name ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["q", "Target Queue", "x" * checks.NAME_MAX_LENGTH])
def test_name_accepts_non_empty_strings_up_to_128(value: str) -> None:
    # Given a non-empty name of at most 128 characters
    # When it is checked
    # Then it comes back unchanged
    assert checks.name(value, "queue name") == value


@pytest.mark.parametrize("value", ["", "   ", "x" * 129, None, 5, b"queue"])
def test_name_rejects_empty_long_and_non_strings(value: object) -> None:
    # Given an empty, blank, over-long or non-string name
    # When it is checked
    # Then InvalidArgument naming what was checked
    with pytest.raises(exceptions.InvalidArgument, match="queue name"):
        checks.name(value, "queue name")


# --- handle --------------------------------------------------------------------------


def test_handle_returns_canonical_text() -> None:
    # Given one UUID in several spellings
    value = uuid.uuid4()
    spellings = [value, str(value), str(value).upper(), value.hex, "{" + str(value) + "}"]
    # When each is checked
    # Then each comes back as the canonical lower-case text
    assert {checks.handle(s) for s in spellings} == {str(value)}


# (a UUID's bytes are not its text; fixed bytes, so that every run collects the same ids)
@pytest.mark.parametrize(
    "value", ["not-a-uuid", "", "1234", None, 1234, uuid.UUID(int=0x1234).bytes]
)
def test_handle_rejects_non_uuids(value: object) -> None:
    # Given something that is not a UUID or its text
    # When it is checked
    # Then InvalidArgument naming what was checked
    with pytest.raises(exceptions.InvalidArgument, match="conversation group id"):
        checks.handle(value, "conversation group id")


# --- timeout -------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(None, None), (0, 0.0), (2, 2.0), (0.25, 0.25)])
def test_timeout_accepts_none_and_non_negative_numbers(
    value: float | None, expected: float | None
) -> None:
    # Given None (wait forever) or a number of seconds >= 0
    # When it is checked
    result = checks.timeout(value)
    # Then it comes back as a float (or None)
    assert result == expected
    assert result is None or type(result) is float


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, "1", True, False, [1], 1j])
def test_timeout_rejects_negative_nan_and_non_numbers(value: object) -> None:
    # Given a negative number, NaN, a bool or a non-number
    # When it is checked
    # Then InvalidArgument naming what was checked
    with pytest.raises(exceptions.InvalidArgument, match="lifetime"):
        checks.timeout(value, "lifetime")


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_timeout_rejects_infinity(value: float) -> None:
    # Given an infinite number of seconds (the docstring promises "a finite number")
    # When it is checked
    # Then InvalidArgument: None is the way to say "forever", and an infinite timer or
    # lifetime would be stored as a deadline that never comes
    with pytest.raises(exceptions.InvalidArgument):
        checks.timeout(value)


# --- positive_int --------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 2, 10_000])
def test_positive_int_accepts_integers_from_one(value: int) -> None:
    assert checks.positive_int(value, "top") == value


@pytest.mark.parametrize("value", [0, -1, 1.0, 1.5, "1", True, None])
def test_positive_int_rejects_the_rest(value: object) -> None:
    # Given zero, a negative number, a float, text, a bool or None
    # When it is checked
    # Then InvalidArgument naming what was checked
    with pytest.raises(exceptions.InvalidArgument, match="top"):
        checks.positive_int(value, "top")


# --- body_bytes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (None, None),
        (b"", b""),
        (b"abc", b"abc"),
        (bytearray(b"abc"), b"abc"),
        (memoryview(b"abc"), b"abc"),
        ("héllo", "héllo".encode()),
    ],
)
def test_body_bytes_converts_to_bytes(body: checks.Body, expected: bytes | None) -> None:
    # Given a body of a supported type
    # When it is converted
    result = checks.body_bytes(body, 100)
    # Then it is bytes (str as UTF-8), or None
    assert result == expected
    assert result is None or type(result) is bytes


@pytest.mark.parametrize("body", [5, 1.5, {"a": 1}, [b"x"], object()])
def test_body_bytes_rejects_other_types(body: object) -> None:
    # Given a body of an unsupported type
    # When it is converted
    # Then InvalidArgument naming the type
    with pytest.raises(exceptions.InvalidArgument, match=type(body).__name__):
        checks.body_bytes(body, 100)  # type: ignore[arg-type]


def test_body_bytes_limit_is_inclusive_and_counts_utf8_bytes() -> None:
    # Given a limit of 10 bytes
    # When bodies of exactly 10 bytes are converted
    # Then they pass
    assert checks.body_bytes(b"x" * 10, 10) == b"x" * 10
    assert checks.body_bytes("é" * 5, 10) == "é".encode() * 5
    # When a body is one byte over (bytes, or text that is 6 characters but 11 bytes)
    # Then MessageTooLarge
    with pytest.raises(exceptions.MessageTooLarge):
        checks.body_bytes(b"x" * 11, 10)
    with pytest.raises(exceptions.MessageTooLarge):
        checks.body_bytes("é" * 5 + "x", 10)


# --- check_body ----------------------------------------------------------------------


@pytest.mark.parametrize("validation", list(Validation))
@pytest.mark.parametrize("body", [None, b""])
def test_empty_bodies_pass_every_validation(validation: Validation, body: bytes | None) -> None:
    # Given an empty body (no body, or zero bytes)
    # When any validation is applied
    # Then it passes
    checks.check_body("T", validation, body)


@pytest.mark.parametrize("body", [b"anything", b"\xff\xfe", b"<a>", b"{"])
def test_validation_none_accepts_anything(body: bytes) -> None:
    checks.check_body("T", Validation.NONE, body)


@pytest.mark.parametrize("body", [b"x", b" ", b"\x00"])
def test_validation_empty_rejects_any_byte(body: bytes) -> None:
    # Given a body of at least one byte
    # When validation EMPTY is applied
    # Then InvalidMessageBody naming the message type
    with pytest.raises(exceptions.InvalidMessageBody, match="'Ping'"):
        checks.check_body("Ping", Validation.EMPTY, body)


@pytest.mark.parametrize(
    "body",
    [
        b"<a/>",
        b"<?xml version='1.0' encoding='utf-8'?><job id='1'><step>x</step></job>",
        "<t>héllo</t>".encode(),
        b"<a><!-- comment --><b>&amp;</b></a>",
    ],
)
def test_well_formed_xml_passes(body: bytes) -> None:
    checks.check_body("X", Validation.WELL_FORMED_XML, body)


@pytest.mark.parametrize(
    "body",
    [b"<a>", b"<a><b></a>", b"<a/><b/>", b"plain text", b"<a>&undefined;</a>", b"<a x=1/>"],
)
def test_malformed_xml_fails(body: bytes) -> None:
    # Given a body that is not well-formed XML
    # When WELL_FORMED_XML is applied
    # Then InvalidMessageBody naming the type
    with pytest.raises(exceptions.InvalidMessageBody, match="'X'"):
        checks.check_body("X", Validation.WELL_FORMED_XML, body)


@pytest.mark.parametrize(
    "body", [b'{"a": [1, 2.5, null, true]}', b"[]", b'"text"', b"42", '{"k": "é"}'.encode()]
)
def test_json_passes(body: bytes) -> None:
    checks.check_body("J", Validation.JSON, body)


@pytest.mark.parametrize(
    "body", [b"{'a': 1}", b'{"a": ', b"undefined", b" ", b'"\xff"', b"[1,]", b"{} {}"]
)
def test_malformed_json_fails(body: bytes) -> None:
    # Given a body that is not JSON (or not UTF-8)
    # When JSON validation is applied
    # Then InvalidMessageBody naming the type
    with pytest.raises(exceptions.InvalidMessageBody, match="'J'"):
        checks.check_body("J", Validation.JSON, body)


@pytest.mark.parametrize("body", [b"NaN", b'{"a": Infinity}', b"[-Infinity]"])
def test_json_rejects_non_standard_constants(body: bytes) -> None:
    # Given a body with NaN / Infinity, which Python's json accepts but JSON (RFC 8259)
    # does not, so other readers (JavaScript, PostgreSQL jsonb) would reject it
    # When JSON validation is applied
    # Then InvalidMessageBody
    with pytest.raises(exceptions.InvalidMessageBody):
        checks.check_body("J", Validation.JSON, body)


# --- queries.parse -------------------------------------------------------------------

SOURCE = """\
-- A file header that belongs to no query.

-- name: first
-- What the first query does.
SELECT 1;

-- name: second
-- Two lines of description,
-- both dropped.
SELECT a,
       b -- an inline comment stays
FROM t
WHERE a = :a;
"""


def test_parse_splits_named_queries_and_drops_comments() -> None:
    # Given a file of two named queries with descriptions and a header
    # When it is parsed
    parsed = queries.parse(SOURCE)
    # Then each query is its SQL without header, description lines or trailing ';'
    assert parsed == {
        "first": "SELECT 1",
        "second": "SELECT a,\n       b -- an inline comment stays\nFROM t\nWHERE a = :a",
    }


def test_parse_of_text_without_queries_is_empty() -> None:
    assert queries.parse("-- only a comment\n") == {}
    assert queries.parse("") == {}


def test_parse_rejects_a_query_without_sql() -> None:
    # Given a named block holding only comments
    source = "-- name: empty\n-- nothing here\n\n-- name: ok\nSELECT 1;\n"
    # When it is parsed
    # Then ValueError naming the query
    with pytest.raises(ValueError, match="'empty'"):
        queries.parse(source)


def test_parse_rejects_a_name_defined_twice() -> None:
    # Given the same name twice
    source = "-- name: q\nSELECT 1;\n-- name: q\nSELECT 2;\n"
    # When it is parsed
    # Then ValueError naming the query
    with pytest.raises(ValueError, match=r"'q'.*twice"):
        queries.parse(source)


def test_parse_rejects_a_malformed_header_instead_of_merging_queries() -> None:
    # Given a header whose name has a character \w does not match
    source = "-- name: good\nSELECT 1;\n\n-- name: bad-name\nSELECT 2;\n"
    # When it is parsed
    # Then ValueError: silently treating the header as a comment would glue
    # "SELECT 2" onto query "good" and lose "bad-name"
    with pytest.raises(ValueError):
        queries.parse(source)


def test_parse_keeps_semicolons_inside_the_statement() -> None:
    # Given a statement with a ';' inside a literal and a trailing one
    parsed = queries.parse("-- name: q\nSELECT ';' AS s;\n")
    # Then only the trailing ';' is removed
    assert parsed == {"q": "SELECT ';' AS s"}


def test_a_fragment_stands_in_for_its_include_and_is_not_a_query() -> None:
    # Given a column list and a filter two queries share, as fragments
    source = """\
-- fragment: row
-- the columns
SELECT a, b FROM t
-- fragment: newest
ORDER BY a DESC LIMIT :limit;
-- name: all_rows
-- include: row
WHERE 1 = 1
-- include: newest
-- name: of_b
-- include: row
WHERE b = :b
  -- include: newest
"""
    # When the file is parsed
    parsed = queries.parse(source)
    # Then each query has the fragments' SQL in place of its includes, and only the
    # named blocks are queries
    assert parsed == {
        "all_rows": "SELECT a, b FROM t\nWHERE 1 = 1\nORDER BY a DESC LIMIT :limit",
        "of_b": "SELECT a, b FROM t\nWHERE b = :b\nORDER BY a DESC LIMIT :limit",
    }


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("-- name: q\n-- include: later\nSELECT 1;\n-- fragment: later\nSELECT 2;\n", "'later'"),
        ("-- fragment: f\nSELECT 1;\n-- name: q\n-- include: f-g\n", "malformed include"),
        ("-- fragment: q\nSELECT 1;\n-- name: q\nSELECT 2;\n", r"'q'.*twice"),
        ("-- fragment: bad-name\nSELECT 1;\n", "malformed query header"),
    ],
    ids=[
        "included-before-defined",
        "malformed-include",
        "name-of-a-fragment",
        "malformed-fragment",
    ],
)
def test_parse_rejects_a_broken_fragment(source: str, message: str) -> None:
    # Given an include of a fragment defined only below it, a malformed include, a query
    # named as a fragment, a malformed fragment header
    # When it is parsed
    # Then ValueError naming what is wrong (an include left as a comment would drop SQL)
    with pytest.raises(ValueError, match=message):
        queries.parse(source)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_shipped_query_files_load_for_each_dialect(dialect: str) -> None:
    # Given the query files in the package
    # When they are loaded for a dialect
    loaded = queries.for_dialect(dialect)
    common = queries.parse(queries._read("queries.sql"))
    # Then every common query is there, none empty
    assert set(common) <= set(loaded)
    assert all(str(q).strip() for q in loaded.values())


# Query names that code composes rather than spells out: name -> where
COMPOSED = {"receive_take_conversation_retained": "Transaction: the take of a RETENTION queue"}


def test_every_named_query_has_a_caller() -> None:
    # Given the named queries of the broker and of the scheduler, for both dialects
    names: set[str] = set()
    for package in ("scheduler_lib.broker.db", "scheduler_lib.scheduler"):
        for dialect in ("sqlite", "postgresql"):
            names |= set(queries.for_dialect(dialect, package))
    # When the library's code is searched for each name, as a string
    code = "\n".join(p.read_text() for p in Path(queries.__file__).parents[2].rglob("*.py"))
    # Then each is called somewhere (a query nobody runs is dead SQL to keep in step)
    called = {n for n in names if f'"{n}"' in code or f"'{n}'" in code}
    assert sorted(names - called - set(COMPOSED)) == []
    assert set(COMPOSED) <= names


def test_postgresql_overrides_replace_common_queries() -> None:
    # Given the PostgreSQL file (overrides of common queries, and fast paths of its own)
    overrides = queries.parse(queries._read("queries_postgresql.sql"))
    common = queries.parse(queries._read("queries.sql"))
    # When the PostgreSQL queries are loaded
    loaded = queries.for_dialect("postgresql")
    # Then every PostgreSQL query wins over the common one of its name
    assert set(overrides) & set(common)
    for name, sql in overrides.items():
        assert str(loaded[name]) == sql
    # and the common queries it does not override are the common text
    for name in set(common) - set(overrides):
        assert str(loaded[name]) == common[name]


def test_unknown_dialect_gets_the_common_queries() -> None:
    # Given a dialect without an override file
    loaded = queries.for_dialect("no_such_dialect")
    # Then it gets exactly the common queries
    assert {name: str(q) for name, q in loaded.items()} == queries.parse(
        queries._read("queries.sql")
    )


def test_the_schedulers_queries_do_not_reuse_broker_names() -> None:
    # Given the broker's queries and the scheduler's, per dialect
    for dialect in ("sqlite", "postgresql"):
        broker = queries.for_dialect(dialect)
        scheduler = queries.for_dialect(dialect, "scheduler_lib.scheduler")
        # Then the two sets of names are apart (Store.extend refuses a clash)
        assert scheduler and not set(scheduler) & set(broker)


# --- the reconnect deadline ----------------------------------------------------------


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "-1", "soon"])
def test_the_reconnect_timeout_from_the_environment_is_a_finite_number(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given SCHEDULER_LIB_RECONNECT_TIMEOUT set to what is no deadline (the option refuses
    # the same values)
    monkeypatch.setenv(connections.RECONNECT_TIMEOUT_ENV, raw)
    # Then the broker refuses it, naming the variable to fix
    with pytest.raises(exceptions.InvalidArgument, match="finite number of seconds"):
        connections.reconnect_timeout()
    monkeypatch.setenv(connections.RECONNECT_TIMEOUT_ENV, "2.5")
    assert connections.reconnect_timeout() == 2.5
