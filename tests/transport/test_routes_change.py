"""Routes apply to waiting messages (issue 25.3): a route created, changed or dropped
while the endpoint runs is used by the next attempt of every message waiting for it —
messages already in flight on the old address's link as well as those waiting for a
route at all — not after the backoff's cap, and not only after a restart."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultproxy import FaultProxy, Faults
from multiproc import poll
from transport_catalog import CONTRACT, FAST_RETRY, INITIATOR, KEY, REQUEST, TARGET, free_port
from transport_catalog import TARGET_QUEUE as B_QUEUE

from bench.processes import CLI, Processes
from scheduler_lib.broker import Broker
from scheduler_lib.broker.transport import TransportEndpoint, endpoint
from scheduler_lib.broker.transport.endpoint import RETRY_INITIAL, RETRY_MAX

# The product's retry settings: the change must not wait for the backoff, whose first
# wait is 2.5 s and whose cap is 60 s.
DEFAULT_RETRY = {"retry_initial": RETRY_INITIAL, "retry_max": RETRY_MAX}
CHANGE_DEADLINE = 10.0  # seconds from a route's change to its effect (about 2 s; margin)
QUIET = 2.0  # seconds an old address is watched for attempts (the old dial's: <= 0.3 s)
BODIES = [b"first", b"second", b"third"]
NO_ROUTE = f"no route to service {TARGET!r}"


class DeadEnd:
    """A TCP server at a route's old address that is no broker: it accepts and holds
    each connection without a word (a dial waits for its WELCOME) or, with ``hang_up``,
    closes it at once (a dial fails at once and tries again soon); it counts them."""

    def __init__(self, *, hang_up: bool) -> None:
        self.hang_up = hang_up
        self.accepted = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="dead-end", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self._server.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            if self.hang_up:
                conn.close()
            else:
                self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self._held:
            conn.close()
        self._server.close()


@pytest.fixture
def dead_end() -> Iterator[Callable[[bool], DeadEnd]]:
    """Makes :class:`DeadEnd` servers (``hang_up`` or not), closed after the test."""
    made: list[DeadEnd] = []

    def make(hang_up: bool) -> DeadEnd:
        made.append(DeadEnd(hang_up=hang_up))
        return made[-1]

    yield make
    for server in made:
        server.close()


def statuses(broker: Broker) -> list[str]:
    return [r["transmission_status"] or "" for r in broker.fetch("outgoing_list", limit=100)]


def arrived(broker: Broker) -> list[bytes]:
    """The bodies in B's queue (one conversation: in sequence order)."""
    return [m.body or b"" for m in broker.peek(B_QUEUE)]


def send_all(a: Broker) -> None:
    handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
    for body in BODIES:
        a.send(handle, REQUEST, body)


@pytest.mark.parametrize("old", ["black-hole", "acks-lost"])
def test_messages_in_flight_follow_a_changed_route_at_once(
    pair: tuple[Broker, Broker], dead_end: Callable[[bool], DeadEnd], old: str
) -> None:
    a, b = pair
    options = {"key": KEY, "listen": "127.0.0.1:0", **DEFAULT_RETRY}
    with contextlib.ExitStack() as stack:
        stack.enter_context(TransportEndpoint(a, **options))
        eb = stack.enter_context(TransportEndpoint(b, **options))
        # Given A's route to the target leads where its messages stay unacknowledged:
        # a server that accepts and never answers, or B through a path that loses every
        # acknowledgement (B has the messages, A sends them again and again)
        if old == "black-hole":
            black_hole = dead_end(False)
            a.create_route("to target", TARGET, black_hole.address)
            send_all(a)
            poll(lambda: black_hole.accepted >= 1, 30, "A dials the black hole")
            poll(
                lambda: any("no WELCOME within 5 s" in s for s in statuses(a)),
                30,
                "A's status says nothing answers",
                explain=lambda: statuses(a),
            )
        else:
            host, port = (eb.address or "").removeprefix("tcp://").rsplit(":", 1)
            acks_lost = stack.enter_context(
                FaultProxy((host, int(port)), Faults(), answer_faults=Faults(drop=1.0))
            )
            a.create_route("to target", TARGET, acks_lost.address)
            send_all(a)
            poll(lambda: arrived(b) == BODIES, 30, "B has them through the lossy path")
        assert len(a.transmission_queue()) == len(BODIES)
        # When the route is dropped and made again with B's own address
        a.drop_route("to target")
        a.create_route("to target", TARGET, eb.address or "")
        # Then A's messages go there at once, all acknowledged within seconds: far from
        # the backoff's cap (60 s) — where the old address kept them for good
        poll(
            lambda: not a.transmission_queue(),
            CHANGE_DEADLINE,
            "A's transmission queue empties after the route's change",
            explain=lambda: statuses(a),
        )
        # and B has each exactly once, in order (copies it had are dropped as such)
        assert arrived(b) == BODIES


