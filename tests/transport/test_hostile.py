"""A peer that means harm (issue 25): recordings of a genuine handshake replayed at either
side, and a server that never proves it holds the transport key. The hostile side is
written here, from sockets and the frame format, not from the endpoint's own code.

What must hold: nothing is sent to a peer that has not proved the key on this connection
(a replayed WELCOME gets no message, also with the route pinned to the far broker's
instance); a replayed HELLO gets no further than its WELCOME (the connection is closed at
its first other frame, with one event, and carries none of our messages)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from multiproc import poll
from transport_catalog import (
    CONTRACT,
    FAST_RETRY,
    INITIATOR,
    KEY,
    REPLY,
    REQUEST,
    TARGET,
    free_port,
)
from transport_catalog import TARGET_QUEUE as B_QUEUE

from bench.processes import Processes
from scheduler_lib.broker import Broker, InvalidArgument, counters
from scheduler_lib.broker.transport import TransportEndpoint, delivery, endpoint, frames, reports

OPTIONS = {"key": KEY, "listen": "127.0.0.1:0", **FAST_RETRY}
SECRET = b"the body nobody else may read"


def split_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(kind, bytes) of each whole frame at the start of a recorded stream."""
    out = []
    while len(data) >= frames.PREFIX.size:
        _, kind, _, head, body = frames.PREFIX.unpack(data[: frames.PREFIX.size])
        size = frames.PREFIX.size + head + body + frames.MAC_SIZE
        if len(data) < size:
            break
        out.append((kind, data[:size]))
        data = data[size:]
    return out


def host_port(address: str | None) -> tuple[str, int]:
    assert address is not None
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


class Recorder:
    """A TCP relay in front of an address that keeps every byte that crossed it, per
    connection and direction: what someone on the network between two brokers sees."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.streams: list[dict[str, bytearray]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = self.server.accept()
                far = socket.create_connection(self.target)
                stream = {"out": bytearray(), "back": bytearray()}
                self.streams.append(stream)
                for src, dst, key in ((near, far, "out"), (far, near, "back")):
                    threading.Thread(
                        target=self._pump, args=(src, dst, stream[key]), daemon=True
                    ).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, seen: bytearray) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                seen.extend(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


class FakeServer:
    """A keyless server at a route's address: to every connection it answers with
    ``answer`` (a recorded WELCOME, garbage, or nothing) and keeps what it is sent."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.received: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                seen = bytearray()
                self.received.append(seen)
                threading.Thread(target=self._serve, args=(conn, seen), daemon=True).start()

    def _serve(self, conn: socket.socket, seen: bytearray) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            answered = False
            while data := conn.recv(65536):
                seen.extend(data)
                if not answered and self.answer:
                    conn.sendall(self.answer)
                    answered = True

    def kinds(self) -> list[int]:
        return [kind for stream in self.received for kind, _ in split_frames(bytes(stream))]

    def close(self) -> None:
        self.server.close()


@contextlib.contextmanager
def recorded_exchange(a: Broker, b: Broker) -> Iterator[Recorder]:
    """A genuine exchange between A and B recorded on the wire: A sends a message to B
    through a recorder (a HELLO, WELCOME, CONFIRM and the frames after them)."""
    with TransportEndpoint(b, **OPTIONS) as eb:
        recorder = Recorder(host_port(eb.address))
        try:
            with TransportEndpoint(a, **OPTIONS):
                a.create_route("recorded", TARGET, recorder.address)
                handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
                a.send(handle, REQUEST, b"recorded")
                poll(lambda: b.peek(B_QUEUE), 30, "the recorded message at B")
                poll(lambda: not a.fetch("outgoing_list", limit=10), 30, "its acknowledgement")
            a.drop_route("recorded")
            yield recorder
        finally:
            recorder.close()


def first_of(data: bytes, kind: frames.Kind) -> bytes:
    return next(raw for k, raw in split_frames(data) if k == kind)


