"""The fault-injecting proxy itself, without brokers or databases: signed frames go from a
plain socket client through the proxy to a small recording (or echoing) TCP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from faultproxy import FaultProxy, Faults

from scheduler_lib.broker.transport import frames
from scheduler_lib.broker.transport.frames import MAC_SIZE, PREFIX, Kind

KEY = b"fault-proxy-test-key-0123456789ab"
DEADLINE = 3.0  # seconds any awaited condition gets


def poll(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Wait until ``condition()`` holds, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def ack(i: int) -> bytes:
    return frames.encode(Kind.ACK, {"a": [i]}, None, KEY)


def split(data: bytes) -> list[bytes]:
    """Whole frames out of a byte stream, by the lengths in their prefixes."""
    out = []
    while data:
        _magic, _kind, _flags, head_len, body_len = PREFIX.unpack(data[: PREFIX.size])
        size = PREFIX.size + head_len + body_len + MAC_SIZE
        assert len(data) >= size, "a truncated frame"
        out.append(data[:size])
        data = data[size:]
    return out


def whole_frames(data: bytes) -> int:
    """How many whole frames ``data`` starts with."""
    count = 0
    while len(data) >= PREFIX.size:
        _magic, _kind, _flags, head_len, body_len = PREFIX.unpack(data[: PREFIX.size])
        size = PREFIX.size + head_len + body_len + MAC_SIZE
        if len(data) < size:
            break
        count, data = count + 1, data[size:]
    return count


def decode(frame: bytes) -> frames.Frame:
    """``frames.read`` on one frame's bytes."""

    async def read() -> frames.Frame:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await frames.read(reader, KEY)

    return asyncio.run(read())


class Target:
    """A TCP server on loopback that records what each connection sends (and echoes it
    back when asked to)."""

    def __init__(self, *, echo: bool = False) -> None:
        self.echo = echo
        self.received: list[bytearray] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)  # so that the accepting thread notices close()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    def data(self, i: int = 0) -> bytes:
        with self._lock:
            return bytes(self.received[i]) if i < len(self.received) else b""

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.received.append(bytearray())
                self._conns.append(conn)
                index = len(self.received) - 1
            thread = threading.Thread(target=self._serve, args=(conn, index), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, index: int) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received[index] += data
                if self.echo:
                    try:
                        conn.sendall(data)
                    except OSError:
                        return

    def close(self) -> None:
        self._closed.set()
        self._accepter.join(timeout=2)
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=2)


@pytest.fixture(autouse=True)
def no_loop_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Nothing reaches the proxy's event loop's default exception handler."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    yield
    noise = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not noise, noise


@pytest.fixture
def target() -> Iterator[Target]:
    server = Target()
    yield server
    server.close()


@pytest.fixture
def echo() -> Iterator[Target]:
    server = Target(echo=True)
    yield server
    server.close()


def connect(proxy: FaultProxy) -> socket.socket:
    host, port = proxy.address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=DEADLINE)
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock`` (its timeout is the deadline of each read)."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"EOF after {len(data)} of {size} bytes"
        data += chunk
    return data


