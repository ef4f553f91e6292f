"""Two brokers (two databases) that talk through their transport endpoints.

Each pair is built once per backend combination: SQLite -> PostgreSQL and PostgreSQL ->
SQLite. Broker A hosts the initiator service, broker B the target service; each has a
route to the other's service (through a fault-injecting proxy when a test asks for one).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lib.broker import Broker

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))  # multiproc: poll

from transport_catalog import make_catalog


@pytest.fixture(
    params=[
        pytest.param(("sqlite", "postgresql"), marks=pytest.mark.postgres, id="sqlite-to-pg"),
        pytest.param(("postgresql", "sqlite"), marks=pytest.mark.postgres, id="pg-to-sqlite"),
    ]
)
def pair_urls(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """URLs of broker A (initiator side) and broker B (target side)."""
    urls = []
    for side, backend in zip("ab", request.param, strict=True):
        if backend == "sqlite":
            urls.append(f"sqlite:///{tmp_path / f'broker_{side}.db'}")
        else:
            urls.append(str(request.getfixturevalue("postgres_url")))
    return urls[0], urls[1]


@pytest.fixture
def pair(pair_urls: tuple[str, str]) -> Iterator[tuple[Broker, Broker]]:
    """Broker A with the initiator service, broker B with the target service."""
    a = make_catalog(Broker(pair_urls[0]), initiator=True, target=False)
    b = make_catalog(Broker(pair_urls[1]), initiator=False, target=True)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