@pytest.mark.parametrize("answer", ["replayed WELCOME", "garbage", "nothing"])
@pytest.mark.parametrize("pinned", [False, True], ids=["any-instance", "pinned-instance"])
def test_nothing_is_sent_to_a_server_that_does_not_prove_the_key(
    pair: tuple[Broker, Broker], answer: str, pinned: bool
) -> None:
    a, b = pair
    # Given a WELCOME recorded from B, and a keyless server at a route's address that
    # answers every HELLO with it (or with garbage, or not at all)
    with recorded_exchange(a, b) as recorder:
        welcome = first_of(bytes(recorder.streams[0]["back"]), frames.Kind.WELCOME)
    fake = FakeServer(
        {"replayed WELCOME": welcome, "garbage": b"HTTP/1.1 200 OK\r\n\r\n" * 3, "nothing": b""}[
            answer
        ]
    )
    try:
        with TransportEndpoint(a, **OPTIONS) as ea:
            a.create_route(
                "to the fake",
                TARGET,
                fake.address,
                broker_instance=b.broker_instance if pinned else None,
            )
            # When A sends a message for that service
            handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
            a.send(handle, REQUEST, SECRET)
            # Then A dials, and its status says why nothing went
            statuses = lambda: [  # noqa: E731
                r["transmission_status"] for r in a.fetch("outgoing_list", limit=100)
            ]
            why = {
                "replayed WELCOME": "did not prove it holds the transport key",
                "garbage": "answered with",
                "nothing": "cannot connect",
            }[answer]
            poll(
                lambda: any(why in (s or "") for s in statuses()),
                30,
                f"status {why!r}",
                explain=statuses,
            )
            poll(lambda: len(fake.received) >= 2, 30, "A dialled again")
            assert ea.connections() == []
        # And the fake got HELLOs only: not a CONFIRM, not a frame of the message, not its body
        assert fake.kinds() and set(fake.kinds()) == {frames.Kind.HELLO}
        assert not any(SECRET in stream for stream in fake.received)
        # And the message waits in A's transmission queue
        assert len(a.fetch("outgoing_list", limit=100)) == 1
        if answer == "replayed WELCOME":
            rejected = [
                r["detail"]
                for r in a.fetch("transport_event_list", limit=100)
                if r["event_type"] == "CONNECTION_REJECTED"
            ]
            assert any("replayed or forged WELCOME" in d for d in rejected)
    finally:
        fake.close()


def test_a_replayed_hello_gets_no_further_than_its_welcome(pair: tuple[Broker, Broker]) -> None:
    a, b = pair
    # Given a genuine exchange recorded on the wire (HELLO, CONFIRM, a message, from A)
    with recorded_exchange(a, b) as recorder:
        sent = bytes(recorder.streams[0]["out"])
    hello = first_of(sent, frames.Kind.HELLO)
    confirm = first_of(sent, frames.Kind.CONFIRM)
    message = first_of(sent, frames.Kind.MESSAGE)
    # And a reply B holds for A while A is away, routed to the address A's HELLO
    # advertised (B would carry it on a connection from A instead of dialling back)
    _, _, _, head, _ = frames.PREFIX.unpack(hello[: frames.PREFIX.size])
    listen = json.loads(hello[frames.PREFIX.size : frames.PREFIX.size + head])["listen"]
    b.create_route("to initiator", INITIATOR, listen)
    [request] = b.receive(B_QUEUE)
    b.send(request.conversation_handle, REPLY, SECRET)
    with TransportEndpoint(b, **OPTIONS) as eb:
        # When someone replays A's HELLO, then A's recorded CONFIRM and a flood of frames
        for _ in range(3):
            with socket.create_connection(host_port(eb.address), timeout=10) as sock:
                sock.sendall(hello)
                got = bytearray()
                while len(split_frames(bytes(got))) < 1:
                    chunk = sock.recv(65536)
                    assert chunk, "closed before its WELCOME"
                    got.extend(chunk)
                with contextlib.suppress(OSError):
                    sock.sendall(
                        confirm
                        + message
                        + frames.encode(frames.Kind.ACK, {"a": []}, None, b"k" * 32) * 200
                    )
                    while chunk := sock.recv(65536):
                        got.extend(chunk)
                # Then B answered with a WELCOME and closed the connection: nothing else
                assert [k for k, _ in split_frames(bytes(got))] == [frames.Kind.WELCOME]
                assert SECRET not in got

        # With one event per connection, naming the failed proof
        def rejected() -> list[str]:
            return [
                r["detail"]
                for r in b.fetch("transport_event_list", limit=1000)
                if r["event_type"] in ("CONNECTION_REJECTED", "CORRUPTED_MESSAGE")
            ]

        poll(lambda: len(rejected()) >= 3, 10, "three rejections", explain=rejected)
        assert len(rejected()) == 3
        assert all("did not prove it holds the transport key" in d for d in rejected())
        # And the replayed message was not taken a second time, the reply still waits
        assert b.peek(B_QUEUE) == []
        assert len(b.fetch("outgoing_list", limit=100)) == 1