def sees_eof(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (an orderly EOF or a reset), within its timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_without_faults_frames_arrive_intact_and_in_order_both_ways(echo: Target) -> None:
    # Given a proxy with no faults in front of an echo server
    sent = [ack(i) for i in range(200)]
    with FaultProxy(echo.address, Faults()) as proxy, connect(proxy) as client:
        # When a client sends 200 frames through it
        client.sendall(b"".join(sent))
        # Then the server gets all of them, whole and in order, and so does the client
        poll(lambda: len(echo.data()) >= len(b"".join(sent)), "the frames at the server")
        assert split(echo.data()) == sent
        back = recv_exactly(client, len(b"".join(sent)))
        assert split(back) == sent
        assert [decode(f).header for f in split(back)] == [{"a": [i]} for i in range(200)]
        stats = proxy.stats
    assert stats["connections"] == 1
    assert stats["frames"] == 400
    assert stats["dropped"] == stats["corrupted"] == stats["duplicated"] == 0


def test_dropping_everything_spares_the_handshake(target: Target) -> None:
    # Given a proxy that drops every frame except HELLO / WELCOME
    hello = frames.encode(Kind.HELLO, {"nonce": "n"}, None, KEY)
    sent = [ack(i) for i in range(50)]
    with FaultProxy(target.address, Faults(drop=1.0)) as proxy, connect(proxy) as client:
        # When a client sends a HELLO and then 50 ACK frames
        client.sendall(hello + b"".join(sent))
        # Then, once the proxy has handled them all, only the HELLO reached the server
        poll(lambda: proxy.stats["frames"] == 51, "the proxy to read 51 frames")
        poll(lambda: len(target.data()) >= len(hello), "the HELLO at the server")
        assert target.data() == hello
        assert decode(hello).kind is Kind.HELLO
        assert proxy.stats["dropped"] == 50


def test_corrupted_frames_keep_their_framing_but_fail_their_hmac(target: Target) -> None:
    # Given a proxy that corrupts every frame
    sent = [frames.encode(Kind.ACK, {"a": list(range(i))}, b"x" * i, KEY) for i in range(30)]
    with FaultProxy(target.address, Faults(corrupt=1.0)) as proxy, connect(proxy) as client:
        # When a client sends 30 frames of different sizes
        client.sendall(b"".join(sent))
        poll(lambda: len(target.data()) >= len(b"".join(sent)), "the frames at the server")
        assert proxy.stats["corrupted"] == 30
    # Then each one arrives, as long as it was, altered, and its HMAC check fails
    arrived = split(target.data())
    assert [len(f) for f in arrived] == [len(f) for f in sent]
    for original, frame in zip(sent, arrived, strict=True):
        assert frame[: PREFIX.size] == original[: PREFIX.size]  # the framing is intact
        assert frame != original
        with pytest.raises(frames.CorruptFrame):
            decode(frame)


def test_duplicated_frames_arrive_twice(target: Target) -> None:
    # Given a proxy that duplicates every frame
    sent = [ack(i) for i in range(40)]
    with FaultProxy(target.address, Faults(duplicate=1.0)) as proxy, connect(proxy) as client:
        # When a client sends 40 frames
        client.sendall(b"".join(sent))
        # Then the server gets each one twice, in a row, in order
        poll(lambda: len(target.data()) >= 2 * len(b"".join(sent)), "80 frames at the server")
        assert split(target.data()) == [f for f in sent for _ in range(2)]
        assert proxy.stats["duplicated"] == 40


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.0\r\nHost: broker\r\n\r\n" + bytes(range(256)) * 40,
        b"hi\n",  # shorter than a frame's prefix
        b"SLB" + b"\x00" * 5,  # a partial magic, then not ours
        frames.MAGIC + bytes([99, 0, 0, 0, 0, 0, 0, 0]) + b"junk",  # the magic, an unknown kind
    ],
    ids=["http", "short", "partial-magic", "unknown-kind"],
)
def test_garbage_is_forwarded_unchanged(echo: Target, garbage: bytes) -> None:
    # Given a proxy that faults everything, in front of an echo server
    everything = Faults(drop=1.0, duplicate=1.0, corrupt=1.0, reorder=1.0, spare_handshake=False)
    with FaultProxy(echo.address, everything) as proxy, connect(proxy) as client:
        # When a client sends bytes that are not our frames, then a valid frame after them
        client.sendall(garbage)
        # Then they reach the server unchanged, and come back unchanged
        poll(lambda: echo.data() == garbage, "the garbage at the server")
        assert recv_exactly(client, len(garbage)) == garbage
        client.sendall(ack(1))  # from then on the direction is raw: not dropped either
        poll(lambda: echo.data() == garbage + ack(1), "the frame after the garbage")
        assert proxy.stats["garbage_bytes"] >= len(garbage) + len(ack(1))
        assert proxy.stats["dropped"] == 0


def test_cut_all_closes_the_clients_connection(target: Target) -> None:
    # Given a client connected to the server through the proxy
    with FaultProxy(target.address, Faults()) as proxy, connect(proxy) as client:
        client.sendall(ack(1))
        poll(lambda: target.data() == ack(1), "the frame at the server")
        # When every proxied connection is cut
        assert proxy.cut_all() == 1
        # Then the client sees its connection end, and nothing is left to cut
        assert sees_eof(client)
        assert proxy.cut_all() == 0


