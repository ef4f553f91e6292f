"""What the endpoint keeps in memory per message in flight, per peer address and per
connection.

A :class:`Link` is the way to one peer address: the schedule of fragments waiting to go
there and the connection that carries them. Its schedule interleaves: a message puts one
fragment at a time in line, and its next fragment only after that one was written, so a
small message is never stuck behind all of a large one's fragments. With
``honor_broker_priority`` higher levels go first, except that a fragment that has waited
``starvation_after`` seconds goes next whatever its level. A :class:`Connection` is one
TCP connection after the handshake (here, beside the link it may carry: each names the
other).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import time
from typing import Any

from scheduler_lib.broker import counters
from scheduler_lib.broker.transport import frames


@dataclasses.dataclass(eq=False)
class Outgoing:
    """A message of the transmission queue that this endpoint is delivering."""

    message_id: int
    handle: str  # the sending endpoint's conversation handle
    conversation_id: str
    from_initiator: bool
    seq: int
    priority: int
    enqueued_at: float
    address: str
    header: dict[str, Any]  # the fields every fragment's header repeats
    fragments: list[bytes | None]
    backoff: float  # seconds until the next retransmission, doubling to the cap
    acked: set[int] = dataclasses.field(default_factory=set)
    pending: list[int] = dataclasses.field(default_factory=list)  # to write this round
    due: float | None = None  # when unacknowledged fragments go again
    round_at: float | None = None  # when this round's first frame was written; None: not yet
    attempts: int = 0  # rounds written to a live connection
    rejected: str | None = None  # the far broker's reason, while it refuses the message
    line: int = 0  # bumped when it leaves a link or is refused: what it had in line is void

    @property
    def key(self) -> tuple[str, bool, int]:
        return (self.conversation_id, self.from_initiator, self.seq)

    @property
    def to_service(self) -> str:
        """The far service, whose route says where the message goes."""
        return str(self.header["ts"])

    @property
    def done(self) -> bool:
        return len(self.acked) == len(self.fragments)


@dataclasses.dataclass(eq=False)
class _Entry:
    message: Outgoing
    index: int
    queued_at: float
    line: int  # the message's line when it was put in this one
    live: bool = True


class Link:
    """The schedule and connection for one peer address (``tcp://host:port``)."""

    def __init__(self, address: str, expected_instance: str | None = None) -> None:
        self.address = address
        self.expected_instance = expected_instance
        self.connection: Connection | None = None
        self.dialing: asyncio.Task[None] | None = None
        self.last_error: str | None = None
        self.messages: dict[int, Outgoing] = {}  # in flight to this address, by id
        self._by_priority: list[tuple[int, int, _Entry]] = []
        self._by_age: list[tuple[int, _Entry]] = []
        self._tickets = itertools.count()

    def start_round(self, message: Outgoing, now: float) -> None:
        """Send every fragment not yet acknowledged, in order, one in line at a time."""
        message.pending = [i for i in range(len(message.fragments)) if i not in message.acked]
        if message.attempts:  # an earlier round went out: these go again
            counters.retransmitted(len(message.pending))
        message.due = None
        message.round_at = None
        if message.pending:
            self._push(message, message.pending[0], now)

    def written(self, message: Outgoing, index: int, now: float) -> None:
        """A fragment went out: put the next in line, or start the retransmission clock."""
        if index in message.pending:
            message.pending.remove(index)
        if message.pending:
            self._push(message, message.pending[0], now)
        else:
            message.due = now + message.backoff

    def _push(self, message: Outgoing, index: int, now: float) -> None:
        entry = _Entry(message, index, now, message.line)
        ticket = next(self._tickets)
        heapq.heappush(self._by_priority, (-message.priority, ticket, entry))
        heapq.heappush(self._by_age, (ticket, entry))

    def pop(self, now: float, honor_priority: bool, starvation_after: float) -> _Entry | None:
        """The next fragment to write, or ``None``."""
        oldest = self._first_live(self._by_age, now)
        if oldest is None:
            return None
        if honor_priority:
            _ticket, entry = oldest
            if now - entry.queued_at < starvation_after:
                best = self._first_live(self._by_priority, now)
                assert best is not None
                entry = best[2]
        else:
            entry = oldest[1]
        entry.live = False
        return entry

    def _first_live(self, heap: list[Any], now: float) -> Any:
        while heap:
            entry: _Entry = heap[0][-1]
            message = entry.message
            current = entry.live and entry.line == message.line and not message.done
            if current and entry.index not in message.acked:
                return heap[0]
            entry.live = False
            heapq.heappop(heap)
            if current:
                # Acknowledged while it waited in line (a late acknowledgement of the
                # round before): the round goes on with the fragment after it, or starts
                # its retransmission clock. It is the one fragment of the message in
                # line, so skipping it alone would end the round with nothing sent and
                # nothing due: the message would never go again.
                self.written(message, entry.index, now)
        return None

    def remove(self, message: Outgoing) -> None:
        """The message no longer goes this way (acknowledged, gone, or routed elsewhere):
        its fragments still in line here are skipped, and none of its goes out here."""
        self.messages.pop(message.message_id, None)
        message.line += 1

    def has_work(self) -> bool:
        return bool(self.messages)


@dataclasses.dataclass(frozen=True)
class ConnectionInfo:
    """One connection, as ``sys.dm_broker_connections`` shows it."""

    direction: str  # "outbound" (we dialled) or "inbound"
    peer: str  # the remote socket address
    peer_address: str | None  # where the peer listens (dialled, or as it said)
    peer_broker: str
    opened_at: float
    last_activity_at: float
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    corrupted_frames: int
    carries_messages: bool  # the link to its address sends on it


class Connection:
    """One TCP connection after the handshake."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        direction: str,
        peer_broker: str,
        peer_address: str | None,
        send_key: bytes,
        receive_key: bytes,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.direction = direction
        self.peer_broker = peer_broker
        self.peer_address = peer_address
        self.send_key = send_key  # one key per direction: a frame cannot be reflected
        self.receive_key = receive_key
        self.sent_number = 0  # the CONFIRM's (the dialler's) or none yet (the acceptor's)
        self.received = frames.ReplayGuard()  # a frame replayed into the connection
        peername = writer.get_extra_info("peername")
        self.peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        self.opened_at = self.last_activity = self.last_received = time.time()
        self.frames_sent = self.frames_received = 0
        self.bytes_sent = self.bytes_received = 0
        self.corrupted = 0
        self.last_acked = 0.0  # when the peer last acknowledged one of our fragments here
        self.ping_sent_at: float | None = None  # a PING waits for any frame back
        self.ping_due = False  # a PING goes with the next frame
        self.pong_due = False  # the peer PINGed: any frame answers
        self.acks: list[list[Any]] = []
        self.rejects: list[list[Any]] = []
        self.link: Link | None = None
        self.wake = asyncio.Event()
        self.closed = False
        self.tasks: list[asyncio.Task[None]] = []

    def seal(self, kind: frames.Kind, header: dict[str, Any], body: bytes | None) -> bytes:
        """The next frame of this direction: numbered, signed with its session key."""
        self.sent_number += 1
        header[frames.NUMBER] = self.sent_number
        return frames.encode(kind, header, body, self.send_key)

    def info(self) -> ConnectionInfo:
        return ConnectionInfo(
            direction=self.direction,
            peer=self.peer,
            peer_address=self.peer_address,
            peer_broker=self.peer_broker,
            opened_at=self.opened_at,
            last_activity_at=self.last_activity,
            frames_sent=self.frames_sent,
            frames_received=self.frames_received,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            corrupted_frames=self.corrupted,
            carries_messages=self.link is not None and self.link.connection is self,
        )
