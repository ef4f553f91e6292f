"""A PostgreSQL restart under a running transport endpoint: two brokers' `scheduler-lib
serve --listen` (A on a private PostgreSQL server, B on SQLite, default settings),
requests from A answered one by one from B, and A's server stopped for a few seconds
and started again mid-run. A's endpoint reads its transmission queue, deletes what B
acknowledged and stores B's replies through the outage: nothing may be lost, duplicated
or reordered, and neither `serve` may die or stop sending."""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))  # the catalog

from multiproc import poll
from private_postgres import PrivatePostgres
from transport_catalog import (
    CONTRACT,
    INITIATOR,
    INITIATOR_QUEUE,
    KEY,
    REQUEST,
    TARGET,
    Replier,
    free_port,
    make_catalog,
)

from bench.processes import Processes
from scheduler_lib.broker import Broker

pytestmark = pytest.mark.postgres

CONVERSATIONS = 30
PER_CONVERSATION = 100  # 3,000 requests and as many replies (~6 s without a restart)
RESTART_AFTER = 50  # replies back at A when its server stops: the run has begun
OUTAGE = 5.0  # seconds A's server is down
AFTER_RESTART = 120.0  # seconds for the rest once it is back (~10 s here)


@pytest.fixture
def brokers(private_db_url: str, tmp_path: Path) -> Iterator[tuple[Broker, Broker, str, str]]:
    """Broker A (initiator, on the private server) and B (target, SQLite): their URLs."""
    b_url = f"sqlite:///{tmp_path / 'broker_b.db'}"
    a = make_catalog(Broker(private_db_url), initiator=True, target=False)
    b = make_catalog(Broker(b_url), initiator=False, target=True)
    try:
        yield a, b, private_db_url, b_url
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(600)
def test_a_restart_of_the_database_under_serve_listen_loses_and_duplicates_nothing(
    brokers: tuple[Broker, Broker, str, str],
    private_postgres: PrivatePostgres,
    tmp_path: Path,
) -> None:
    a, b, a_url, b_url = brokers
    port_a, port_b = free_port(), free_port()
    a.create_route("to target", TARGET, f"tcp://127.0.0.1:{port_b}")
    b.create_route("to initiator", INITIATOR, f"tcp://127.0.0.1:{port_a}")
    env = {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": KEY}
    with Processes(tmp_path, env) as processes:
        # Given both brokers' endpoints as `scheduler-lib serve --listen`, defaults
        serves = {}
        for name, url, port in (("serve-a", a_url, port_a), ("serve-b", b_url, port_b)):
            serves[name] = processes.start(
                name, "serve", "--db", url, "--listen", f"127.0.0.1:{port}"
            )
            processes.wait_said(serves[name], "listening at", 60)
        replier = Replier(b)
        try:
            # And 3,000 requests in A's transmission queue, answered one by one from B
            handles = [
                str(a.begin_dialog(INITIATOR, TARGET, CONTRACT)) for _ in range(CONVERSATIONS)
            ]
            for n, handle in enumerate(handles):
                bodies = [f"{n}:{i}".encode() for i in range(PER_CONVERSATION)]
                a.send_many(handle, REQUEST, bodies)
            total = CONVERSATIONS * PER_CONVERSATION
            replies = lambda: len(a.peek(INITIATOR_QUEUE))  # noqa: E731
            poll(lambda: replies() >= RESTART_AFTER, 60, f"{RESTART_AFTER} replies")
            # When A's server stops mid-run, and starts again a few seconds later
            _, back_at = private_postgres.stop_for(OUTAGE)
            assert replies() < total, "the run ended before the restart: nothing was tested"
            # Then everything goes both ways once it is back
            poll(
                lambda: replies() >= total,
                AFTER_RESTART,
                "every reply at A",
                explain=lambda: (replies(), processes.output(serves["serve-a"])),
            )
            print(f"all replies {time.monotonic() - back_at:.1f} s after the restart")
            poll(lambda: not a.transmission_queue(), 60, "A's transmission queue empties")
            poll(lambda: not b.transmission_queue(), 60, "B's transmission queue empties")
        finally:
            replier.close()
        # And each request arrived at B once, in order; each reply at A once, in order
        assert len(replier.received) == CONVERSATIONS
        for bodies in replier.received.values():
            n = bodies[0].split(b":", 1)[0].decode()
            assert bodies == [f"{n}:{i}".encode() for i in range(PER_CONVERSATION)]
        got: dict[str, list[bytes]] = collections.defaultdict(list)
        for m in a.peek(INITIATOR_QUEUE):
            got[str(m.conversation_handle)].append(m.body or b"")
        assert sorted(got) == sorted(handles)
        for n, handle in enumerate(handles):
            assert got[handle] == [f"re {n}:{i}".encode() for i in range(PER_CONVERSATION)]
        # And both endpoints are still serving
        for serve in serves.values():
            assert serve.poll() is None, processes.output(serve)
        # And A's log tells the outage in a few lines (the broker's "unavailable" and
        # "is back"), not a traceback per loop and try
        told = (tmp_path / "serve-a.err").read_text()
        assert "is back after" in told and "Traceback" not in told, told[-3000:]
        assert len(told.splitlines()) < 30, told[-3000:]
