"""Bad input: every case raises exactly one exception class of
``scheduler_lib.broker.exceptions`` and leaves the database exactly as it was.

Each test builds one populated database per backend (the ``broker`` fixture) and runs its
cases as subtests; the whole database (every table) is compared before and after each case.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import (
    DEFAULT,
    AlreadyExists,
    Broker,
    BrokerError,
    ContractNotFound,
    ContractViolation,
    ConversationGroupNotFound,
    ConversationNotFound,
    ConversationStateError,
    InUse,
    InvalidArgument,
    InvalidMessageBody,
    Lease,
    LeaseLost,
    MessageTooLarge,
    MessageTypeNotFound,
    NotFound,
    QueueDisabled,
    QueueNotFound,
    ServiceContractMismatch,
    ServiceNotFound,
)
from scheduler_lib.broker.poison import (
    EndConversation,
    Log,
    Notify,
    Park,
    PoisonDetector,
    PoisonPolicy,
)

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "AsyncContract"
IQ = "InitiatorQueue"
TQ = "TargetQueue"
MAX_SIZE = 1024

Case = tuple[str, Callable[[], Any], type[BrokerError]]


@dataclasses.dataclass
class World:
    """A populated broker: every kind of object and conversation state exists."""

    broker: Broker
    small: Broker  # the same database with max_message_size=1024
    engine: sa.Engine  # a plain connection for comparing whole tables
    live: uuid.UUID  # initiator of a conversing dialog (messages waiting on both sides)
    live_target: uuid.UUID
    live_target_group: uuid.UUID
    initiator_group: uuid.UUID
    typed: uuid.UUID  # initiator of a dialog on the Typed contract (JSON, XML, EMPTY)
    ended: uuid.UUID  # initiator that ended its side (DO)
    ended_target: uuid.UUID  # its target, told by EndDialog (DI)


def far_handle(broker: Broker, handle: uuid.UUID) -> uuid.UUID:
    me = broker.conversation_endpoint(handle)
    [far] = [
        e
        for e in broker.conversation_endpoints()
        if e.conversation_id == me.conversation_id and e.is_initiator != me.is_initiator
    ]
    return far.conversation_handle


@pytest.fixture
def world(scheduler_catalog: Broker, db_url: str) -> Iterator[World]:
    broker = scheduler_catalog
    broker.create_message_type("Json", "JSON")
    broker.create_message_type("Xml", "WELL_FORMED_XML")
    broker.create_message_type("Empty", "EMPTY")
    broker.create_contract("Typed", {"Json": "ANY", "Xml": "ANY", "Empty": "ANY"})
    broker.alter_service(TARGET, add_contracts=["Typed"])
    broker.create_queue("OffQueue", status=False)
    broker.create_service("OffService", "OffQueue", [CONTRACT])
    # a conversing dialog with a message waiting on each side
    live = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(live, "AsyncSent", b"hello")
    live_target = far_handle(broker, live)
    broker.send(live_target, "AsyncDone", b"hi")
    broker.send(live, "AsyncSent", b"again")
    # a typed dialog
    typed = broker.begin_dialog(INITIATOR, TARGET, "Typed")
    broker.send(typed, "Json", b'{"ok": 1}')
    # a dialog the initiator ended
    ended = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(ended, "AsyncSent", b"bye")
    ended_target = far_handle(broker, ended)
    broker.end_conversation(ended)
    # a message held for the disabled queue
    held = broker.begin_dialog(INITIATOR, "OffService", CONTRACT)
    broker.send(held, "AsyncSent", b"held")
    assert len(broker.transmission_queue()) == 1
    small = Broker(db_url, max_message_size=MAX_SIZE, timers=False)
    engine = sa.create_engine(db_url, poolclass=sa.NullPool)
    try:
        yield World(
            broker=broker,
            small=small,
            engine=engine,
            live=live,
            live_target=live_target,
            live_target_group=broker.conversation_endpoint(live_target).conversation_group_id,
            initiator_group=broker.conversation_endpoint(live).conversation_group_id,
            typed=typed,
            ended=ended,
            ended_target=ended_target,
        )
    finally:
        small.close()
        engine.dispose()


def dump(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, sorted: the whole database state."""
    with engine.connect() as conn:
        tables = sorted(sa.inspect(conn).get_table_names())
        return {
            table: sorted(
                (tuple(row) for row in conn.execute(sa.text(f'SELECT * FROM "{table}"'))),
                key=repr,
            )
            for table in tables
        }


