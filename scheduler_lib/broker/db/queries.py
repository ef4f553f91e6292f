"""Loads the broker's named SQL queries from the package, once per dialect."""

from __future__ import annotations

import functools
import importlib.resources
import re

from sqlalchemy import TextClause, text

_HEADER = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"^\s*-- include: (\w+)\s*$")


def parse(source: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into ``{name: sql}`` (comments dropped).

    A ``-- fragment: f`` block is SQL that several queries share (the same column list,
    the same filters): a line ``-- include: f`` in a later block stands for its text.
    Fragments are not queries; a file's fragments serve that file only.

    :param source: the file's text
    :return: the queries by name, each without its header, description or trailing ``;``
    """
    for line in source.splitlines():
        if line.startswith(("-- name:", "-- fragment:")) and not _HEADER.match(line):
            raise ValueError(f"malformed query header {line!r}: names are letters, digits, _")
        if line.lstrip().startswith("-- include:") and not _INCLUDE.match(line):
            raise ValueError(f"malformed include {line!r}: names are letters, digits, _")
    queries: dict[str, str] = {}
    fragments: dict[str, str] = {}
    parts = _HEADER.split(source)
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        lines = []
        for line in body.splitlines():
            if included := _INCLUDE.match(line):
                if included[1] not in fragments:
                    raise ValueError(
                        f"query {name!r} includes {included[1]!r}, "
                        "which no fragment above it defines"
                    )
                lines.append(fragments[included[1]])
            elif not line.lstrip().startswith("--"):
                lines.append(line)
        sql = "\n".join(lines).strip().rstrip(";").strip()
        if not sql:
            raise ValueError(f"query {name!r} has no SQL")
        if name in queries or name in fragments:
            raise ValueError(f"query {name!r} is defined twice")
        (queries if kind == "name" else fragments)[name] = sql
    return queries


def _read(filename: str, package: str = "scheduler_lib.broker.db") -> str:
    return (importlib.resources.files(package) / "sql" / filename).read_text()


@functools.cache
def for_dialect(dialect: str, package: str = "scheduler_lib.broker.db") -> dict[str, TextClause]:
    """A package's queries for a dialect: its ``sql/queries.sql`` with the dialect's
    overrides (``sql/queries_<dialect>.sql``) on top.

    :param dialect: SQLAlchemy dialect name (``sqlite``, ``postgresql``)
    :param package: the package whose ``sql/`` folder holds the files
    """
    queries = parse(_read("queries.sql", package))
    try:
        overrides = parse(_read(f"queries_{dialect}.sql", package))
    except FileNotFoundError:
        overrides = {}
    # A dialect may also add queries of its own (fast paths): the broker asks its dialect's
    # features (dialects.py), a layer above asks Store.has().
    queries.update(overrides)
    return {name: text(sql) for name, sql in queries.items()}
