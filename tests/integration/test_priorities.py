"""Conversation priorities (seed 001, DESIGN.md section 5), on SQLite and PostgreSQL.

An endpoint takes its level when it is created, from the most specific matching priority
(contract+local+remote, contract+local, contract+remote, contract, local+remote, local,
remote), else 5; local and remote are seen from that endpoint's side. RECEIVE serves the
highest-level group first (a group's level: the highest level among its conversations
that have messages waiting), inside a group conversations by level, then sequence order.
A queue with ``receive_aging`` serves a message that waited that long ahead of every level.

The multi-process test starts its workers (``priority_workers.py``) with ``spawn``; every
wait is a condition with a deadline, and every child is killed and joined in ``finally``.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import uuid
from typing import Any

import priority_workers as workers
import pytest
from multiproc import collect, running

from scheduler_lib.broker import (
    ANY,
    DEFAULT,
    AlreadyExists,
    Broker,
    ContractNotFound,
    ConversationPriority,
    InvalidArgument,
    Message,
    MessageStatus,
    NotFound,
    ServiceNotFound,
)

# The seed's example: InitiatorService/InitiatorQueue, TargetService/TargetQueue and
# SimpleContract (RequestMessage from the initiator, ReplyMessage from the target).
INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "SimpleContract"
REQUEST = "RequestMessage"
REPLY = "ReplyMessage"
DEFAULT_LEVEL = 5

CTX = multiprocessing.get_context("spawn")
START_TIMEOUT = 30.0  # seconds for spawned workers to import, connect and meet
POLL_INTERVAL = 0.01  # seconds between checks inside a deadline loop


# --- helpers -------------------------------------------------------------------------


def _seed_catalog(broker: Broker) -> None:
    broker.create_message_type(REQUEST, "NONE")
    broker.create_message_type(REPLY, "NONE")
    broker.create_contract(CONTRACT, {REQUEST: "INITIATOR", REPLY: "TARGET"})
    broker.create_queue("InitiatorQueue")
    broker.create_queue("TargetQueue")
    broker.create_service(INITIATOR, "InitiatorQueue")
    broker.create_service(TARGET, "TargetQueue", [CONTRACT, DEFAULT])


def _only(messages: list[Message]) -> Message:
    assert len(messages) == 1, messages
    return messages[0]


def _converse(
    broker: Broker, to_service: str = TARGET, contract: str = CONTRACT
) -> tuple[uuid.UUID, Message, Message]:
    """Begin a dialog, send one request, receive it on TargetQueue, answer it and receive
    the answer on InitiatorQueue. :return: (initiator handle, request, reply)"""
    request_type, reply_type = (REQUEST, REPLY) if contract == CONTRACT else (DEFAULT, DEFAULT)
    handle = broker.begin_dialog(INITIATOR, to_service, contract)
    broker.send(handle, request_type, b"request")
    request = _only(broker.receive("TargetQueue", top=10, timeout=0))
    broker.send(request.conversation_handle, reply_type, b"reply")
    reply = _only(broker.receive("InitiatorQueue", top=10, timeout=0))
    assert reply.conversation_handle == handle
    return handle, request, reply


# --- 1. the seed's example -------------------------------------------------------------


def test_seed_example_gives_both_endpoints_level_3(broker: Broker) -> None:
    # Given the seed's catalog
    _seed_catalog(broker)
    # ... the seed's initiator script misspells LOCAL_SERVICE_NAME ("InitiatorSerivce"):
    # a local service must exist here, so that script is refused and creates nothing
    with pytest.raises(ServiceNotFound):
        broker.create_priority(
            "InitiatorToTargetPriority",
            contract=CONTRACT,
            local_service="InitiatorSerivce",
            remote_service=TARGET,
            level=3,
        )
    assert broker.conversation_priorities() == []
    # ... and the two priorities the seed means, one for each endpoint's point of view
    broker.create_priority(
        "InitiatorToTargetPriority",
        contract=CONTRACT,
        local_service=INITIATOR,
        remote_service=TARGET,
        level=3,
    )
    broker.create_priority(
        "TargetToInitiatorPriority",
        contract=CONTRACT,
        local_service=TARGET,
        remote_service=INITIATOR,
        level=3,
    )

    # When a SimpleContract conversation sends a RequestMessage and gets a ReplyMessage
    handle, request, reply = _converse(broker)

    # Then the initiator endpoint has level 3, and so has the target endpoint
    initiator = broker.conversation_endpoint(handle)
    target = broker.conversation_endpoint(request.conversation_handle)
    assert initiator.is_initiator and initiator.priority == 3
    assert not target.is_initiator and target.priority == 3
    assert target.conversation_id == initiator.conversation_id
    # ... RECEIVE from TargetQueue and from InitiatorQueue both ran at level 3
    assert (request.message_type_name, request.priority) == (REQUEST, 3)
    assert (reply.message_type_name, reply.priority) == (REPLY, 3)

    # When a conversation between the same services uses the DEFAULT contract
    other, default_request, default_reply = _converse(broker, contract=DEFAULT)

    # Then no priority matches it: both endpoints and their messages have level 5
    assert broker.conversation_endpoint(other).priority == DEFAULT_LEVEL
    assert (
        broker.conversation_endpoint(default_request.conversation_handle).priority == DEFAULT_LEVEL
    )
    assert default_request.priority == DEFAULT_LEVEL
    assert default_reply.priority == DEFAULT_LEVEL
    # ... and the first conversation kept its level
    assert broker.conversation_endpoint(handle).priority == 3


# --- 2. precedence, one test per row -----------------------------------------------------

# (row, names the contract, names the local service, names the remote service), most
# specific first, as in SQL Server's table; the eighth row (nothing matches) is level 5.
ROWS = (
    ("contract+local+remote", True, True, True),
    ("contract+local", True, True, False),
    ("contract+remote", True, False, True),
    ("contract", True, False, False),
    ("local+remote", False, True, True),
    ("local", False, True, False),
    ("remote", False, False, True),
)
ROW_IDS = [row[0] for row in ROWS] + ["none"]
# Each row's level for the initiator endpoint's priority and for the target endpoint's
# (one priority serves both when the row names neither service: "contract", level 4).
# Per endpoint the levels are distinct, none is 5, and the tested (most specific present)
# row is never the highest, so "take the highest", "take the least specific", "take
# the other side's" and "take the default" all give a wrong level.
INITIATOR_LEVELS = (1, 2, 3, 4, 6, 7, 8)
TARGET_LEVELS = (2, 3, 1, 4, 7, 8, 9)
DECOY_LEVEL = 10
WRONG_NAMES = ("OtherContract", "OtherService", "ServiceElsewhere")


def _triple(
    row: tuple[str, bool, bool, bool], local: str, remote: str
) -> tuple[str | None, str | None, str | None]:
    _, contract, has_local, has_remote = row
    return (
        CONTRACT if contract else ANY,
        local if has_local else ANY,
        remote if has_remote else ANY,
    )


@pytest.mark.parametrize("tested", range(len(ROWS) + 1), ids=ROW_IDS)
def test_most_specific_priority_wins_over_every_less_specific_one(
    broker: Broker, tested: int
) -> None:
    # Given the seed's catalog, another contract and another service
    _seed_catalog(broker)
    broker.create_contract("OtherContract", {REQUEST: "INITIATOR"})
    broker.create_queue("OtherQueue")
    broker.create_service("OtherService", "OtherQueue", ["OtherContract"])
    # ... the priority of the tested row and one of EVERY less specific row, each once for
    # the initiator endpoint (local = initiator) and once for the target endpoint (local =
    # target), with distinct levels
    created = 0
    for j in range(tested, len(ROWS)):
        for_initiator = _triple(ROWS[j], INITIATOR, TARGET)
        for_target = _triple(ROWS[j], TARGET, INITIATOR)
        broker.create_priority(
            f"row{j}-initiator",
            contract=for_initiator[0],
            local_service=for_initiator[1],
            remote_service=for_initiator[2],
            level=INITIATOR_LEVELS[j],
        )
        created += 1
        if for_target != for_initiator:
            broker.create_priority(
                f"row{j}-target",
                contract=for_target[0],
                local_service=for_target[1],
                remote_service=for_target[2],
                level=TARGET_LEVELS[j],
            )
            created += 1
        else:
            assert INITIATOR_LEVELS[j] == TARGET_LEVELS[j]
    # ... and level-10 decoys as specific as the tested row or more, each with one name
    # that does not fit (other contract, other local service, other remote service)
    decoys: set[tuple[str | None, str | None, str | None]] = set()
    for j in range(min(tested, len(ROWS) - 1) + 1):
        for local, remote in ((INITIATOR, TARGET), (TARGET, INITIATOR)):
            triple = _triple(ROWS[j], local, remote)
            for position, wrong in enumerate(WRONG_NAMES):
                if triple[position] is not ANY:
                    decoy = list(triple)
                    decoy[position] = wrong
                    decoys.add((decoy[0], decoy[1], decoy[2]))
    for n, (contract, local, remote) in enumerate(sorted(decoys, key=str)):
        broker.create_priority(
            f"decoy{n}",
            contract=contract,
            local_service=local,
            remote_service=remote,
            level=DECOY_LEVEL,
        )
    assert len(broker.conversation_priorities()) == created + len(decoys)
    assert decoys  # every row, "none" included, has something that must not match

    # When a conversation begins, the target endpoint appears with the first request, and
    # the target answers
    handle, request, reply = _converse(broker)

    # Then each endpoint has the tested row's level for its own point of view
    expect_initiator = INITIATOR_LEVELS[tested] if tested < len(ROWS) else DEFAULT_LEVEL
    expect_target = TARGET_LEVELS[tested] if tested < len(ROWS) else DEFAULT_LEVEL
    initiator = broker.conversation_endpoint(handle)
    target = broker.conversation_endpoint(request.conversation_handle)
    assert (initiator.service_name, initiator.far_service_name) == (INITIATOR, TARGET)
    assert (target.service_name, target.far_service_name) == (TARGET, INITIATOR)
    assert initiator.priority == expect_initiator
    assert target.priority == expect_target
    # ... and so have the messages each endpoint received
    assert request.priority == expect_target
    assert reply.priority == expect_initiator


# --- 3. arguments, alter / drop, listing, honor_broker_priority -------------------------


@pytest.mark.parametrize("level", [0, 11, -1, 100, 5.0, 5.5, "5", None, True, False], ids=repr)
def test_priority_level_must_be_an_integer_from_1_to_10(broker: Broker, level: Any) -> None:
    # Given the seed's catalog and one valid priority
    _seed_catalog(broker)
    broker.create_priority("valid", contract=CONTRACT, level=4)
    # When a priority is created with the bad level, Then InvalidArgument, nothing created
    with pytest.raises(InvalidArgument):
        broker.create_priority("bad", local_service=INITIATOR, level=level)
    # When the valid one is altered to it, Then InvalidArgument, nothing changed
    with pytest.raises(InvalidArgument):
        broker.alter_priority("valid", level=level)
    assert broker.conversation_priorities() == [
        ConversationPriority("valid", CONTRACT, None, None, 4)
    ]


def test_priority_names_and_lookups_are_checked(broker: Broker) -> None:
    # Given the seed's catalog
    _seed_catalog(broker)
    # When a priority names an unknown contract, Then ContractNotFound
    with pytest.raises(ContractNotFound):
        broker.create_priority("p", contract="NoSuchContract", level=3)
    # When it names an unknown local service, Then ServiceNotFound
    with pytest.raises(ServiceNotFound):
        broker.create_priority("p", local_service="NoSuchService", level=3)
    # When its name is empty, blank, not a string or too long, Then InvalidArgument
    for name in ("", "   ", None, 7, "x" * 129):
        with pytest.raises(InvalidArgument):
            broker.create_priority(name, level=3)  # type: ignore[arg-type]
    assert broker.conversation_priorities() == []
    # When the remote service is unknown, Then it is accepted: it may live on another broker
    broker.create_priority("far", remote_service="ServiceOnAnotherBroker", level=7)
    # When valid priorities are created (ANY everywhere too)
    broker.create_priority(
        "seed", contract=CONTRACT, local_service=INITIATOR, remote_service=TARGET, level=3
    )
    broker.create_priority("anything", level=2)
    # Then a taken name is AlreadyExists, whatever it matches
    with pytest.raises(AlreadyExists):
        broker.create_priority("seed", local_service=TARGET, level=9)
    # ... so is another name for the same contract/local/remote triple
    with pytest.raises(AlreadyExists):
        broker.create_priority(
            "seed-again", contract=CONTRACT, local_service=INITIATOR, remote_service=TARGET
        )
    with pytest.raises(AlreadyExists):
        broker.create_priority("anything-again", level=8)
    with pytest.raises(AlreadyExists):
        broker.create_priority("far-again", remote_service="ServiceOnAnotherBroker", level=1)
    # ... and altering one into another's triple
    with pytest.raises(AlreadyExists):
        broker.alter_priority("seed", contract=ANY, local_service=ANY, remote_service=ANY)
    # When an unknown priority is altered or dropped, Then NotFound
    with pytest.raises(NotFound):
        broker.alter_priority("ghost", level=4)
    with pytest.raises(NotFound):
        broker.drop_priority("ghost")
    # When a priority is altered to an unknown contract or local service, Then the same
    # errors as on create
    with pytest.raises(ContractNotFound):
        broker.alter_priority("seed", contract="NoSuchContract")
    with pytest.raises(ServiceNotFound):
        broker.alter_priority("seed", local_service="NoSuchService")
    # Then conversation_priorities() lists the three, by name, unchanged by the failures
    assert broker.conversation_priorities() == [
        ConversationPriority("anything", None, None, None, 2),
        ConversationPriority("far", None, None, "ServiceOnAnotherBroker", 7),
        ConversationPriority("seed", CONTRACT, INITIATOR, TARGET, 3),
    ]


def test_endpoints_keep_their_level_after_alter_and_drop(broker: Broker) -> None:
    # Given a priority for every SimpleContract conversation, level 7
    _seed_catalog(broker)
    broker.create_priority("simple", contract=CONTRACT, level=7)
    # ... and a conversation begun under it, with a request waiting on TargetQueue
    first = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(first, REQUEST, b"before")
    [waiting] = broker.peek("TargetQueue")
    first_target = waiting.conversation_handle
    assert broker.conversation_endpoint(first).priority == 7
    assert broker.conversation_endpoint(first_target).priority == 7

    # When the priority is altered to level 2
    altered = broker.alter_priority("simple", level=2)

    # Then the change shows, and only that changed
    assert altered == ConversationPriority("simple", CONTRACT, None, None, 2)
    assert broker.conversation_priorities() == [altered]
    # ... the existing endpoints keep level 7, and so do their messages, waiting or new
    assert broker.conversation_endpoint(first).priority == 7
    assert broker.conversation_endpoint(first_target).priority == 7
    broker.send(first, REQUEST, b"after")
    assert [m.priority for m in broker.receive("TargetQueue", top=10, timeout=0)] == [7, 7]
    # ... while a new conversation gets level 2 at both ends
    second, request, reply = _converse(broker)
    assert broker.conversation_endpoint(second).priority == 2
    assert broker.conversation_endpoint(request.conversation_handle).priority == 2
    assert (request.priority, reply.priority) == (2, 2)

    # When the contract is altered to ANY (None), Then DEFAULT conversations match it too
    assert broker.alter_priority("simple", contract=None).contract_name is ANY
    third, default_request, _ = _converse(broker, contract=DEFAULT)
    assert broker.conversation_endpoint(third).priority == 2
    assert default_request.priority == 2

    # When the priority is dropped
    broker.drop_priority("simple")

    # Then it is gone, existing endpoints keep their levels, new ones get 5
    assert broker.conversation_priorities() == []
    assert broker.conversation_endpoint(first).priority == 7
    assert broker.conversation_endpoint(second).priority == 2
    assert broker.conversation_endpoint(third).priority == 2
    fourth, fourth_request, _ = _converse(broker)
    assert broker.conversation_endpoint(fourth).priority == DEFAULT_LEVEL
    assert fourth_request.priority == DEFAULT_LEVEL
    with pytest.raises(NotFound):
        broker.drop_priority("simple")


def test_target_endpoint_takes_its_level_when_the_first_message_arrives(
    broker: Broker,
) -> None:
    # Given a conversation begun while no priority exists (initiator endpoint: level 5)
    _seed_catalog(broker)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    assert broker.conversation_endpoint(handle).priority == DEFAULT_LEVEL
    # ... and a priority for the target's side created before the first SEND
    broker.create_priority("target-side", local_service=TARGET, level=9)

    # When the first request creates the target endpoint
    broker.send(handle, REQUEST, b"first")
    request = _only(broker.receive("TargetQueue", top=10, timeout=0))

    # Then the target endpoint has the new level; the initiator keeps 5
    assert broker.conversation_endpoint(request.conversation_handle).priority == 9
    assert request.priority == 9
    assert broker.conversation_endpoint(handle).priority == DEFAULT_LEVEL


def test_honor_broker_priority_defaults_off_and_can_be_set(broker: Broker) -> None:
    # Given a fresh broker, Then HONOR_BROKER_PRIORITY is off
    assert broker.honor_broker_priority() is False
    # When it is turned on, Then it reads on (also from a second broker on the database)
    broker.set_honor_broker_priority(True)
    assert broker.honor_broker_priority() is True
    with Broker(broker.url, migrate=False, timers=False) as other:
        assert other.honor_broker_priority() is True
    # When something else than a bool is given, Then InvalidArgument and it stays on
    for bad in (1, 0, "true", "OFF", None):
        with pytest.raises(InvalidArgument):
            broker.set_honor_broker_priority(bad)  # type: ignore[arg-type]
    assert broker.honor_broker_priority() is True
    # When it is turned off again, Then it reads off
    broker.set_honor_broker_priority(False)
    assert broker.honor_broker_priority() is False


# --- 4. RECEIVE order ---------------------------------------------------------------------

LEVELS = range(1, 11)


def _leveled_catalog(broker: Broker) -> None:
    """Services Target1..Target10 on TargetQueue; a target endpoint of TargetL has level L
    (local = TargetL) and so has the initiator endpoint of a dialog to it (remote =
    TargetL)."""
    _seed_catalog(broker)
    for level in LEVELS:
        broker.create_service(f"Target{level}", "TargetQueue", [CONTRACT])
        broker.create_priority(f"target-{level}", local_service=f"Target{level}", level=level)
        broker.create_priority(
            f"initiator-{level}",
            local_service=INITIATOR,
            remote_service=f"Target{level}",
            level=level,
        )


def _load_levels(
    broker: Broker, per_level: int, per_conversation: int, seed: int
) -> tuple[list[int], list[int]]:
    """``per_level`` conversations to each of Target1..Target10, ``per_conversation``
    requests each (body: the conversation's index), sent in a shuffled order.

    :return: each conversation's level, and the conversations by their first request
    """
    levels = [level for level in LEVELS for _ in range(per_level)]
    handles = [broker.begin_dialog(INITIATOR, f"Target{level}", CONTRACT) for level in levels]
    sends = [c for c in range(len(handles)) for _ in range(per_conversation)]
    random.Random(seed).shuffle(sends)
    with broker.transaction() as tx:
        for c in sends:
            tx.send(handles[c], REQUEST, str(c))
    return levels, list(dict.fromkeys(sends))


def test_single_receiver_gets_groups_by_level_then_age(broker: Broker) -> None:
    # Given 30 conversations over levels 1..10 (three each), three requests each, all on
    # TargetQueue, sent in a shuffled order; each target endpoint is its own group
    _leveled_catalog(broker)
    per_conversation = 3
    levels, first_sent = _load_levels(broker, 3, per_conversation, seed=1)
    expected = sorted(first_sent, key=lambda c: (-levels[c], first_sent.index(c)))
    assert first_sent != expected  # arrival order alone would give the wrong answer
    assert len(broker.peek("TargetQueue")) == len(levels) * per_conversation

    # When GET CONVERSATION GROUP looks first (and rolls back)
    with broker.transaction() as tx:
        group = tx.get_conversation_group("TargetQueue", timeout=0)
        tx.rollback()
    # Then it names the group of the oldest level-10 conversation
    top_group = {
        m.conversation_group_id for m in broker.peek("TargetQueue") if m.text == str(expected[0])
    }
    assert top_group == {group}

    # When one receiver takes RECEIVE TOP (100) until the queue is empty
    batches: list[list[Message]] = []
    while messages := broker.receive("TargetQueue", top=100, timeout=0):
        batches.append(messages)

    # Then every batch is one whole conversation (its group), in sequence order, with the
    # level of its target service
    for batch in batches:
        assert len({m.conversation_group_id for m in batch}) == 1
        assert len({m.body for m in batch}) == 1
        assert [m.message_sequence_number for m in batch] == list(range(per_conversation))
        level = levels[int(batch[0].text or "")]
        assert {(m.priority, m.service_name) for m in batch} == {(level, f"Target{level}")}
    # ... the groups came highest level first, oldest first within a level
    assert [int(batch[0].text or "") for batch in batches] == expected
    received_levels = [batch[0].priority for batch in batches]
    assert received_levels == sorted(received_levels, reverse=True)
    assert broker.peek("TargetQueue") == []


def test_group_level_and_order_inside_a_group(broker: Broker) -> None:
    # Given, on InitiatorQueue, group A with conversations at levels 9, 7, 4, 2, 1 (joined
    # with related_conversation), group B with one at level 8, and group C with one at
    # level 10 that has no messages and one at level 3
    _leveled_catalog(broker)
    a9 = broker.begin_dialog(INITIATOR, "Target9", CONTRACT)
    a = {9: a9}
    for level in (7, 4, 2, 1):
        a[level] = broker.begin_dialog(
            INITIATOR, f"Target{level}", CONTRACT, related_conversation=a9
        )
    b8 = broker.begin_dialog(INITIATOR, "Target8", CONTRACT)
    c10 = broker.begin_dialog(INITIATOR, "Target10", CONTRACT)
    c3 = broker.begin_dialog(INITIATOR, "Target3", CONTRACT, related_conversation=c10)
    initiators = {**{f"a{lv}": h for lv, h in a.items()}, "b8": b8, "c10": c10, "c3": c3}
    endpoints = {name: broker.conversation_endpoint(h) for name, h in initiators.items()}
    group = {name: e.conversation_group_id for name, e in endpoints.items()}
    assert len({group[f"a{lv}"] for lv in a}) == 1
    assert group["c3"] == group["c10"] != group["b8"] != group["a9"] != group["c3"]
    assert {name: e.priority for name, e in endpoints.items()} == {
        "a9": 9, "a7": 7, "a4": 4, "a2": 2, "a1": 1, "b8": 8, "c10": 10, "c3": 3
    }  # fmt: skip
    # ... each target got a request; all but c10's answer twice, in a shuffled order
    with broker.transaction() as tx:
        for name, handle in initiators.items():
            tx.send(handle, REQUEST, name)
    target_of: dict[str | None, uuid.UUID] = {}
    while requests := broker.receive("TargetQueue", top=100, timeout=0):
        target_of.update((m.text, m.conversation_handle) for m in requests)
    assert set(target_of) == set(initiators)
    replies = [name for name in initiators if name != "c10" for _ in range(2)]
    random.Random(7).shuffle(replies)
    with broker.transaction() as tx:
        for name in replies:
            tx.send(target_of[name], REPLY, name)
    assert len(broker.peek("InitiatorQueue")) == len(replies)

    def taken(messages: list[Message]) -> list[tuple[str | None, int, int]]:
        return [(m.text, m.message_sequence_number, m.priority) for m in messages]

    def whole(*names: str) -> list[tuple[str | None, int, int]]:
        return [(name, seq, int(name[1:])) for name in names for seq in range(2)]

    # When RECEIVE TOP (2) runs, Then it takes group A (level 9): a9's two replies
    assert taken(broker.receive("InitiatorQueue", top=2, timeout=0)) == whole("a9")
    # When RECEIVE runs again, Then group B comes next: A's waiting conversations are now
    # at most level 7, B is at 8
    assert taken(broker.receive("InitiatorQueue", top=100, timeout=0)) == whole("b8")
    # When RECEIVE runs again, Then group A (7) before C (3, as its level-10 conversation
    # has nothing waiting), its conversations by level, each in sequence order
    assert taken(broker.receive("InitiatorQueue", top=100, timeout=0)) == whole(
        "a7", "a4", "a2", "a1"
    )
    # When RECEIVE runs again, Then group C's level-3 conversation, and then nothing
    assert taken(broker.receive("InitiatorQueue", top=100, timeout=0)) == whole("c3")
    assert broker.receive("InitiatorQueue", top=100, timeout=0) == []


@pytest.mark.slow
def test_concurrent_receiver_processes_take_groups_by_level(db_url: str, broker: Broker) -> None:
    # Given 50 conversations over levels 1..10 (five each), two requests each, all queued
    # on TargetQueue in a shuffled order before any receiver starts
    _leveled_catalog(broker)
    per_level, per_conversation = 5, 2
    levels, first_sent = _load_levels(broker, per_level, per_conversation, seed=2)
    total = len(levels) * per_conversation
    assert [levels[c] for c in first_sent] != sorted(levels, reverse=True)

    # When 3 receiver processes RECEIVE TOP (100) at once, each holding its group 10 ms,
    # drawing a tick of one shared counter just before and just after every RECEIVE
    receivers = 3
    results = CTX.Queue()
    barrier = CTX.Barrier(receivers + 1, timeout=START_TIMEOUT)
    count = CTX.Value("i", 0)
    clock = CTX.Value("q", 0)
    processes = [
        CTX.Process(
            target=workers.receive_by_priority,
            args=(db_url, "TargetQueue", 100, 0.01, total, count, clock, barrier, results, 40.0),
        )
        for _ in range(receivers)
    ]
    with running(processes):
        barrier.wait()
        reports = collect(results, receivers)
    batches: list[workers.Batch] = [batch for _, payload in reports for batch in payload]

    # Then every message was received exactly once
    received = [(handle, seq) for *_, messages in batches for _, handle, seq, _, _ in messages]
    assert len(received) == len(set(received)) == total
    assert broker.peek("TargetQueue") == []
    # ... each batch is one whole conversation in sequence order, at its service's level
    level_of: list[int] = []
    for _, _, _, messages in batches:
        assert len({(group, handle) for group, handle, *_ in messages}) == 1
        assert [seq for _, _, seq, _, _ in messages] == list(range(per_conversation))
        [(level, service)] = {(level, service) for *_, level, service in messages}
        assert service == f"Target{level}"
        level_of.append(level)
    assert sorted(level_of) == sorted(levels)
    # ... and no group was taken while a higher-level group was still free: all were
    # queued before the receivers started, so every higher-level group had been taken or
    # was held at the moment a lower one was picked. Its RECEIVE had started by then, so
    # its start tick is below the end tick of the lower one's RECEIVE.
    for (_, end, pid, _), level in zip(batches, level_of, strict=True):
        for (other_start, _, other_pid, _), other_level in zip(batches, level_of, strict=True):
            if other_level > level:
                assert other_start < end, (
                    f"a level-{level} group (process {pid}, RECEIVE ended at tick {end}) was "
                    f"taken before a level-{other_level} group (process {other_pid}, "
                    f"RECEIVE started at tick {other_start})"
                )
    # ... and on PostgreSQL the receivers really worked side by side
    if broker.dialect == "postgresql":
        assert len({pid for _, _, pid, _ in batches}) > 1


# --- 5. RECEIVE aging -------------------------------------------------------------------

AGING = 0.5  # seconds: the aging queue's receive_aging
MARGIN = 2.0  # seconds the aged message may take beyond AGING
FLOOD_BACKLOG = 10  # level-10 messages the flood keeps ready
FLOOD_BATCH = 10  # level-10 messages per flood transaction
WARM_UP = 20  # level-10 messages received before the level-1 message is sent
WORK = 0.005  # seconds the receiver "works" on each message (outside its transaction)


class _Flood(threading.Thread):
    """Keeps at least FLOOD_BACKLOG level-10 messages ready on WorkQueue until stopped."""

    def __init__(self, url: Any, handles: list[uuid.UUID]) -> None:
        super().__init__(name="level-10-flood", daemon=True)
        self.url = url
        self.handles = handles
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.sent = 0

    def run(self) -> None:
        try:
            with Broker(self.url, migrate=False, timers=False) as broker:
                while not self.stopping.is_set():
                    ready = sum(1 for m in broker.peek("WorkQueue") if m.priority == 10)
                    if ready >= FLOOD_BACKLOG:
                        self.stopping.wait(POLL_INTERVAL / 5)
                        continue
                    with broker.transaction() as tx:
                        for i in range(FLOOD_BATCH):
                            handle = self.handles[(self.sent + i) % len(self.handles)]
                            tx.send(handle, REQUEST, b"flood")
                    self.sent += FLOOD_BATCH
        except BaseException as exc:
            self.error = exc


def _trickle_under_flood(broker: Broker, aging: float | None) -> dict[str, Any]:
    """WorkQueue (``receive_aging=aging``) with services Flood (level 10) and Trickle
    (level 1). A flood thread keeps level-10 messages ready; one receiver loops RECEIVE
    TOP (1); after WARM_UP level-10 messages, one level-1 message is sent. Runs until the
    receiver gets it or AGING + MARGIN seconds after it was sent."""
    _seed_catalog(broker)
    broker.create_queue("WorkQueue", receive_aging=aging)
    assert broker.queue("WorkQueue").receive_aging_seconds == aging
    broker.create_service("Flood", "WorkQueue", [CONTRACT])
    broker.create_service("Trickle", "WorkQueue", [CONTRACT])
    broker.create_priority("flood", local_service="Flood", level=10)
    broker.create_priority("trickle", local_service="Trickle", level=1)
    flood_handles = [broker.begin_dialog(INITIATOR, "Flood", CONTRACT) for _ in range(4)]
    trickle = broker.begin_dialog(INITIATOR, "Trickle", CONTRACT)
    outcome: dict[str, Any] = {"flood_received": 0, "flood_after_send": 0}
    flood = _Flood(broker.url, flood_handles)
    flood.start()
    try:
        sent_at: float | None = None
        warm_up_deadline = time.monotonic() + 20
        while True:
            if sent_at is None and outcome["flood_received"] >= WARM_UP:
                broker.send(trickle, REQUEST, b"trickle")
                sent_at = time.time()
                outcome["sent_at"] = sent_at
            if sent_at is None and time.monotonic() > warm_up_deadline:
                pytest.fail(f"the flood did not start: {flood.error!r}")
            if sent_at is not None and time.time() >= sent_at + AGING + MARGIN:
                break
            with broker.transaction() as tx:
                messages = tx.receive("WorkQueue", top=1, timeout=0)
                got_at = time.time()
                if messages and messages[0].priority == 1:
                    # the moment it was taken: what else was ready on the queue
                    outcome["ready_level_10"] = sum(
                        1
                        for m in tx.peek("WorkQueue")
                        if m.priority == 10 and m.status is MessageStatus.READY
                    )
            if not messages:
                time.sleep(POLL_INTERVAL)  # the flood refills the queue: look again
                continue
            if messages[0].priority == 1:
                outcome["trickle"] = messages[0]
                outcome["got_at"] = got_at
                break
            assert messages[0].priority == 10
            outcome["flood_received"] += 1
            if sent_at is not None:
                outcome["flood_after_send"] += 1
            time.sleep(WORK)  # the receiver's work on the message
        # at the deadline (or when it was taken), with the flood still running
        outcome["still_queued"] = [m for m in broker.peek("WorkQueue") if m.priority == 1]
        outcome["flood_alive"] = flood.is_alive()
    finally:
        flood.stopping.set()
        flood.join(timeout=15)
    assert not flood.is_alive(), "the flood thread did not stop"
    assert flood.error is None, repr(flood.error)
    assert outcome["flood_alive"], "the flood thread ended early"
    return outcome


@pytest.mark.slow
def test_aging_serves_a_level_1_message_through_a_level_10_flood(broker: Broker) -> None:
    # Given WorkQueue with receive_aging 0.5 s, a continuous level-10 flood, a receiver
    # looping RECEIVE TOP (1), and then one level-1 message
    # When the receiver runs until it gets the level-1 message (or 0.5 + 2 s pass)
    outcome = _trickle_under_flood(broker, AGING)

    # Then it got the level-1 message within the bound
    assert "trickle" in outcome, (
        f"level-1 message not received within {AGING + MARGIN} s "
        f"({outcome['flood_after_send']} level-10 messages were received meanwhile)"
    )
    trickle: Message = outcome["trickle"]
    assert trickle.body == b"trickle"
    assert trickle.service_name == "Trickle"
    assert outcome["got_at"] - outcome["sent_at"] < AGING + MARGIN
    # ... only once it had aged: until then the level-10 messages went first
    assert outcome["got_at"] - trickle.enqueued_at >= AGING
    assert outcome["flood_after_send"] > 0
    # ... while level-10 messages were still ready: it jumped the queue
    assert outcome["ready_level_10"] > 0
    assert outcome["still_queued"] == []


@pytest.mark.slow
def test_without_aging_the_level_10_flood_starves_the_level_1_message(broker: Broker) -> None:
    # Given the same flood and level-1 message on a queue WITHOUT aging
    # When the receiver runs for the same 0.5 + 2 s after the level-1 message was sent
    outcome = _trickle_under_flood(broker, None)

    # Then it never got the level-1 message: still on the queue at the deadline, while
    # the receiver kept taking level-10 messages
    assert "trickle" not in outcome, "the level-1 message was served during the flood"
    assert [m.body for m in outcome["still_queued"]] == [b"trickle"]
    assert outcome["flood_after_send"] > 0