def run_cases(subtests: Any, world: World, cases: list[Case]) -> None:
    for label, call, expected in cases:
        with subtests.test(msg=label):
            # Given the populated database
            before = dump(world.engine)
            # When the bad call is made
            try:
                call()
            except Exception as exc:
                raised: Exception | None = exc
            else:
                raised = None
            # Then exactly the expected broker exception is raised
            assert type(raised) is expected, (
                f"{label}: expected {expected.__name__}, got {raised!r}"
            )
            # and the database is unchanged
            assert dump(world.engine) == before, f"{label}: the database changed"


def test_unknown_names(subtests: Any, world: World) -> None:
    b, w = world.broker, world
    new = uuid.uuid4
    cases: list[Case] = [
        ("receive from unknown queue", lambda: b.receive("NoQueue", timeout=0), QueueNotFound),
        ("receive waiting on unknown queue", lambda: b.receive("NoQueue"), QueueNotFound),
        ("get group of unknown queue", lambda: b.get_conversation_group("NoQueue"), QueueNotFound),
        ("peek unknown queue", lambda: b.peek("NoQueue"), QueueNotFound),
        ("alter unknown queue", lambda: b.alter_queue("NoQueue", retention=True), QueueNotFound),
        ("drop unknown queue", lambda: b.drop_queue("NoQueue"), QueueNotFound),
        ("service on unknown queue", lambda: b.create_service("New", "NoQueue"), QueueNotFound),
        (
            "move service to unknown queue",
            lambda: b.alter_service(TARGET, queue="No"),
            QueueNotFound,
        ),
        (
            "dialog from unknown service",
            lambda: b.begin_dialog("No", TARGET, CONTRACT),
            ServiceNotFound,
        ),
        (
            "dialog to unknown service",
            lambda: b.begin_dialog(INITIATOR, "No", CONTRACT),
            ServiceNotFound,
        ),
        (
            "alter unknown service",
            lambda: b.alter_service("No", add_contracts=[DEFAULT]),
            ServiceNotFound,
        ),
        ("drop unknown service", lambda: b.drop_service("No"), ServiceNotFound),
        (
            "dialog on unknown contract",
            lambda: b.begin_dialog(INITIATOR, TARGET, "No"),
            ContractNotFound,
        ),
        (
            "service with unknown contract",
            lambda: b.create_service("New", TQ, ["No"]),
            ContractNotFound,
        ),
        (
            "service adds unknown contract",
            lambda: b.alter_service(TARGET, add_contracts=["No"]),
            ContractNotFound,
        ),
        ("drop unknown contract", lambda: b.drop_contract("No"), ContractNotFound),
        (
            "dialog on contract the target lacks",
            lambda: b.begin_dialog(INITIATOR, TARGET, DEFAULT),
            ServiceContractMismatch,
        ),
        ("send unknown message type", lambda: b.send(w.live, "NoType", b"x"), MessageTypeNotFound),
        (
            "contract with unknown message type",
            lambda: b.create_contract("New", {"NoType": "ANY"}),
            MessageTypeNotFound,
        ),
        (
            "alter unknown message type",
            lambda: b.alter_message_type("NoType", "JSON"),
            MessageTypeNotFound,
        ),
        ("drop unknown message type", lambda: b.drop_message_type("NoType"), MessageTypeNotFound),
        ("send on unknown handle", lambda: b.send(new(), "AsyncSent", b"x"), ConversationNotFound),
        ("end unknown handle", lambda: b.end_conversation(new()), ConversationNotFound),
        (
            "end unknown handle with cleanup",
            lambda: b.end_conversation(new(), cleanup=True),
            ConversationNotFound,
        ),
        (
            "timer on unknown handle",
            lambda: b.begin_conversation_timer(new(), 1),
            ConversationNotFound,
        ),
        (
            "move unknown handle",
            lambda: b.move_conversation(new(), w.live_target_group),
            ConversationNotFound,
        ),
        (
            "endpoint of unknown handle",
            lambda: b.conversation_endpoint(new()),
            ConversationNotFound,
        ),
        (
            "dialog related to unknown conversation",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, related_conversation=new()),
            ConversationNotFound,
        ),
        (
            "move to unknown group",
            lambda: b.move_conversation(w.live_target, new()),
            ConversationGroupNotFound,
        ),
        (
            "move to group of another queue",
            lambda: b.move_conversation(w.live_target, w.initiator_group),
            ConversationGroupNotFound,
        ),
    ]
    run_cases(subtests, world, cases)


