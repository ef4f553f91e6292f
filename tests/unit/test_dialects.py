"""The broker's strategies per database (scheduler_lib/broker/db/dialects.py) agree with the
statements each dialect ships: a capability resting on named statements is on exactly
where the dialect has all of them, so code that asks the capability never reaches for a
statement that is not there, and no fast path is left unused."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from scheduler_lib.broker.db import dialects, queries
from scheduler_lib.broker.db.store import Store


@pytest.mark.parametrize("dialect", sorted(dialects.DIALECTS))
def test_a_capability_is_on_exactly_where_its_statements_exist(dialect: str) -> None:
    # Given the dialect's strategies and the broker's statements for it
    features = dialects.of(dialect)
    statements = set(queries.for_dialect(dialect))
    for capability, needed in dialects.Dialect.STATEMENTS.items():
        # Then the capability is on if and only if every statement it rests on is there
        present = [name for name in needed if name in statements]
        assert getattr(features, capability) == (len(present) == len(needed)), (
            f"{dialect}: {capability} is {getattr(features, capability)}, "
            f"its statements present: {present} of {list(needed)}"
        )
        # and none of them exists without the others (a half-built fast path)
        assert present in ([], list(needed)), f"{dialect}: {capability} has only {present}"


def test_every_dialect_only_statement_belongs_to_a_capability() -> None:
    # Given the statements one dialect has and another lacks
    common = set.intersection(*(set(queries.for_dialect(d)) for d in dialects.DIALECTS))
    owned = {name for names in dialects.Dialect.STATEMENTS.values() for name in names}
    for dialect in dialects.DIALECTS:
        own = set(queries.for_dialect(dialect)) - common
        # Then each is named by a capability (asked for, never probed by its name)
        assert own <= owned, f"{dialect}: statements no capability names: {sorted(own - owned)}"


def test_the_store_picks_its_dialects_strategies_once() -> None:
    # Given a store on each database the broker runs on
    for name, dialect in (
        ("sqlite", sa.create_engine("sqlite://").dialect),
        ("postgresql", sa.create_engine("postgresql+psycopg://").dialect),
    ):
        # Then its features are that dialect's
        assert Store(dialect).features is dialects.of(name)


def test_an_unknown_database_is_named_with_the_ones_the_broker_runs_on() -> None:
    with pytest.raises(ValueError, match=r"runs on postgresql or sqlite, not 'mysql'"):
        dialects.of("mysql")