class FrameRelay:
    """A relay in front of an address that forwards whole frames, keeps the frames that
    crossed each connection in each direction, and can write a recorded frame into a
    live connection between two of them: someone on the path who replays."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        # per connection: direction -> (destination socket, its lock, frames that crossed)
        self.connections: list[dict[str, tuple[socket.socket, threading.Lock, list[bytes]]]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = self.server.accept()
                far = socket.create_connection(self.target)
                conn = {
                    "out": (far, threading.Lock(), []),
                    "back": (near, threading.Lock(), []),
                }
                self.connections.append(conn)
                for src, key in ((near, "out"), (far, "back")):
                    threading.Thread(target=self._pump, args=(src, *conn[key]), daemon=True).start()

    @staticmethod
    def _pump(
        src: socket.socket, dst: socket.socket, lock: threading.Lock, seen: list[bytes]
    ) -> None:
        pending = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                pending += data
                whole = split_frames(pending)
                for _, raw in whole:
                    with lock:
                        dst.sendall(raw)
                    seen.append(raw)
                pending = pending[sum(len(raw) for _, raw in whole) :]
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def inject(self, connection: int, direction: str, data: bytes) -> None:
        dst, lock, _ = self.connections[connection][direction]
        with lock:
            dst.sendall(data)

    def close(self) -> None:
        self.server.close()


def test_a_frame_replayed_into_its_own_connection_is_dropped(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    with TransportEndpoint(b, **OPTIONS) as eb:
        relay = FrameRelay(host_port(eb.address))
        try:
            # A sends each message once: an acknowledgement slower than the tests' short
            # retry interval (a loaded machine) made A send the payment again, a second
            # recorded copy that could reach B after its endpoint was pruned
            once = {**OPTIONS, "retry_initial": 60.0, "retry_max": 60.0}
            with TransportEndpoint(a, **once):
                a.create_route("through the relay", TARGET, relay.address)
                # Given a payment A sent to B through someone who records the frames
                first = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
                a.send(first, REQUEST, b"pay 100 once")
                poll(lambda: b.peek(B_QUEUE), 30, "the payment at B")
                [payment] = b.receive(B_QUEUE)
                # And B is done with it: ended, and its closed endpoint pruned as it is
                # CLOSED_RETENTION after the end (the connection lives on meanwhile)
                b.end_conversation(payment.conversation_handle, cleanup=True)
                later = time.time() + delivery.CLOSED_RETENTION + 60
                assert delivery.prune_closed(b, later) == 1
                [recorded] = [
                    raw
                    for raw in relay.connections[0]["out"][2]
                    if raw[4] == frames.Kind.MESSAGE and b"pay 100 once" in raw
                ]
                # When the recorder writes the payment's frame into the same connection
                # again, and then A sends something else on it
                replayed = bad_frames("replayed")
                relay.inject(0, "out", recorded)
                second = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
                a.send(second, REQUEST, b"something else")
                poll(
                    lambda: any(m.body == b"something else" for m in b.peek(B_QUEUE)),
                    30,
                    "the next message at B",
                )
                # Then B took the payment once: the replayed copy was dropped
                assert [m.body for m in b.peek(B_QUEUE)] == [b"something else"]
                # And recorded as a replay, and the connection went on
                replays = lambda: [  # noqa: E731
                    r["detail"]
                    for r in b.fetch("transport_event_list", limit=100)
                    if r["event_type"] == "REPLAYED_FRAME"
                ]
                poll(replays, 10, "a REPLAYED_FRAME event")
                assert "MESSAGE frame number" in replays()[0]
                assert bad_frames("replayed") == replayed + 1  # and counted for /metrics
                assert len(relay.connections) == 1
        finally:
            relay.close()


def bad_frames(reason: str) -> float:
    """This process's count of dropped frames (``/metrics``)."""
    name = "scheduler_lib_transport_bad_frames_total"
    return counters.REGISTRY.get_sample_value(name, {"reason": reason}) or 0.0


# --- bounded resources -------------------------------------------------------------------

FLOOD_CONNECTIONS = 2000  # keyless connections, each holding a half-sent HELLO open
REPLAYED = 150  # connections opening with a replayed HELLO, then announcing 16 MiB
RSS_GROWTH_MAX = 64 * 1024 * 1024  # bytes the endpoint's peak RSS may grow in the flood
DELIVERY_DEADLINE = 60.0  # seconds real traffic may take during the flood (~1 s without)