def test_invalid_bodies(subtests: Any, world: World) -> None:
    b, w = world.broker, world
    cases: list[Case] = [
        ("malformed XML", lambda: b.send(w.typed, "Xml", b"<a><b></a>"), InvalidMessageBody),
        ("XML with two roots", lambda: b.send(w.typed, "Xml", b"<a/><b/>"), InvalidMessageBody),
        ("plain text as XML", lambda: b.send(w.typed, "Xml", "hello"), InvalidMessageBody),
        (
            "XML with undefined entity",
            lambda: b.send(w.typed, "Xml", b"<a>&nope;</a>"),
            InvalidMessageBody,
        ),
        ("malformed JSON", lambda: b.send(w.typed, "Json", b"{'a': 1}"), InvalidMessageBody),
        ("truncated JSON", lambda: b.send(w.typed, "Json", '{"a": '), InvalidMessageBody),
        ("JSON not UTF-8", lambda: b.send(w.typed, "Json", b'"\xff"'), InvalidMessageBody),
        ("body on EMPTY type", lambda: b.send(w.typed, "Empty", b"x"), InvalidMessageBody),
        ("space on EMPTY type", lambda: b.send(w.typed, "Empty", " "), InvalidMessageBody),
        (
            "bytes over max size",
            lambda: w.small.send(w.live, "AsyncSent", b"x" * (MAX_SIZE + 1)),
            MessageTooLarge,
        ),
        (
            "UTF-8 text over max size",
            lambda: w.small.send(w.live, "AsyncSent", "é" * 513),
            MessageTooLarge,
        ),
        (
            "oversized body on EMPTY type",
            lambda: w.small.send(w.typed, "Empty", b"x" * 2000),
            MessageTooLarge,
        ),
        ("dict body", lambda: b.send(w.live, "AsyncSent", {"a": 1}), InvalidArgument),
        ("int body", lambda: b.send(w.live, "AsyncSent", 5), InvalidArgument),
        ("list body", lambda: b.send(w.live, "AsyncSent", [b"x"]), InvalidArgument),
    ]
    run_cases(subtests, world, cases)