def test_a_random_cut_closes_both_sides(target: Target) -> None:
    # Given a proxy that cuts the connection at the first frame after the handshake
    with FaultProxy(target.address, Faults(cut=1.0)) as proxy, connect(proxy) as client:
        # When a client sends a HELLO, then an ACK
        hello = frames.encode(Kind.HELLO, {"nonce": "n"}, None, KEY)
        client.sendall(hello + ack(1))
        # Then the HELLO got through, the ACK did not, and the client sees EOF
        assert sees_eof(client)
        poll(lambda: target.data() == hello, "the HELLO at the server")
        assert proxy.stats["cuts"] == 1


def test_stop_is_quick_with_connections_open(echo: Target) -> None:
    # Given a proxy with three connections open, one of them mid-frame
    proxy = FaultProxy(echo.address, Faults(delay=1.0, max_delay=0.5)).start()
    clients = [connect(proxy) for _ in range(3)]
    clients[0].sendall(ack(1)[:20])
    poll(lambda: proxy.stats["connections"] == 3, "three connections")
    # When it is stopped
    started = time.monotonic()
    proxy.stop()
    # Then it stops within a couple of seconds and every client sees its connection end
    assert time.monotonic() - started < 2
    for client in clients:
        with client:
            assert sees_eof(client)


def test_reordered_frames_go_after_the_next_one_or_after_the_hold(target: Target) -> None:
    # Given a proxy that holds back every frame it can (one at a time), for up to 2 s
    sent = [ack(i) for i in range(10)]
    faults = Faults(reorder=1.0, reorder_hold=2.0)
    with FaultProxy(target.address, faults) as proxy, connect(proxy) as client:
        # When a client sends 10 frames
        client.sendall(b"".join(sent))
        # Then each pair arrives swapped: every held frame went right after the next one
        poll(lambda: len(target.data()) >= len(b"".join(sent)), "the frames at the server")
        assert split(target.data()) == [sent[i ^ 1] for i in range(10)]
        assert proxy.stats["reordered"] == 5
    # Given a proxy that holds a frame for 0.1 s when no next frame comes
    with (
        FaultProxy(target.address, Faults(reorder=1.0, reorder_hold=0.1)) as proxy,
        connect(proxy) as client,
    ):
        # When a client sends a single frame
        started = time.monotonic()
        client.sendall(ack(1))
        # Then it arrives anyway, once the hold is over
        poll(lambda: target.data(1) == ack(1), "the held frame at the server")
        assert time.monotonic() - started >= 0.09


def test_delays_keep_the_order_of_frames(target: Target) -> None:
    # Given a proxy that delays every frame by up to 10 ms
    sent = [ack(i) for i in range(30)]
    faults = Faults(delay=1.0, max_delay=0.01)
    with FaultProxy(target.address, faults) as proxy, connect(proxy) as client:
        # When a client sends 30 frames
        client.sendall(b"".join(sent))
        # Then they all arrive in order
        poll(lambda: len(target.data()) >= len(b"".join(sent)), "the frames at the server")
        assert split(target.data()) == sent
        assert proxy.stats["delayed"] == 30


def test_the_same_seed_faults_the_same_frames(target: Target) -> None:
    # Given two proxies in turn with the same seed, each dropping half the frames
    sent = [ack(i) for i in range(100)]
    for connection in range(2):
        with FaultProxy(target.address, Faults(drop=0.5), seed=7) as proxy:
            # When a client sends the same 100 frames through each
            with connect(proxy) as client:
                client.sendall(b"".join(sent))
            poll(lambda: proxy.stats["frames"] == 100, "the proxy to read 100 frames")
            passed = 100 - proxy.stats["dropped"]
            poll(
                lambda: whole_frames(target.data(connection)) == passed,  # noqa: B023
                f"{passed} frames at the server",
            )
    # Then the same frames got through both
    first, second = split(target.data(0)), split(target.data(1))
    assert first == second
    assert 20 < len(first) < 80
    assert all(frame in sent for frame in first)


def test_set_faults_changes_the_rates_from_the_next_frame_on(target: Target) -> None:
    # Given a proxy without faults, and a frame that went through it
    with FaultProxy(target.address, Faults()) as proxy, connect(proxy) as client:
        client.sendall(ack(1))
        poll(lambda: target.data() == ack(1), "the first frame at the server")
        # When its faults become "drop everything" and two more frames are sent
        proxy.set_faults(Faults(drop=1.0))
        client.sendall(ack(2) + ack(3))
        # Then both are dropped
        poll(lambda: proxy.stats["dropped"] == 2, "two frames dropped")
        assert target.data() == ack(1)
