"""Exactly once, in order, whole: two brokers on loopback with a fault-injecting proxy
between them that drops, duplicates, reorders, delays and corrupts frames and cuts
connections — in both directions of traffic, SQLite -> PostgreSQL and back."""

from __future__ import annotations

import collections

from faultproxy import FaultProxy, Faults
from multiproc import poll
from transport_catalog import CONTRACT, FAST_RETRY, INITIATOR, KEY, REPLY, REQUEST, TARGET
from transport_catalog import INITIATOR_QUEUE as A_QUEUE
from transport_catalog import TARGET_QUEUE as B_QUEUE

from scheduler_lib.broker import Broker, EndpointState, Message
from scheduler_lib.broker.transport import TransportEndpoint

CONVERSATIONS = 100
PER_CONVERSATION = 100  # 10,000 messages
LARGE = 200_000  # bytes of the one large message, sent in fragments
FAULTS = Faults(
    drop=0.02,
    duplicate=0.02,
    reorder=0.02,
    delay=0.02,
    max_delay=0.02,
    corrupt=0.01,
    cut=0.0005,
)


def body(conversation: int, i: int) -> bytes:
    return f"conversation {conversation} message {i}".encode()


def drain(broker: Broker, queue: str, into: list[Message], want: int, timeout: float) -> None:
    """RECEIVE until ``want`` messages arrived in all (or fail after ``timeout``)."""

    def more() -> bool:
        with broker.transaction() as tx:
            into.extend(tx.receive(queue, top=500, timeout=0.5))
        return len(into) >= want

    poll(more, timeout, f"{want} messages on {queue} (got {len(into)})", interval=0)


def test_ten_thousand_messages_arrive_exactly_once_in_order_through_faults(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    # Given both brokers' endpoints, with a faulty proxy in front of each
    options = {"key": KEY, "listen": "127.0.0.1:0", "fragment_size": 16 * 1024, **FAST_RETRY}
    with (
        TransportEndpoint(a, **options) as ea,
        TransportEndpoint(b, **options) as eb,
        FaultProxy(_target(eb.address), FAULTS, seed=1) as to_b,
        FaultProxy(_target(ea.address), FAULTS, seed=2) as to_a,
    ):
        a.create_route("to target", TARGET, to_b.address)
        b.create_route("to initiator", INITIATOR, to_a.address)
        # When A sends 100 messages on each of 100 conversations, and one large one
        handles = [a.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(CONVERSATIONS)]
        large = bytes(range(256)) * (LARGE // 256)
        for n, handle in enumerate(handles):
            a.send_many(handle, REQUEST, [body(n, i) for i in range(PER_CONVERSATION)])
            if n == 0:
                a.send(handle, REQUEST, large)
        total = CONVERSATIONS * PER_CONVERSATION + 1
        # Then B gets every one exactly once, in order per conversation, unaltered
        got: list[Message] = []
        drain(b, B_QUEUE, got, total, timeout=180)
        by_conversation: dict[str, list[Message]] = collections.defaultdict(list)
        for m in got:
            by_conversation[str(m.conversation_handle)].append(m)
        assert len(got) == total and len(by_conversation) == CONVERSATIONS
        origin = {}  # B's handle -> A's conversation number, from the first body
        for handle, messages in by_conversation.items():
            seqs = [m.message_sequence_number for m in messages]
            assert seqs == sorted(seqs) == list(range(len(messages))), handle
            first = messages[0].body or b""
            origin[handle] = int(first.split()[1])
            n = origin[handle]
            expected = [body(n, i) for i in range(PER_CONVERSATION)]
            if n == 0:
                expected.append(large)
            assert [m.body for m in messages] == expected
        # ... and its replies come back the same way, one per conversation
        for handle in by_conversation:
            b.send(handle, REPLY, f"reply to {origin[handle]}")
        replies: list[Message] = []
        drain(a, A_QUEUE, replies, CONVERSATIONS, timeout=120)
        assert sorted(r.body or b"" for r in replies) == sorted(
            f"reply to {n}".encode() for n in range(CONVERSATIONS)
        )
        # ... and both transmission queues empty once every acknowledgement is in
        poll(
            lambda: not a.transmission_queue(),
            60,
            "A's transmission queue empties",
            explain=lambda: _left(a, ea),
        )
        poll(
            lambda: not b.transmission_queue(),
            60,
            "B's transmission queue empties",
            explain=lambda: _left(b, eb),
        )
        # The faults did happen: corrupted frames were dropped and recorded as events
        stats = collections.Counter(to_b.stats) + collections.Counter(to_a.stats)
        for fault in ("dropped", "duplicated", "reordered", "corrupted", "cuts"):
            assert stats[fault] > 0, (fault, stats)
        events = _events(a) + _events(b)
        assert "CORRUPTED_MESSAGE" in {e["event_type"] for e in events}
        # And ending the conversations closes both sides through the same faults
        for handle in handles[:5]:
            a.end_conversation(handle)
        ended: list[Message] = []
        drain(b, B_QUEUE, ended, 5, timeout=60)
        assert {m.message_type_name for m in ended} == {"EndDialog"}
        for m in ended:
            b.end_conversation(m.conversation_handle)
        poll(
            lambda: all(
                a.conversation_endpoint(h).state is EndpointState.CLOSED for h in handles[:5]
            ),
            60,
            "A's ended conversations close once B ended them too",
        )


def _target(address: str | None) -> tuple[str, int]:
    assert address is not None
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _left(broker: Broker, endpoint: TransportEndpoint) -> str:
    """What a transmission queue still holds, and the endpoint's connections: a failure
    says which messages were never acknowledged, and whether a connection was up."""
    left = broker.transmission_queue()
    return f"{len(left)} left, first {[dict(m) for m in left[:3]]}; {endpoint.connections()}"


def _events(broker: Broker) -> list[dict]:
    return [dict(e) for e in broker.fetch("transport_event_list", limit=10_000)]