def test_invalid_arguments(subtests: Any, world: World) -> None:
    b, w = world.broker, world
    nan = math.nan
    cases: list[Case] = [
        # timeouts
        ("negative receive timeout", lambda: b.receive(TQ, timeout=-1), InvalidArgument),
        ("NaN receive timeout", lambda: b.receive(TQ, timeout=nan), InvalidArgument),
        ("text receive timeout", lambda: b.receive(TQ, timeout="1"), InvalidArgument),
        ("bool receive timeout", lambda: b.receive(TQ, timeout=True), InvalidArgument),
        (
            "negative get-group timeout",
            lambda: b.get_conversation_group(TQ, timeout=-0.5),
            InvalidArgument,
        ),
        (
            "NaN get-group timeout",
            lambda: b.get_conversation_group(TQ, timeout=nan),
            InvalidArgument,
        ),
        ("negative timer", lambda: b.begin_conversation_timer(w.live, -1), InvalidArgument),
        ("NaN timer", lambda: b.begin_conversation_timer(w.live, nan), InvalidArgument),
        ("no timer timeout", lambda: b.begin_conversation_timer(w.live, None), InvalidArgument),
        ("text timer", lambda: b.begin_conversation_timer(w.live, "5"), InvalidArgument),
        (
            "negative lifetime",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=-1),
            InvalidArgument,
        ),
        (
            "zero lifetime",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=0),
            InvalidArgument,
        ),
        (
            "NaN lifetime",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=nan),
            InvalidArgument,
        ),
        # top
        ("top=0", lambda: b.receive(TQ, top=0, timeout=0), InvalidArgument),
        ("negative top", lambda: b.receive(TQ, top=-1, timeout=0), InvalidArgument),
        ("fractional top", lambda: b.receive(TQ, top=1.5, timeout=0), InvalidArgument),
        ("bool top", lambda: b.receive(TQ, top=True, timeout=0), InvalidArgument),
        ("text top", lambda: b.receive(TQ, top="3", timeout=0), InvalidArgument),
        # handles and group ids
        ("non-UUID handle on send", lambda: b.send("not-a-uuid", "AsyncSent"), InvalidArgument),
        ("int handle on send", lambda: b.send(12345, "AsyncSent"), InvalidArgument),
        ("non-UUID handle on end", lambda: b.end_conversation("x"), InvalidArgument),
        ("non-UUID handle on timer", lambda: b.begin_conversation_timer("x", 1), InvalidArgument),
        ("non-UUID handle on endpoint", lambda: b.conversation_endpoint(None), InvalidArgument),
        (
            "non-UUID conversation filter",
            lambda: b.receive(TQ, timeout=0, conversation="x"),
            InvalidArgument,
        ),
        ("non-UUID group filter", lambda: b.receive(TQ, timeout=0, group="x"), InvalidArgument),
        (
            "both receive filters",
            lambda: b.receive(TQ, timeout=0, conversation=w.live_target, group=w.live_target_group),
            InvalidArgument,
        ),
        (
            "non-UUID group on move",
            lambda: b.move_conversation(w.live_target, "x"),
            InvalidArgument,
        ),
        (
            "non-UUID related group",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, related_group="x"),
            InvalidArgument,
        ),
        (
            "both related arguments",
            lambda: b.begin_dialog(
                INITIATOR,
                TARGET,
                CONTRACT,
                related_conversation=w.live,
                related_group=w.initiator_group,
            ),
            InvalidArgument,
        ),
        (
            "related conversation on another queue",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, related_conversation=w.live_target),
            InvalidArgument,
        ),
        (
            "related group of another queue",
            lambda: b.begin_dialog(INITIATOR, TARGET, CONTRACT, related_group=w.live_target_group),
            InvalidArgument,
        ),
        # system message types and type names
        ("send EndDialog", lambda: b.send(w.live, "EndDialog"), InvalidArgument),
        (
            "send Error",
            lambda: b.send(w.live, "Error", b'{"code": 1, "description": "x"}'),
            InvalidArgument,
        ),
        ("send DialogTimer", lambda: b.send(w.live, "DialogTimer"), InvalidArgument),
        ("message type not a string", lambda: b.send(w.live, None, b"x"), InvalidArgument),
        # END CONVERSATION WITH ERROR
        ("error code 0", lambda: b.end_conversation(w.live, 0, "x"), InvalidArgument),
        ("negative error code", lambda: b.end_conversation(w.live, -5, "x"), InvalidArgument),
        ("bool error code", lambda: b.end_conversation(w.live, True, "x"), InvalidArgument),
        ("error without description", lambda: b.end_conversation(w.live, 50000), InvalidArgument),
        (
            "error with empty description",
            lambda: b.end_conversation(w.live, 50000, ""),
            InvalidArgument,
        ),
        (
            "description without error",
            lambda: b.end_conversation(w.live, description="x"),
            InvalidArgument,
        ),
        # catalog arguments
        ("empty message type name", lambda: b.create_message_type(""), InvalidArgument),
        ("overlong message type name", lambda: b.create_message_type("x" * 129), InvalidArgument),
        ("unknown validation", lambda: b.create_message_type("New", "YAML"), InvalidArgument),
        (
            "alter to unknown validation",
            lambda: b.alter_message_type("Json", "YAML"),
            InvalidArgument,
        ),
        ("contract without message types", lambda: b.create_contract("New", {}), InvalidArgument),
        (
            "contract with unknown direction",
            lambda: b.create_contract("New", {"Json": "BOTH"}),
            InvalidArgument,
        ),
        (
            "contract listing a system type",
            lambda: b.create_contract("New", {"EndDialog": "ANY"}),
            InvalidArgument,
        ),
        ("contract types as a list", lambda: b.create_contract("New", ["Json"]), InvalidArgument),
        (
            "negative max readers",
            lambda: b.create_queue("New", max_queue_readers=-1),
            InvalidArgument,
        ),
        ("text queue status", lambda: b.create_queue("New", status="on"), InvalidArgument),
        (
            "activation without procedure",
            lambda: b.create_queue("New", activation_status=True),
            InvalidArgument,
        ),
        ("alter retention to text", lambda: b.alter_queue(TQ, retention="yes"), InvalidArgument),
        ("empty service name", lambda: b.create_service(" ", TQ), InvalidArgument),
    ]
    run_cases(subtests, world, cases)