def rss_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def flood(address: tuple[str, int], hello: bytes, stop: threading.Event, opened: list[int]) -> None:
    """Strangers without the key, until ``stop``: connections that send half a HELLO
    announcing a 60 KB header and hold it open (the newest :data:`FLOOD_CONNECTIONS` of
    them), connections that replay a recorded HELLO, then announce a 16 MiB frame and
    send 1 MB of it, and garbage. ``opened[0]`` counts the connections it opened."""
    held: collections.deque[socket.socket] = collections.deque()
    half = frames.PREFIX.pack(frames.MAGIC, frames.Kind.HELLO, 0, 60_000, 0) + b"x" * 1024
    huge = frames.PREFIX.pack(frames.MAGIC, frames.Kind.CONFIRM, 0, 10, 16 * 1024 * 1024)
    megabyte = b"y" * (1024 * 1024)
    try:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                sock = socket.create_connection(address, timeout=5)
                opened[0] += 1
                held.append(sock)
                if opened[0] % 10 == 0 and opened[0] // 10 <= REPLAYED:
                    sock.settimeout(0.5)
                    sock.sendall(hello + huge + megabyte)
                elif opened[0] % 7 == 0:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                else:
                    sock.sendall(half)
            while len(held) > FLOOD_CONNECTIONS:
                held.popleft().close()
    finally:
        for sock in held:
            sock.close()


