"""Catalog: message types, contracts, queues and services (create / alter / drop), on
SQLite and PostgreSQL (the ``broker`` fixture runs each test once per backend)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_lib.broker import (
    DEFAULT,
    AlreadyExists,
    Broker,
    ContractNotFound,
    InUse,
    InvalidArgument,
    InvalidMessageBody,
    MessageTypeNotFound,
    QueueNotFound,
    SentBy,
    ServiceNotFound,
    Validation,
)

# --- message types -------------------------------------------------------------------


def test_message_types_create_list_drop(broker: Broker) -> None:
    # Given a freshly migrated broker
    # Then the DEFAULT message type (no validation) and the DEFAULT contract exist,
    # the contract letting either side send DEFAULT; so does what event notifications
    # travel as (EventNotification on PostEventNotification)
    assert broker.message_types() == {
        DEFAULT: Validation.NONE,
        "EventNotification": Validation.JSON,
    }
    assert broker.contract("PostEventNotification") == {"EventNotification": SentBy.INITIATOR}
    assert broker.contract(DEFAULT) == {DEFAULT: SentBy.ANY}
    # When one message type per validation is created (enum, text in any case, default)
    broker.create_message_type("None1", Validation.NONE)
    broker.create_message_type("Empty1", "EMPTY")
    broker.create_message_type("Xml1", "well_formed_xml")
    broker.create_message_type("Json1", Validation.JSON)
    broker.create_message_type("Default1")
    # Then each is listed with its validation (NONE when not given)
    assert broker.message_types() == {
        DEFAULT: Validation.NONE,
        "EventNotification": Validation.JSON,
        "None1": Validation.NONE,
        "Empty1": Validation.EMPTY,
        "Xml1": Validation.WELL_FORMED_XML,
        "Json1": Validation.JSON,
        "Default1": Validation.NONE,
    }
    # When a taken name (or a system message type's) is created again
    # Then AlreadyExists and the original keeps its validation
    for taken in ("Json1", DEFAULT, "EndDialog", "Error", "DialogTimer"):
        with pytest.raises(AlreadyExists):
            broker.create_message_type(taken, "EMPTY")
    assert broker.message_types()["Json1"] is Validation.JSON
    assert "EndDialog" not in broker.message_types()
    # When an unknown validation is given, InvalidArgument and nothing is created
    with pytest.raises(InvalidArgument):
        broker.create_message_type("Bad", "YAML")
    assert "Bad" not in broker.message_types()
    # When an unknown message type is altered or dropped, MessageTypeNotFound
    with pytest.raises(MessageTypeNotFound):
        broker.alter_message_type("Ghost", "JSON")
    with pytest.raises(MessageTypeNotFound):
        broker.drop_message_type("Ghost")
    # When an unused message type is dropped
    broker.drop_message_type("Json1")
    # Then it is gone and its name is free again
    assert "Json1" not in broker.message_types()
    broker.create_message_type("Json1", "EMPTY")
    assert broker.message_types()["Json1"] is Validation.EMPTY


def test_alter_message_type_changes_validation_applied_by_send(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a conversation whose AsyncSent type has no validation
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    assert broker.send(handle, "AsyncSent", b"not json") == 0
    # When the message type is altered to JSON
    broker.alter_message_type("AsyncSent", "JSON")
    # Then the catalog shows it and SEND now validates bodies as JSON
    assert broker.message_types()["AsyncSent"] is Validation.JSON
    with pytest.raises(InvalidMessageBody):
        broker.send(handle, "AsyncSent", b"still not json")
    assert broker.send(handle, "AsyncSent", b'{"ok": true}') == 1


# --- contracts -----------------------------------------------------------------------


def test_contracts_create_and_errors(broker: Broker) -> None:
    # Given three message types
    for name in ("Ask", "Answer", "Chat"):
        broker.create_message_type(name)
    # When a contract lists them with INITIATOR, TARGET and ANY
    broker.create_contract("Talk", {"Ask": "INITIATOR", "Answer": SentBy.TARGET, "Chat": "any"})
    # Then the contract returns each with its direction
    expected = {"Ask": SentBy.INITIATOR, "Answer": SentBy.TARGET, "Chat": SentBy.ANY}
    assert broker.contract("Talk") == expected
    # When a contract of that name is created again, AlreadyExists; the original stays
    with pytest.raises(AlreadyExists):
        broker.create_contract("Talk", {"Ask": "ANY"})
    assert broker.contract("Talk") == expected
    # When a contract names an unknown message type
    # Then MessageTypeNotFound and no half-made contract remains
    with pytest.raises(MessageTypeNotFound):
        broker.create_contract("Half", {"Chat": "ANY", "Unknown": "ANY"})
    with pytest.raises(ContractNotFound):
        broker.contract("Half")
    # When an unknown contract is read or dropped, ContractNotFound
    with pytest.raises(ContractNotFound):
        broker.contract("Ghost")
    with pytest.raises(ContractNotFound):
        broker.drop_contract("Ghost")
    # When a message type a contract lists is dropped
    # Then InUse and it stays
    with pytest.raises(InUse):
        broker.drop_message_type("Chat")
    assert "Chat" in broker.message_types()
    # When the contract is dropped first, the message type can go
    broker.drop_contract("Talk")
    broker.drop_message_type("Chat")
    assert "Chat" not in broker.message_types()


def test_drop_contract_is_in_use_until_nothing_uses_it(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given TargetService accepts AsyncContract and a conversation follows it
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    broker.send(handle, "AsyncSent", b"x")
    # When AsyncContract is dropped
    # Then InUse: a service accepts it
    with pytest.raises(InUse):
        broker.drop_contract("AsyncContract")
    # Given the service no longer accepts it
    broker.alter_service("TargetService", drop_contracts=["AsyncContract"])
    # Then dropping it is still InUse: the open conversation follows it
    with pytest.raises(InUse):
        broker.drop_contract("AsyncContract")
    assert "AsyncSent" in broker.contract("AsyncContract")
    # Given both sides ended the conversation
    [target] = [e for e in broker.conversation_endpoints() if not e.is_initiator]
    broker.end_conversation(handle)
    broker.end_conversation(target.conversation_handle)
    # When the contract is dropped
    broker.drop_contract("AsyncContract")
    # Then it is gone and its message types are free to drop
    with pytest.raises(ContractNotFound):
        broker.contract("AsyncContract")
    broker.drop_message_type("AsyncSent")
    assert "AsyncSent" not in broker.message_types()


# --- queues --------------------------------------------------------------------------


def test_queues_create_read_drop(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given the scheduler catalog
    # When a queue is created with no settings
    broker.create_queue("Plain")
    # Then it is on, without retention or activation, with poison handling
    info = broker.queue("Plain")
    assert info.name == "Plain"
    assert info.is_receive_enabled is True
    assert info.is_retention_enabled is False
    assert info.is_activation_enabled is False
    assert info.activation_procedure is None
    assert info.max_readers == 0
    assert info.execute_as is None
    assert info.is_poison_message_handling_enabled is True
    # When a queue is created with every setting given
    broker.create_queue(
        "Busy",
        status=False,
        retention=True,
        activation_status=True,
        activation_procedure="pkg.mod.reader",
        max_queue_readers=4,
        execute_as="svc_user",
        poison_message_handling=False,
    )
    # Then every setting is stored as given
    info = broker.queue("Busy")
    assert info.is_receive_enabled is False
    assert info.is_retention_enabled is True
    assert info.is_activation_enabled is True
    assert info.activation_procedure == "pkg.mod.reader"
    assert info.max_readers == 4
    assert info.execute_as == "svc_user"
    assert info.is_poison_message_handling_enabled is False
    assert [q.name for q in broker.queues()] == ["Busy", "InitiatorQueue", "Plain", "TargetQueue"]
    # When a queue of a taken name is created, AlreadyExists and the original stays
    with pytest.raises(AlreadyExists):
        broker.create_queue("Busy")
    assert broker.queue("Busy").is_retention_enabled is True
    # When an unknown queue is read, altered or dropped, QueueNotFound
    with pytest.raises(QueueNotFound):
        broker.queue("Ghost")
    with pytest.raises(QueueNotFound):
        broker.alter_queue("Ghost", status=False)
    with pytest.raises(QueueNotFound):
        broker.drop_queue("Ghost")
    # When a queue a service uses is dropped, InUse and it stays
    with pytest.raises(InUse):
        broker.drop_queue("TargetQueue")
    assert broker.queue("TargetQueue").name == "TargetQueue"
    # When unused queues are dropped, they are gone
    broker.drop_queue("Plain")
    broker.drop_queue("Busy")
    assert [q.name for q in broker.queues()] == ["InitiatorQueue", "TargetQueue"]


def test_alter_queue_changes_only_what_is_given(broker: Broker) -> None:
    # Given a queue with activation settings
    broker.create_queue(
        "Q",
        activation_status=True,
        activation_procedure="pkg.mod.reader",
        max_queue_readers=2,
        execute_as="svc_user",
    )
    before = broker.queue("Q")
    # When only retention is altered
    after = broker.alter_queue("Q", retention=True)
    # Then retention changed and every other setting stayed
    assert after == broker.queue("Q")
    assert after == dataclasses.replace(before, is_retention_enabled=True)
    # When activation and the poison flag are turned off
    after = broker.alter_queue("Q", activation_status=False, poison_message_handling=False)
    # Then the procedure, readers, identity and retention are still stored
    assert after == dataclasses.replace(
        before,
        is_retention_enabled=True,
        is_activation_enabled=False,
        is_poison_message_handling_enabled=False,
    )
    # When status goes off and the readers change
    after = broker.alter_queue("Q", status=False, max_queue_readers=7)
    assert (after.is_receive_enabled, after.max_readers, after.activation_procedure) == (
        False,
        7,
        "pkg.mod.reader",
    )
    # When activation is turned on for a queue without a procedure (create or alter)
    # Then InvalidArgument and nothing changes
    broker.create_queue("Bare")
    with pytest.raises(InvalidArgument):
        broker.create_queue("Q2", activation_status=True)
    with pytest.raises(InvalidArgument):
        broker.alter_queue("Bare", activation_status=True)
    assert broker.queue("Bare").is_activation_enabled is False
    assert [q.name for q in broker.queues()] == ["Bare", "Q"]


# --- services ------------------------------------------------------------------------


def test_services_create_alter_and_errors(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given the scheduler catalog
    # When a second target service accepts AsyncContract and DEFAULT
    broker.create_service("Second", "TargetQueue", ["AsyncContract", DEFAULT])
    # Then each service shows its queue and contracts
    assert broker.service("Second") == {
        "service_name": "Second",
        "queue_name": "TargetQueue",
        "contracts": sorted(["AsyncContract", DEFAULT]),
    }
    assert broker.service("InitiatorService")["contracts"] == []
    listed = {s["service_name"]: s["queue_name"] for s in broker.services()}
    assert listed == {
        "InitiatorService": "InitiatorQueue",
        "Second": "TargetQueue",
        "TargetService": "TargetQueue",
    }
    # When a taken name is created on another queue, AlreadyExists; the original stays
    with pytest.raises(AlreadyExists):
        broker.create_service("TargetService", "InitiatorQueue")
    assert broker.service("TargetService")["queue_name"] == "TargetQueue"
    # When a service names an unknown queue or contract, nothing is created
    with pytest.raises(QueueNotFound):
        broker.create_service("New", "GhostQueue")
    with pytest.raises(ContractNotFound):
        broker.create_service("New", "TargetQueue", ["AsyncContract", "GhostContract"])
    # When an unknown service is read, altered or dropped, ServiceNotFound
    for call in (
        lambda: broker.service("New"),
        lambda: broker.alter_service("New", add_contracts=[DEFAULT]),
        lambda: broker.drop_service("New"),
    ):
        with pytest.raises(ServiceNotFound):
            call()
    # When Second adds nothing new, drops AsyncContract
    broker.alter_service("Second", add_contracts=[DEFAULT], drop_contracts=["AsyncContract"])
    # Then it accepts only DEFAULT
    assert broker.service("Second")["contracts"] == [DEFAULT]
    # When it drops a contract it lacks, adds an unknown one or moves to an unknown queue
    # Then ContractNotFound / QueueNotFound and nothing changes
    with pytest.raises(ContractNotFound):
        broker.alter_service("Second", drop_contracts=["AsyncContract"])
    with pytest.raises(ContractNotFound):
        broker.alter_service("Second", add_contracts=["Ghost"])
    with pytest.raises(QueueNotFound):
        broker.alter_service("Second", queue="Ghost", add_contracts=["AsyncContract"])
    assert broker.service("Second") == {
        "service_name": "Second",
        "queue_name": "TargetQueue",
        "contracts": [DEFAULT],
    }
    # When an unused service is dropped, it is gone
    broker.drop_service("Second")
    assert "Second" not in {s["service_name"] for s in broker.services()}


def test_alter_service_moves_waiting_messages_to_new_queue(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given two messages waiting for TargetService on TargetQueue
    broker.create_queue("NewQueue")
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    broker.send(handle, "AsyncSent", b"one")
    broker.send(handle, "AsyncSent", b"two")
    assert len(broker.peek("TargetQueue")) == 2
    # When the service moves to NewQueue
    broker.alter_service("TargetService", queue="NewQueue")
    # Then the messages and the target endpoint moved with it
    assert broker.service("TargetService")["queue_name"] == "NewQueue"
    assert broker.peek("TargetQueue") == []
    target = next(e for e in broker.conversation_endpoints() if not e.is_initiator)
    assert target.queue_name == "NewQueue"
    received = broker.receive("NewQueue", top=10, timeout=5)
    assert [m.body for m in received] == [b"one", b"two"]
    assert {m.queue_name for m in received} == {"NewQueue"}
    # and later messages go to the new queue too
    broker.send(handle, "AsyncSent", b"three")
    assert [m.body for m in broker.receive("NewQueue", timeout=5)] == [b"three"]
    assert broker.peek("TargetQueue") == []


def test_alter_service_moves_messages_held_for_its_disabled_queue(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a message held in the transmission queue because TargetQueue is off
    broker.create_queue("NewQueue")
    broker.alter_queue("TargetQueue", status=False)
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    broker.send(handle, "AsyncSent", b"held")
    assert len(broker.transmission_queue()) == 1
    # When TargetService moves to NewQueue, which is on
    broker.alter_service("TargetService", queue="NewQueue")
    # Then the held message follows the service (its conversation is on NewQueue now)
    received = broker.receive("NewQueue", top=10, timeout=1)
    assert [m.body for m in received] == [b"held"]
    assert broker.transmission_queue() == []


def test_drop_service_with_conversations_is_in_use(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a conversation between the two services with both endpoints present
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    broker.send(handle, "AsyncSent", b"x")
    # When either service is dropped
    # Then InUse, and both services remain
    with pytest.raises(InUse):
        broker.drop_service("TargetService")
    with pytest.raises(InUse):
        broker.drop_service("InitiatorService")
    assert broker.service("TargetService")["queue_name"] == "TargetQueue"
    # When both sides end the conversation
    target = next(e for e in broker.conversation_endpoints() if not e.is_initiator)
    broker.end_conversation(handle)
    broker.end_conversation(target.conversation_handle)
    # Then the services can be dropped
    broker.drop_service("TargetService")
    broker.drop_service("InitiatorService")
    assert broker.services() == []


def test_drop_target_service_of_a_just_begun_dialog_is_in_use(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a dialog begun to TargetService, before its first message (no target endpoint)
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    # When TargetService is dropped
    # Then InUse: the dialog still names it as its far service
    with pytest.raises(InUse):
        broker.drop_service("TargetService")
    # and the dialog can still send
    assert broker.send(handle, "AsyncSent", b"x") == 0


def test_catalog_changes_in_rolled_back_transaction_leave_nothing(broker: Broker) -> None:
    # Given a broker
    # When catalog objects are created in a transaction that fails
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        tx.create_message_type("T1", "JSON")
        tx.create_contract("C1", {"T1": "ANY"})
        tx.create_queue("Q1")
        tx.create_service("S1", "Q1", ["C1"])
        raise RuntimeError("boom")
    # Then none of them exist
    assert "T1" not in broker.message_types()
    assert broker.queues() == []
    assert broker.services() == []
    with pytest.raises(ContractNotFound):
        broker.contract("C1")
    # When the same is done in a transaction that commits
    with broker.transaction() as tx:
        tx.create_message_type("T1", "JSON")
        tx.create_contract("C1", {"T1": "ANY"})
        tx.create_queue("Q1")
        tx.create_service("S1", "Q1", ["C1"])
    # Then all of them exist
    assert broker.service("S1") == {"service_name": "S1", "queue_name": "Q1", "contracts": ["C1"]}
    assert broker.contract("C1") == {"T1": SentBy.ANY}