def test_poison_policies_leases_and_the_poison_log(subtests: Any, world: World) -> None:
    b = world.broker
    nan = math.nan
    message = b.peek(TQ)[0]
    gone = Lease(str(uuid.uuid4()), message, "nobody", 30.0, 0.0)

    def policy(*dispositions: Any, threshold: Any = 1) -> PoisonPolicy:
        return PoisonPolicy(threshold=threshold, dispositions=dispositions)

    cases: list[Case] = [
        ("zero threshold", lambda: policy(Log(), threshold=0), InvalidArgument),
        ("bool threshold", lambda: policy(Log(), threshold=True), InvalidArgument),
        ("text threshold", lambda: policy(Log(), threshold="5"), InvalidArgument),
        ("no dispositions", lambda: policy(), InvalidArgument),
        ("disposition by name", lambda: policy("log"), InvalidArgument),
        ("a disposition twice", lambda: policy(Log(), Log()), InvalidArgument),
        ("negative park delay", lambda: policy(Park(delay=-1)), InvalidArgument),
        ("NaN park delay", lambda: policy(Park(delay=nan)), InvalidArgument),
        ("zero park cycles", lambda: policy(Park(delay=1, max_cycles=0)), InvalidArgument),
        ("zero error code", lambda: policy(EndConversation(code=0)), InvalidArgument),
        ("empty description", lambda: policy(EndConversation(description="")), InvalidArgument),
        ("notify nobody", lambda: policy(Notify(event=False)), InvalidArgument),
        ("callback not callable", lambda: policy(Notify(callback=42)), InvalidArgument),  # type: ignore[arg-type]
        (
            "stored callable callback",
            lambda: b.set_poison_policy(TQ, policy(Notify(callback=print))),
            InvalidArgument,
        ),
        (
            "stored callback that cannot be imported",
            lambda: b.set_poison_policy(TQ, policy(Notify(callback="no_such.module.fn"))),
            InvalidArgument,
        ),
        ("policy as text", lambda: b.set_poison_policy(TQ, "log"), InvalidArgument),  # type: ignore[arg-type]
        ("policy on unknown queue", lambda: b.set_poison_policy("Nope", None), QueueNotFound),
        ("policy of unknown queue", lambda: b.poison_policy("Nope"), QueueNotFound),
        ("detector policy as text", lambda: PoisonDetector(b, TQ, "log"), InvalidArgument),  # type: ignore[arg-type]
        ("replay nothing", lambda: b.replay_poison_messages([]), InvalidArgument),
        ("replay id zero", lambda: b.replay_poison_messages([0]), InvalidArgument),
        ("replay id as text", lambda: b.replay_poison_messages(["1"]), InvalidArgument),  # type: ignore[list-item]
        ("replay unknown id", lambda: b.replay_poison_messages([12345]), NotFound),
        ("drop unknown id", lambda: b.drop_poison_messages([12345]), NotFound),
        ("show unknown id", lambda: b.poison_message(12345), NotFound),
        ("list unknown state", lambda: b.poison_messages(state="GONE"), InvalidArgument),
        ("incidents of a bad handle", lambda: b.poison_incidents("nope", 0), InvalidArgument),
        ("zero lease", lambda: b.take(TQ, timeout=0, lease=0), InvalidArgument),
        ("negative lease", lambda: b.take(TQ, timeout=0, lease=-1), InvalidArgument),
        ("take from unknown queue", lambda: b.take("Nope", timeout=0), QueueNotFound),
        ("complete an unknown lease", lambda: b.complete(gone), LeaseLost),
        ("renew an unknown lease", lambda: b.renew(gone), LeaseLost),
        ("abandon an unknown lease", lambda: b.abandon(gone, "x"), LeaseLost),
    ]
    run_cases(subtests, world, cases)


