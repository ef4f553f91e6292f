"""A conversation's first SEND makes its target endpoint. Several threads sending the first
messages of one conversation at once make it once: the others wait for it and use it (they
met a duplicate key on PostgreSQL before, the checked path's race)."""

from __future__ import annotations

import threading

import pytest

from scheduler_lib.broker import Broker

THREADS = 12
CONVERSATIONS = 5  # rounds: the race is a matter of timing
TIMEOUT = 60  # seconds for the threads' SENDs


@pytest.mark.parametrize("round_", range(CONVERSATIONS))
def test_first_sends_at_once_make_the_target_once(scheduler_catalog: Broker, round_: int) -> None:
    broker = scheduler_catalog
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    start = threading.Barrier(THREADS, timeout=TIMEOUT)
    failures: list[BaseException] = []

    def first_send(i: int) -> None:
        try:
            start.wait()
            broker.send(handle, "AsyncSent", f"{i}".encode())
        except BaseException as exc:  # the test says which
            failures.append(exc)

    threads = [threading.Thread(target=first_send, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert failures == []
    with broker.transaction() as tx:
        got = tx.receive("TargetQueue", top=THREADS + 1)
    assert sorted(m.body for m in got) == sorted(f"{i}".encode() for i in range(THREADS))
    # one target endpoint, which all of them went to, in the order they were sent
    assert len({m.conversation_handle for m in got}) == 1
    assert [m.message_sequence_number for m in got] == list(range(THREADS))
