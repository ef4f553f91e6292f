"""What the endpoint keeps in memory per message in flight and per peer address.

A :class:`Link` is the way to one peer address: the schedule of fragments waiting to go
there and the connection that carries them. Its schedule interleaves: a message puts one
fragment at a time in line, and its next fragment only after that one was written, so a
small message is never stuck behind all of a large one's fragments. With
``honor_broker_priority`` higher levels go first, except that a fragment that has waited
``starvation_after`` seconds goes next whatever its level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import counters

if TYPE_CHECKING:
    from scheduler_lib.broker.transport.endpoint import Connection


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
        oldest = self._first_live(self._by_age)
        if oldest is None:
            return None
        if honor_priority:
            _ticket, entry = oldest
            if now - entry.queued_at < starvation_after:
                best = self._first_live(self._by_priority)
                assert best is not None
                entry = best[2]
        else:
            entry = oldest[1]
        entry.live = False
        return entry

    def _first_live(self, heap: list[Any]) -> Any:
        while heap:
            entry: _Entry = heap[0][-1]
            message = entry.message
            if (
                entry.live
                and entry.line == message.line
                and not message.done
                and entry.index not in message.acked
            ):
                return heap[0]
            entry.live = False
            heapq.heappop(heap)
        return None

    def remove(self, message: Outgoing) -> None:
        """The message no longer goes this way (acknowledged, gone, or routed elsewhere):
        its fragments still in line here are skipped, and none of its goes out here."""
        self.messages.pop(message.message_id, None)
        message.line += 1

    def has_work(self) -> bool:
        return bool(self.messages)