def test_a_flood_of_strangers_is_bounded_and_real_traffic_still_flows(
    pair: tuple[Broker, Broker], pair_urls: tuple[str, str], tmp_path: Path
) -> None:
    a, b = pair
    with recorded_exchange(a, b) as recorder:
        hello = first_of(bytes(recorder.streams[0]["out"]), frames.Kind.HELLO)
    port = free_port()
    env = {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": KEY}
    with Processes(tmp_path, env) as processes:
        # Given B's endpoint as `scheduler-lib serve --listen`, with its default limits
        serve = processes.start(
            "serve-b", "serve", "--db", pair_urls[1], "--listen", f"127.0.0.1:{port}"
        )
        processes.wait_said(serve, "listening at", 60)
        baseline = rss_kib(serve.pid, "VmRSS")
        before = len(b.fetch("transport_event_list", limit=100_000))

        def events_since() -> int:
            return len(b.fetch("transport_event_list", limit=100_000)) - before

        # When strangers open thousands of connections at it
        stop = threading.Event()
        opened = [0]
        flooding = threading.Thread(target=flood, args=(("127.0.0.1", port), hello, stop, opened))
        flooding.start()
        try:
            poll(lambda: opened[0] >= FLOOD_CONNECTIONS, 120, "the flood under way")
            # Then a broker with the key still gets through to it, while the flood goes on
            with TransportEndpoint(a, **OPTIONS):
                a.create_route("to b", TARGET, f"tcp://127.0.0.1:{port}")
                handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
                for i in range(20):
                    a.send(handle, REQUEST, b"%d" % i)
                poll(
                    lambda: len(b.peek(B_QUEUE)) >= 21,
                    DELIVERY_DEADLINE,
                    "20 messages delivered during the flood",
                )
                assert flooding.is_alive(), "the flood ended before the delivery"
        finally:
            stop.set()
            flooding.join(60)
        # And its memory stayed bounded (its peak, measured by the kernel)
        grown = rss_kib(serve.pid, "VmHWM") - baseline
        assert grown * 1024 < RSS_GROWTH_MAX, f"peak RSS grew by {grown} KiB"
        processes.check_alive(serve)
    # And its events say how many it refused without a row per connection: a few one by
    # one, then counts (written when the minute ends, or as the endpoint stops)
    rows = b.fetch("transport_event_list", limit=100_000)[: -before or None]
    assert len(rows) <= 3 * reports.PER_WINDOW + 3, [r["detail"] for r in rows]
    counted = [
        r["detail"] for r in rows if " more rejected connections from 127.0.0.1" in r["detail"]
    ]
    assert counted, [r["detail"] for r in rows]


def test_transport_events_are_kept_within_their_retention(
    pair: tuple[Broker, Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, b = pair
    now = time.time()
    # Given 300 events, 100 of them older than a day
    old = [(now - 2 * 86400 + i, "CONNECTION_REJECTED", "10.0.0.1:1", "old") for i in range(100)]
    new = [(now - 100 + i * 0.1, "CONNECTION_REJECTED", "10.0.0.1:1", "new") for i in range(200)]
    delivery.record_events(b, old + new)
    monkeypatch.setattr(endpoint, "PRUNE_INTERVAL", 0.2)
    # When an endpoint keeping a day, 50 rows at most, runs
    with TransportEndpoint(b, **OPTIONS, events_retention=86400, events_max=50):
        # Then the old ones go, and all but the newest 50 of the rest
        poll(
            lambda: len(b.fetch("transport_event_list", limit=1000)) == 50,
            30,
            "50 events left",
        )
    kept = b.fetch("transport_event_list", limit=1000)
    assert {r["detail"] for r in kept} == {"new"}
    assert min(r["occurred_at"] for r in kept) == pytest.approx(new[150][0])


@pytest.mark.parametrize(
    "setting",
    [
        {"idle_timeout": float("nan")},
        {"idle_timeout": 0},
        {"retry_max": float("inf")},
        {"events_retention": -1},
        {"window": 0},
        {"max_connections": 0},
        {"max_handshakes": 1.5},
        {"events_max": True},
        {"fragment_size": float("nan")},
        {"retry_initial": 0.001},
        {"idle_timeout": True},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_nonsensical_settings_are_refused_by_name(
    pair: tuple[Broker, Broker], setting: dict[str, object]
) -> None:
    _, b = pair
    [(name, _)] = setting.items()
    with pytest.raises(InvalidArgument, match=name):
        TransportEndpoint(b, key=KEY, listen=None, **setting)  # type: ignore[arg-type]


def test_strangers_at_a_tls_endpoint_are_bounded_and_a_peer_still_gets_through(
    pair: tuple[Broker, Broker], tmp_path: Path
) -> None:
    from test_protocol import _certificate

    from scheduler_lib.broker.transport import tls_contexts

    a, b = pair
    cert, key = _certificate(tmp_path)
    server, client = tls_contexts(cert, key, ca=cert)
    tls = {"server_ssl": server, "client_ssl": client}
    # A TLS endpoint listens on IPv6 as on IPv4
    with TransportEndpoint(b, **{**OPTIONS, "listen": "[::1]:0"}, **tls) as on_ipv6:
        assert (on_ipv6.address or "").startswith("tcp://::1:")
    # Given a TLS endpoint and strangers holding connections open at it: silent ones,
    # and ones that start a TLS handshake and stop
    with TransportEndpoint(b, **OPTIONS, **tls) as eb:
        host, port = host_port(eb.address)
        held = []
        try:
            for i in range(3 * endpoint.MAX_HANDSHAKES):
                sock = socket.create_connection((host, port), timeout=5)
                if i % 2:
                    sock.sendall(b"\x16\x03\x01")
                held.append(sock)
            # When a broker with the key and a certificate dials it meanwhile
            with TransportEndpoint(a, **OPTIONS, **tls):
                a.create_route("to b", TARGET, eb.address or "")
                handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
                a.send(handle, REQUEST, b"through")
                # Then it gets through, and the strangers beyond the limit were let go
                poll(lambda: len(b.peek(B_QUEUE)) == 1, 30, "the message, past the strangers")
            closed = 0
            for sock in held:
                sock.settimeout(10)
                with contextlib.suppress(OSError):
                    closed += sock.recv(100) == b""
            assert closed >= 2 * endpoint.MAX_HANDSHAKES, closed
        finally:
            for sock in held:
                sock.close()
    evicted = [
        r["detail"]
        for r in b.fetch("transport_event_list", limit=1000)
        if "newer ones came" in r["detail"] or "more rejected connections" in r["detail"]
    ]
    assert evicted


def test_a_route_that_leads_back_to_this_broker_is_refused_by_name(
    pair: tuple[Broker, Broker],
) -> None:
    _, b = pair
    with TransportEndpoint(b, **OPTIONS) as eb:
        # Given a route on B that leads to B's own endpoint
        b.create_route("loop", TARGET + "Elsewhere", eb.address or "")
        b.create_message_type("Loop", "NONE")
        b.create_contract("LoopContract", {"Loop": "INITIATOR"})
        b.create_queue("LoopQueue")
        b.create_service("LoopService", "LoopQueue")
        handle = b.begin_dialog("LoopService", TARGET + "Elsewhere", "LoopContract")
        b.send(handle, "Loop", b"x")
        # Then the message waits, and its status says where the route leads
        poll(
            lambda: any(
                "this broker itself" in (r["transmission_status"] or "")
                for r in b.fetch("outgoing_list", limit=10)
            ),
            30,
            "the status names the loop",
        )
