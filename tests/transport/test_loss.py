"""Progress under loss (issue 25): a network that loses, duplicates and reorders a good
share of the frames and cuts the connections every two seconds slows the transport down,
but never stops it; a peer gone without a reset is noticed and dialled again.

The endpoints run as ``scheduler-lib serve --listen`` with their default retry timings
(2.5 s, doubling to 60 s), behind frame-aware fault proxies (``faultproxy.py``) both ways;
the test process sends into broker A's database and answers every request from broker
B's, so both directions carry a message per request. A corrupted frame is a dropped frame
(its HMAC fails and the receiver drops it), so ``drop`` stands for corruption too; the
handshake's frames are faulted like the rest."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultproxy import FaultProxy, Faults
from multiproc import poll
from transport_catalog import (
    CONTRACT,
    FAST_RETRY,
    INITIATOR,
    KEY,
    REQUEST,
    TARGET,
    Replier,
    free_port,
)
from transport_catalog import INITIATOR_QUEUE as A_QUEUE
from transport_catalog import TARGET_QUEUE as B_QUEUE

from bench.processes import Processes
from scheduler_lib.broker import Broker, counters
from scheduler_lib.broker.transport import TransportEndpoint, delivery, endpoint

CONVERSATIONS = 50
PER_CONVERSATION = 100  # 5,000 requests and 5,000 replies
LARGE = 150_000  # bytes of the first request of the first LARGE_COUNT conversations
LARGE_COUNT = 5
LOSSY = Faults(drop=0.10, duplicate=0.05, reorder=0.05, spare_handshake=False)
CUT_EVERY = 2.0  # seconds between cuts of every proxied connection
RETRY_MAX = endpoint.RETRY_MAX  # serve's default: the longest a retransmission waits


@pytest.fixture
def lossy(
    pair: tuple[Broker, Broker], pair_urls: tuple[str, str], tmp_path: Path
) -> Iterator[tuple[FaultProxy, FaultProxy, Replier]]:
    """Both brokers' `scheduler-lib serve --listen`, each behind a fault proxy (no faults
    yet), routes through the proxies, and B's replier."""
    a, b = pair
    port_a, port_b = free_port(), free_port()
    env = {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": KEY}
    with (
        FaultProxy(("127.0.0.1", port_b), Faults(), seed=5) as to_b,
        FaultProxy(("127.0.0.1", port_a), Faults(), seed=6) as to_a,
        Processes(tmp_path, env) as processes,
    ):
        a.create_route("to target", TARGET, to_b.address)
        b.create_route("to initiator", INITIATOR, to_a.address)
        for url, port, proxy in ((pair_urls[0], port_a, to_a), (pair_urls[1], port_b, to_b)):
            serve = processes.start(
                f"serve-{port}",
                "serve",
                "--db",
                url,
                "--listen",
                f"127.0.0.1:{port}",
                "--advertise",
                proxy.address,
            )
            processes.wait_said(serve, "listening at", 60)
        replier = Replier(b)
        try:
            yield to_a, to_b, replier
        finally:
            replier.close()


def send_workload(a: Broker, tag: str) -> list[str]:
    """The requests, sent as fast as A's database takes them; their conversations."""
    handles = [str(a.begin_dialog(INITIATOR, TARGET, CONTRACT)) for _ in range(CONVERSATIONS)]
    for n, handle in enumerate(handles):
        bodies = [f"{tag} {n}:{i}".encode() for i in range(PER_CONVERSATION)]
        if n < LARGE_COUNT:
            bodies[0] = bodies[0] + b"|" + bytes(range(256)) * (LARGE // 256)
        a.send_many(handle, REQUEST, bodies)
    return handles


@contextlib.contextmanager
def through_a_proxy(a: Broker, b: Broker) -> Iterator[tuple[FaultProxy, str]]:
    """Both endpoints in this process (the tests' fast retry timings), A's route to B
    through a proxy without faults, and a conversation to send on."""
    options = {"key": KEY, "listen": "127.0.0.1:0", **FAST_RETRY}
    with TransportEndpoint(b, **options) as eb:
        host, port = (eb.address or "").removeprefix("tcp://").rsplit(":", 1)
        with FaultProxy((host, int(port)), Faults()) as proxy, TransportEndpoint(a, **options):
            a.create_route("to target", TARGET, proxy.address)
            yield proxy, str(a.begin_dialog(INITIATOR, TARGET, CONTRACT))


def retransmitted() -> float:
    """This process's count of fragments its transport wrote again (``/metrics``)."""
    name = "scheduler_lib_transport_frames_retransmitted_total"
    return counters.REGISTRY.get_sample_value(name) or 0.0


def replies(a: Broker) -> int:
    return len(a.peek(A_QUEUE))


def test_loss_slows_the_transport_down_but_never_stops_it(
    pair: tuple[Broker, Broker], lossy: tuple[FaultProxy, FaultProxy, Replier]
) -> None:
    a, b = pair
    to_a, to_b, replier = lossy
    total = CONVERSATIONS * PER_CONVERSATION
    # Given the workload's time without faults, through the same proxies
    started = time.monotonic()
    send_workload(a, "clean")
    poll(lambda: replies(a) >= total, 120, "the fault-free run's replies")
    clean = time.monotonic() - started
    with a.transaction() as tx:  # empty A's queue for the next run
        while tx.receive(A_QUEUE, top=1000, timeout=0):
            pass
    # When 10 % of the frames are lost, 5 % duplicated, 5 % reordered, both ways, and
    # every connection is cut every two seconds
    cuts = threading.Event()

    def cutter() -> None:
        while not cuts.wait(CUT_EVERY):
            to_a.cut_all()
            to_b.cut_all()

    for proxy in (to_a, to_b):
        proxy.set_faults(LOSSY)
    cutting = threading.Thread(target=cutter, daemon=True)
    cutting.start()
    started = time.monotonic()
    try:
        send_workload(a, "lossy")
        # Then at least half of it goes both ways while the faults go on
        poll(lambda: replies(a) >= total // 2, 3 * clean + RETRY_MAX, "half the replies")
    finally:
        cuts.set()
        cutting.join(10)
        for proxy in (to_a, to_b):
            proxy.set_faults(Faults())
    faults_stopped = time.monotonic()
    # And once they stop, everything outstanding arrives within the retry cap
    poll(lambda: replies(a) >= total, RETRY_MAX, "all replies after the faults stopped")
    lossy_time = time.monotonic() - started
    assert lossy_time <= 3 * clean + RETRY_MAX, (clean, lossy_time, faults_stopped - started)
    poll(lambda: not a.transmission_queue(), RETRY_MAX, "A's transmission queue empties")
    poll(lambda: not b.transmission_queue(), RETRY_MAX, "B's transmission queue empties")
    # And each request arrived once, in order, whole; each reply once
    lossy_bodies = [bodies for bodies in replier.received.values() if bodies[0][:5] == b"lossy"]
    assert len(lossy_bodies) == CONVERSATIONS
    for bodies in lossy_bodies:
        n = int(bodies[0].split(b" ", 1)[1].split(b":", 1)[0])
        expected = [f"lossy {n}:{i}".encode() for i in range(PER_CONVERSATION)]
        if n < LARGE_COUNT:
            expected[0] += b"|" + bytes(range(256)) * (LARGE // 256)
        assert bodies == expected
    got = [m.body or b"" for m in a.peek(A_QUEUE)]
    assert len(got) == len(set(got)) == total
    stats = collections.Counter(to_a.stats) + collections.Counter(to_b.stats)
    assert stats["dropped"] and stats["duplicated"] and stats["reordered"], stats


def test_a_peer_gone_without_a_reset_is_noticed_and_dialled_again(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    with through_a_proxy(a, b) as (proxy, handle):
        a.send(handle, REQUEST, b"before")
        poll(lambda: len(b.peek(B_QUEUE)) == 1, 30, "the first message")
        # Given the connection goes silent both ways, and stays open (no reset)
        assert proxy.stall_all() == 1
        again = retransmitted()
        # When A has more to send
        a.send_many(handle, REQUEST, [b"after %d" % i for i in range(10)])
        # Then it notices (its PING goes unanswered), dials again, and delivers
        deadline = endpoint.PING_AFTER + FAST_RETRY["retry_initial"] + endpoint.PING_TIMEOUT
        poll(lambda: len(b.peek(B_QUEUE)) == 11, deadline + 20, "the rest, on a new connection")
        assert proxy.stats["connections"] == 2
        # And /metrics counts the fragments written again
        assert retransmitted() > again
    assert [m.body for m in b.peek(B_QUEUE)] == [b"before"] + [b"after %d" % i for i in range(10)]


def test_a_connection_lost_right_after_its_handshake_is_dialled_again(
    pair: tuple[Broker, Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    # Given the first connection A opens ends right after its handshake, before A has
    # given it to the link (the far side refused a CONFIRM it lost, or a cut came)
    opened = TransportEndpoint._open
    lost: list[object] = []

    async def open_then_lose(self: TransportEndpoint, link: object, *more: object) -> object:
        conn = await opened(self, link, *more)  # type: ignore[arg-type]
        if not lost:
            lost.append(conn)
            await self._close(conn, "lost right after its handshake")
        return conn

    monkeypatch.setattr(TransportEndpoint, "_open", open_then_lose)
    options = {"key": KEY, "listen": "127.0.0.1:0", **FAST_RETRY}
    with TransportEndpoint(b, **options) as eb, TransportEndpoint(a, **options) as ea:
        a.create_route("to target", TARGET, eb.address or "")
        # When A sends
        handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
        a.send(handle, REQUEST, b"once more")
        # Then it dials again, and the message arrives
        poll(lambda: len(b.peek(B_QUEUE)) == 1, 30, "the message, on a second connection")
        assert lost and len(ea.connections()) == 1


def test_a_receiver_whose_storing_lags_is_not_taken_for_gone(
    pair: tuple[Broker, Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    # Given a receiving broker whose database stalls for longer than a PING may wait,
    # once, with its readers waiting for room (they read nothing meanwhile)
    monkeypatch.setattr(endpoint, "INCOMING_MAX", 4)
    accept = delivery.Receiver.accept_batch
    stalled: list[float] = []

    def stalling(self: delivery.Receiver, fragments: object) -> object:
        if not stalled:
            stalled.append(time.monotonic())
            time.sleep(endpoint.PING_TIMEOUT + 3)
        return accept(self, fragments)  # type: ignore[arg-type]

    monkeypatch.setattr(delivery.Receiver, "accept_batch", stalling)
    with through_a_proxy(a, b) as (proxy, handle):
        # When the sender has more than the receiver takes in meanwhile
        a.send_many(handle, REQUEST, [b"%d" % i for i in range(100)])
        poll(lambda: len(b.peek(B_QUEUE)) == 100, 60, "all 100 messages")
        # Then it waited on the same connection: the receiver said it was alive
        assert stalled and proxy.stats["connections"] == 1, proxy.stats
    assert [m.body for m in b.peek(B_QUEUE)] == [b"%d" % i for i in range(100)]