def test_conflicts_contract_and_state_violations(subtests: Any, world: World) -> None:
    b, w = world.broker, world
    cases: list[Case] = [
        # duplicates and drops that would orphan something
        ("duplicate queue", lambda: b.create_queue(TQ), AlreadyExists),
        ("duplicate service", lambda: b.create_service(TARGET, IQ), AlreadyExists),
        ("duplicate contract", lambda: b.create_contract(CONTRACT, {"Json": "ANY"}), AlreadyExists),
        ("duplicate message type", lambda: b.create_message_type("Json"), AlreadyExists),
        (
            "message type named like a system type",
            lambda: b.create_message_type("Error"),
            AlreadyExists,
        ),
        ("drop queue used by a service", lambda: b.drop_queue(TQ), InUse),
        ("drop service with conversations", lambda: b.drop_service(TARGET), InUse),
        ("drop contract a service accepts", lambda: b.drop_contract(CONTRACT), InUse),
        ("drop message type a contract lists", lambda: b.drop_message_type("Json"), InUse),
        # the contract
        ("type not in the contract", lambda: b.send(w.live, DEFAULT, b"x"), ContractViolation),
        ("type of another contract", lambda: b.send(w.live, "Json", b"{}"), ContractViolation),
        (
            "initiator sends the target's type",
            lambda: b.send(w.live, "AsyncDone", b"x"),
            ContractViolation,
        ),
        (
            "target sends the initiator's type",
            lambda: b.send(w.live_target, "AsyncSent", b"x"),
            ContractViolation,
        ),
        # endpoint states
        (
            "send after the far side ended",
            lambda: b.send(w.ended_target, "AsyncDone", b"x"),
            ConversationStateError,
        ),
        (
            "send after this side ended",
            lambda: b.send(w.ended, "AsyncSent", b"x"),
            ConversationStateError,
        ),
        (
            "end again after this side ended",
            lambda: b.end_conversation(w.ended),
            ConversationStateError,
        ),
        (
            "end with error after this side ended",
            lambda: b.end_conversation(w.ended, 1, "x"),
            ConversationStateError,
        ),
        (
            "timer after this side ended",
            lambda: b.begin_conversation_timer(w.ended, 1),
            ConversationStateError,
        ),
        # a disabled queue
        ("receive from a disabled queue", lambda: b.receive("OffQueue", timeout=0), QueueDisabled),
        (
            "get group of a disabled queue",
            lambda: b.get_conversation_group("OffQueue", timeout=0),
            QueueDisabled,
        ),
    ]
    run_cases(subtests, world, cases)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///:memory:",
        "sqlite:///file::memory:?cache=shared",
        "mysql://user@localhost/broker",
        "oracle://user@localhost/broker",
        "postgresql+asyncpg://user@localhost/broker",
        "not a database url",
    ],
)
def test_unusable_database_urls(url: str) -> None:
    # Given a URL of an in-memory SQLite database, an unsupported backend or driver, or junk
    # When a broker is made on it
    # Then InvalidArgument, before anything connects
    with pytest.raises(InvalidArgument) as info:
        Broker(url)
    assert type(info.value) is InvalidArgument
