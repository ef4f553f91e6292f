"""The sender's schedule (unit): fragments interleave, levels go first when honoured, and
the starvation guard lets an old fragment through whatever its level."""

from __future__ import annotations

from scheduler_lib.broker.transport.links import Link, Outgoing


def message(message_id: int, fragments: int, priority: int = 5) -> Outgoing:
    return Outgoing(
        message_id=message_id,
        handle="h",
        conversation_id=f"c{message_id}",
        from_initiator=True,
        seq=0,
        priority=priority,
        enqueued_at=0.0,
        address="tcp://x:1",
        header={},
        fragments=[b"x"] * fragments,
        backoff=1.0,
    )


def drain(link: Link, now: float = 0.0, honor: bool = False, guard: float = 10.0) -> list:
    order = []
    while (entry := link.pop(now, honor, guard)) is not None:
        order.append((entry.message.message_id, entry.index))
        link.written(entry.message, entry.index, now)
    return order


def test_small_messages_go_between_a_large_ones_fragments() -> None:
    # Given a large message (4 fragments) scheduled before two small ones
    link = Link("tcp://x:1")
    large, small1, small2 = message(1, 4), message(2, 1), message(3, 1)
    for m in (large, small1, small2):
        link.start_round(m, 0.0)
    # When the link writes everything
    order = drain(link)
    # Then the small ones went out after the large one's first fragment, not its last
    assert order[:3] == [(1, 0), (2, 0), (3, 0)]
    assert [i for m, i in order if m == 1] == [0, 1, 2, 3]
    # and every message, once fully written, waits for its acknowledgement
    assert all(m.due == 1.0 for m in (large, small1, small2))


def test_acknowledged_fragments_are_not_sent_again() -> None:
    link = Link("tcp://x:1")
    large = message(1, 3)
    large.acked.update({0, 2})
    link.start_round(large, 0.0)
    assert drain(link) == [(1, 1)]


def test_priority_first_when_honoured_and_the_starvation_guard() -> None:
    link = Link("tcp://x:1")
    low, high = message(1, 1, priority=1), message(2, 1, priority=9)
    link.start_round(low, 0.0)
    link.start_round(high, 0.0)
    # Honoured: the higher level first; not honoured: arrival order
    assert drain(link, now=1.0, honor=True) == [(2, 0), (1, 0)]
    link.start_round(message(3, 1, priority=1), 0.0)
    link.start_round(message(4, 1, priority=9), 0.0)
    assert drain(link, now=1.0, honor=False) == [(3, 0), (4, 0)]
    # A low-level fragment that waited past the guard goes before a fresh high one
    link.start_round(message(5, 1, priority=1), 0.0)
    link.start_round(message(6, 1, priority=9), 20.0)
    assert drain(link, now=20.0, honor=True, guard=10.0) == [(5, 0), (6, 0)]


def test_a_message_that_leaves_a_link_has_nothing_left_in_line_there() -> None:
    # Given a large message half written on one link, and a small one behind it
    old, new = Link("tcp://x:1"), Link("tcp://y:2")
    large, small = message(1, 4), message(2, 1)
    for m in (large, small):
        old.messages[m.message_id] = m
        old.start_round(m, 0.0)
    entry = old.pop(0.0, False, 10.0)
    assert entry is not None
    old.written(entry.message, entry.index, 0.0)
    # When the large one leaves it (its route changed) and starts again on another link
    old.remove(large)
    large.address, large.pending = new.address, []
    new.messages[large.message_id] = large
    new.start_round(large, 0.0)
    # Then the old link writes only the small one, the new one every fragment of it
    assert drain(old) == [(2, 0)]
    assert drain(new) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert 1 not in old.messages


def test_a_fragment_acknowledged_while_it_waits_in_line_does_not_end_the_round() -> None:
    # Given a retransmission round of a large message, its first fragment written
    link = Link("tcp://x:1")
    large = message(1, 4)
    link.start_round(large, 0.0)
    entry = link.pop(0.0, False, 10.0)
    assert entry is not None and entry.index == 0
    link.written(large, 0, 0.0)
    # When the next one in line is acknowledged before it goes (a late acknowledgement
    # of the round before, through a network that delays and reorders frames)
    large.acked.add(1)
    # Then the round goes on with the fragments after it, and then waits for their
    # acknowledgement (it stalled: nothing in line, no retransmission clock, so the
    # message was never sent again)
    assert drain(link, now=0.5) == [(1, 2), (1, 3)]
    assert large.due == 1.5
