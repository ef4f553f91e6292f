"""Loads the broker's named SQL queries from the package, once per dialect."""

from __future__ import annotations

import functools
import importlib.resources
import re

from sqlalchemy import TextClause, text

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse(source: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into ``{name: sql}`` (comments dropped).

    :param source: the file's text
    :return: the queries by name, each without its header, description or trailing ``;``
    """
    queries: dict[str, str] = {}
    for line in source.splitlines():
        if line.startswith("-- name:") and not _HEADER.match(line):
            raise ValueError(f"malformed query header {line!r}: names are letters, digits, _")
    parts = _HEADER.split(source)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        sql = "\n".join(lines).strip().rstrip(";").strip()
        if not sql:
            raise ValueError(f"query {name!r} has no SQL")
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = sql
    return queries


def _read(filename: str, package: str = "scheduler_lib.broker") -> str:
    return (importlib.resources.files(package) / "sql" / filename).read_text()


@functools.cache
def for_dialect(dialect: str, package: str = "scheduler_lib.broker") -> dict[str, TextClause]:
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
    # A dialect may also add queries of its own (fast paths); callers ask Store.has().
    queries.update(overrides)
    return {name: text(sql) for name, sql in queries.items()}