def test_a_route_changed_between_two_lookups_of_one_batch_moves_the_whole_batch(
    pair: tuple[Broker, Broker],
    dead_end: Callable[[bool], DeadEnd],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = pair
    options = {"key": KEY, "listen": "127.0.0.1:0", **DEFAULT_RETRY}
    black_hole = dead_end(False)
    # Given three messages waiting for a route that leads to a server that never answers
    a.create_route("to target", TARGET, black_hole.address)
    send_all(a)
    with TransportEndpoint(b, **options) as eb:
        # And the route changed to B's own address just after the loader looked it up
        # for the first message of its batch, before it looked again for the next (the
        # route cache expiring mid-batch: made to happen every time here)
        real_route = endpoint.TransportEndpoint._route
        lookups = []

        def route_then_change(self: TransportEndpoint, service: str) -> object:
            found = real_route(self, service)
            lookups.append(service)
            if len(lookups) == 1:
                a.drop_route("to target")
                a.create_route("to target", TARGET, eb.address or "")
            return found

        monkeypatch.setattr(endpoint, "ROUTE_CACHE_TTL", 0.0)
        monkeypatch.setattr(endpoint.TransportEndpoint, "_route", route_then_change)
        # When A's endpoint loads them
        with TransportEndpoint(a, **options):
            # Then all three follow the new route, the first one too (it went to the
            # old address for good while the others went the new way)
            poll(
                lambda: not a.transmission_queue(),
                CHANGE_DEADLINE,
                "A's transmission queue empties after the route's change",
                explain=lambda: statuses(a),
            )
        assert arrived(b) == BODIES


def test_a_dropped_route_stops_the_sending_until_another_is_made(
    pair: tuple[Broker, Broker], dead_end: Callable[[bool], DeadEnd]
) -> None:
    a, b = pair
    options = {"key": KEY, "listen": "127.0.0.1:0", **FAST_RETRY}
    hangs_up = dead_end(True)
    with TransportEndpoint(a, **options), TransportEndpoint(b, **options) as eb:
        # Given messages in flight to an address that hangs up on every dial
        a.create_route("to target", TARGET, hangs_up.address)
        send_all(a)
        cannot = f"cannot connect to {hangs_up.address}"
        poll(
            lambda: all(s.startswith(cannot) for s in statuses(a)) and statuses(a),
            30,
            "A's messages cannot go to the old address",
            explain=lambda: statuses(a),
        )
        # When the route is dropped with none to replace it
        a.drop_route("to target")
        # Then the messages say they wait for a route, not that the old address fails
        poll(
            lambda: statuses(a) == [NO_ROUTE] * len(BODIES),
            CHANGE_DEADLINE,
            "A's messages wait for a route",
            explain=lambda: statuses(a),
        )
        # and the old address is dialled no more: an absence is only seen over time,
        # several of the periods at which the old link dialled it
        before = hangs_up.accepted
        time.sleep(QUIET)
        assert hangs_up.accepted == before
        assert statuses(a) == [NO_ROUTE] * len(BODIES)
        # When a route is made again, the waiting messages follow it
        a.create_route("to target again", TARGET, eb.address or "")
        poll(lambda: not a.transmission_queue(), CHANGE_DEADLINE, "A's transmission queue empties")
        assert arrived(b) == BODIES


def test_a_changed_broker_instance_applies_to_messages_in_flight(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    options = {"key": KEY, "listen": "127.0.0.1:0", **DEFAULT_RETRY}
    other_instance = "00000000-0000-4000-8000-000000000000"
    with TransportEndpoint(a, **options), TransportEndpoint(b, **options) as eb:
        host, port = (eb.address or "").removeprefix("tcp://").rsplit(":", 1)
        with FaultProxy((host, int(port)), Faults(), answer_faults=Faults(drop=1.0)) as lossy:
            # Given messages in flight to B on a live connection whose acknowledgements
            # are lost, along a route that names no broker instance
            a.create_route("to target", TARGET, lossy.address)
            send_all(a)
            poll(lambda: arrived(b) == BODIES, 30, "B has them through the lossy path")
            # When the route is made again at that address for another broker instance
            a.drop_route("to target")
            a.create_route("to target", TARGET, lossy.address, broker_instance=other_instance)
            # Then B is not sent to any more: the live connection stops carrying them and
            # a new one is refused for the route's instance
            pinned = f"but the route names broker instance {other_instance}"
            poll(
                lambda: all(pinned in s for s in statuses(a)),
                CHANGE_DEADLINE,
                "A's messages wait for the route's broker instance",
                explain=lambda: statuses(a),
            )
            # When the route names B's instance at B's own address
            a.drop_route("to target")
            a.create_route("to target", TARGET, eb.address or "", broker_instance=b.broker_instance)
            # Then they go there at once, and B has each exactly once, in order
            poll(
                lambda: not a.transmission_queue(),
                CHANGE_DEADLINE,
                "A's transmission queue empties",
                explain=lambda: statuses(a),
            )
            assert arrived(b) == BODIES


# --- the user's case: `scheduler-lib serve --listen` and `scheduler-lib routes` ---------


def routes_command(url: str, *args: str) -> None:
    """``scheduler-lib routes --db URL ...`` as docs/transport.md gives it."""
    result = subprocess.run(
        [CLI, "routes", "--db", url, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_serve_follows_routes_changed_with_the_command_line(
    pair: tuple[Broker, Broker], pair_urls: tuple[str, str], tmp_path: Path
) -> None:
    a, b = pair
    url_a, url_b = pair_urls
    port_a, port_b, nowhere = free_port(), free_port(), free_port()
    env = {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": KEY}
    with Processes(tmp_path, env) as processes:
        # Given both brokers served by `scheduler-lib serve --listen` (default retries)
        for name, url, port in (("serve-a", url_a, port_a), ("serve-b", url_b, port_b)):
            serve = processes.start(name, "serve", "--db", url, "--listen", f"127.0.0.1:{port}")
            processes.wait_said(serve, "listening at", 60)
        # and A's route to an address where nothing listens, its messages in flight there
        routes_command(url_a, "create", "to spark", TARGET, f"tcp://127.0.0.1:{nowhere}")
        send_all(a)
        cannot = f"cannot connect to tcp://127.0.0.1:{nowhere}"
        poll(
            lambda: all(s.startswith(cannot) for s in statuses(a)) and statuses(a),
            30,
            "serve A tries the address where nothing listens",
            explain=lambda: statuses(a),
        )
        # When the route is dropped and made again with B's address, as the user did
        routes_command(url_a, "drop", "to spark")
        routes_command(url_a, "create", "to spark", TARGET, f"tcp://127.0.0.1:{port_b}")
        # Then the running serve sends them there, without a restart
        poll(
            lambda: not a.transmission_queue(),
            CHANGE_DEADLINE,
            "A's transmission queue empties after `routes drop` and `routes create`",
            explain=lambda: statuses(a),
        )
        assert arrived(b) == BODIES
