"""Poison messages and failure recovery, on SQLite and PostgreSQL: built-in detection,
the seed's detector and its dispositions, the holding queue, leases and silent failures."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from multiproc import collect, poll, running

from scheduler_lib.broker import (
    ERROR,
    Broker,
    ConversationNotFound,
    ConversationStateError,
    EndpointState,
    LeaseLost,
    Message,
    NotFound,
    QueueDisabled,
    Transaction,
)
from scheduler_lib.broker.broker import TIMER_POLL_INTERVAL
from scheduler_lib.broker.poison import (
    POISON_ERROR_CODE,
    Drop,
    EndConversation,
    Log,
    Notify,
    Park,
    PoisonDetector,
    PoisonEvent,
    PoisonPolicy,
)

QUEUE = "TargetQueue"
EVENTS = "EventQueue"
WAIT = 20.0  # seconds: deadline for conditions that should hold within a second or two

seen_by_callback: list[PoisonEvent] = []


def answer_with_failure(event: PoisonEvent) -> None:
    """A Notify callback stored by dotted path: tells the caller with a failure result."""
    seen_by_callback.append(event)
    event.tx.send(event.message.conversation_handle, "AsyncDone", b"failed: poison")


class Boom(RuntimeError):
    pass


def fail(tx: Transaction, message: Message) -> None:
    raise Boom(f"cannot handle {message.text!r}")


def _conversation(broker: Broker, *bodies: str) -> uuid.UUID:
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    for body in bodies:
        broker.send(handle, "AsyncSent", body)
    return handle


def _target_of(broker: Broker, handle: uuid.UUID) -> uuid.UUID:
    conversation = broker.conversation_endpoint(handle).conversation_id
    (target,) = [
        e.conversation_handle
        for e in broker.conversation_endpoints()
        if e.conversation_id == conversation and not e.is_initiator
    ]
    return target


def _end_both_sides(broker: Broker, handle: uuid.UUID) -> None:
    target = _target_of(broker, handle)
    broker.end_conversation(handle, cleanup=True)
    broker.end_conversation(target, cleanup=True)


def _roll_back_a_receive(broker: Broker, queue: str = QUEUE) -> None:
    with pytest.raises(Boom), broker.transaction() as tx:
        assert tx.receive(queue, timeout=0), "a message to receive"
        raise Boom("the handler failed")


@pytest.fixture
def events(scheduler_catalog: Broker) -> Broker:
    """A subscriber service for event notifications on EventQueue."""
    broker = scheduler_catalog
    broker.create_queue(EVENTS)
    broker.create_service("EventService", EVENTS, ["PostEventNotification"])
    return broker


@pytest.fixture
def no_builtin(scheduler_catalog: Broker) -> Broker:
    """TargetQueue with built-in detection off: the application decides."""
    scheduler_catalog.alter_queue(QUEUE, poison_message_handling=False)
    return scheduler_catalog


# --- built-in detection -----------------------------------------------------------------


def test_exactly_the_fifth_consecutive_rollback_disables_the_queue(events: Broker) -> None:
    broker = events
    broker.create_event_notification("disabled", QUEUE, "EventService", "BROKER_QUEUE_DISABLED")
    _conversation(broker, "poison")
    # Four rollbacks in a row do not disable it
    for count in range(1, 5):
        _roll_back_a_receive(broker)
        info = broker.queue(QUEUE)
        assert info.is_receive_enabled and info.consecutive_rollbacks == count
    assert broker.receive(EVENTS, timeout=0) == []
    # The fifth does
    _roll_back_a_receive(broker)
    info = broker.queue(QUEUE)
    assert not info.is_receive_enabled
    assert info.disabled_reason is not None and "5 consecutive rollbacks" in info.disabled_reason
    assert info.disabled_at is not None and abs(info.disabled_at - time.time()) < 60
    # The event arrives
    (event,) = broker.receive(EVENTS, timeout=WAIT)
    assert event.message_type_name == "EventNotification"
    body = event.json()
    assert body["EventType"] == "BROKER_QUEUE_DISABLED"
    assert body["ObjectName"] == QUEUE
    assert "5 consecutive rollbacks" in body["Reason"]
    # Receives fail clearly; the message is kept
    with pytest.raises(QueueDisabled, match=r"TargetQueue.*5 consecutive rollbacks.*status=True"):
        broker.receive(QUEUE, timeout=0)
    with pytest.raises(QueueDisabled), broker.transaction() as tx:
        tx.get_conversation_group(QUEUE, timeout=0)
    assert [m.text for m in broker.peek(QUEUE)] == ["poison"]


def test_re_enabling_delivers_what_waited_and_starts_counting_afresh(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    handle = _conversation(broker, "first")
    for _ in range(5):
        _roll_back_a_receive(broker)
    assert not broker.queue(QUEUE).is_receive_enabled
    broker.send(handle, "AsyncSent", "sent while off")  # held in the transmission queue
    assert len(broker.transmission_queue()) == 1
    info = broker.alter_queue(QUEUE, status=True)
    assert info.is_receive_enabled and info.disabled_reason is None
    assert info.consecutive_rollbacks == 0
    assert [m.text for m in broker.receive(QUEUE, top=10, timeout=0)] == ["first", "sent while off"]
    # Counting starts from zero again
    broker.send(handle, "AsyncSent", "again")
    for _ in range(4):
        _roll_back_a_receive(broker)
    assert broker.queue(QUEUE).is_receive_enabled


def test_a_commit_in_between_resets_the_count(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "a")
    _conversation(broker, "b")
    for _ in range(4):
        _roll_back_a_receive(broker)
    assert broker.queue(QUEUE).consecutive_rollbacks == 4
    with broker.transaction() as tx:  # one transaction that received commits
        assert len(tx.receive(QUEUE, timeout=0)) == 1
    assert broker.queue(QUEUE).consecutive_rollbacks == 0
    for _ in range(4):
        _roll_back_a_receive(broker)
    assert broker.queue(QUEUE).is_receive_enabled
    _roll_back_a_receive(broker)
    assert not broker.queue(QUEUE).is_receive_enabled


def test_the_short_form_receive_also_resets_the_count(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "a", "b")
    _roll_back_a_receive(broker)
    assert broker.queue(QUEUE).consecutive_rollbacks == 1
    assert len(broker.receive(QUEUE, timeout=0)) == 1  # autocommit: the fast path
    assert broker.queue(QUEUE).consecutive_rollbacks == 0


def test_rollbacks_that_received_nothing_do_not_count(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    for _ in range(6):
        with pytest.raises(Boom), broker.transaction() as tx:
            assert tx.receive(QUEUE, timeout=0) == []
            raise Boom("nothing received")
    assert broker.queue(QUEUE).consecutive_rollbacks == 0
    assert broker.queue(QUEUE).is_receive_enabled


def test_with_the_option_off_a_message_failing_100_times_never_disables_the_queue(
    no_builtin: Broker,
) -> None:
    broker = no_builtin
    _conversation(broker, "poison")
    for _ in range(100):
        _roll_back_a_receive(broker)
    info = broker.queue(QUEUE)
    assert info.is_receive_enabled and info.consecutive_rollbacks == 0
    assert [m.text for m in broker.peek(QUEUE)] == ["poison"]


def test_a_waiting_receiver_learns_the_queue_was_turned_off(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            broker.receive(QUEUE, timeout=WAIT)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # let it start waiting; the assertion below does not depend on it
    broker.alter_queue(QUEUE, status=False)
    started = time.monotonic()
    waiter.join(WAIT + 5)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], QueueDisabled)
    assert "turned off by alter_queue" in str(errors[0])
    assert time.monotonic() - started < WAIT / 2  # woken, not timed out


# --- the seed's detector ----------------------------------------------------------------


def _drain(detector: PoisonDetector, handler: Callable[[Transaction, Message], Any]) -> list[Any]:
    outcomes = []
    while True:
        got = detector.handle_next(handler, timeout=0)
        if not got:
            return outcomes
        outcomes.extend(got)


def test_the_detector_routes_a_message_at_the_threshold(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "poison", "good 1", "good 2")
    calls: list[str] = []

    def handler(tx: Transaction, message: Message) -> None:
        calls.append(message.text or "")
        if message.text == "poison":
            raise Boom("poison")

    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=3, dispositions=(Log(),)))
    outcomes = _drain(detector, handler)
    assert [(o.message.text, o.status) for o in outcomes] == [
        ("poison", "failed"),
        ("poison", "failed"),
        ("poison", "failed"),
        ("poison", "routed"),
        ("good 1", "handled"),
        ("good 2", "handled"),
    ]
    # One reader: the handler ran exactly threshold times on the poison message
    assert calls.count("poison") == 3
    assert detector.counts == {"handled": 2, "failed": 3, "routed": 1, "discarded": 0}
    (logged,) = broker.poison_messages()
    assert logged.state == "LOGGED" and logged.message.text == "poison"
    assert logged.failures == 3 and "Boom: poison" in (logged.last_error or "")
    assert broker.queue(QUEUE).is_receive_enabled


def test_the_fifth_rollback_wins_over_a_detector_threshold_of_five(
    scheduler_catalog: Broker,
) -> None:
    # As in SQL Server: with built-in detection on, the queue stops before the detector.
    broker = scheduler_catalog
    _conversation(broker, "poison")
    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=5))
    for _ in range(5):
        assert detector.handle_next(fail, timeout=0)[0].status == "failed"
    with pytest.raises(QueueDisabled):
        detector.handle_next(fail, timeout=0)


def test_failures_are_recorded_outside_the_failed_transaction(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "poison")
    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=10))
    (outcome,) = detector.handle_next(fail, timeout=0)
    assert outcome.status == "failed"
    history = broker.failure_history(outcome.message)
    assert history.failures == 1 and "cannot handle 'poison'" in (history.last_error or "")
    incidents = broker.poison_incidents(
        outcome.message.conversation_handle, outcome.message.message_sequence_number
    )
    assert [i["kind"] for i in incidents] == ["FAILED"]
    assert str(os.getpid()) in incidents[0]["worker"]
    # Handled at last: its failures are forgotten with the commit
    (done,) = detector.handle_next(lambda tx, m: None, timeout=0)
    assert done.status == "handled"
    assert broker.failure_history(done.message).failures == 0


def test_drop_consumes_the_message_and_tells_nobody(no_builtin: Broker) -> None:
    broker = no_builtin
    handle = _conversation(broker, "poison")
    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=1, dispositions=(Drop(),)))
    assert [o.status for o in _drain(detector, fail)] == ["failed", "routed"]
    assert broker.peek(QUEUE) == [] and broker.poison_messages() == []
    assert broker.conversation_endpoint(handle).state is not EndpointState.ERROR
    assert broker.receive("InitiatorQueue", timeout=0) == []


def test_end_conversation_tells_the_partner_with_an_error(no_builtin: Broker) -> None:
    broker = no_builtin
    handle = _conversation(broker, "poison")
    detector = PoisonDetector(
        broker, QUEUE, PoisonPolicy(threshold=2, dispositions=(EndConversation(),))
    )
    assert [o.status for o in _drain(detector, fail)] == ["failed", "failed", "routed"]
    (error,) = broker.receive("InitiatorQueue", timeout=WAIT)
    assert error.message_type_name == ERROR and error.conversation_handle == handle
    assert error.error is not None
    code, description = error.error
    assert code == POISON_ERROR_CODE
    assert "failed 2 times" in description and "cannot handle 'poison'" in description
    assert broker.poison_messages() == []  # not logged: this policy does not say so


def test_log_keeps_the_message_with_its_history(no_builtin: Broker) -> None:
    broker = no_builtin
    handle = _conversation(broker, "poison")
    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=2, dispositions=(Log(),)))
    _drain(detector, fail)
    (logged,) = broker.poison_messages(queue=QUEUE, state="logged")
    assert logged.message.conversation_handle == _target_of(broker, handle)
    assert logged.message.body == b"poison" and logged.failures == 2
    assert logged.dispositions == "log" and logged.redeliver_at is None
    assert broker.poison_message(logged.poison_id) == logged
    kinds = [
        i["kind"]
        for i in broker.poison_incidents(
            logged.message.conversation_handle, logged.message.message_sequence_number
        )
    ]
    assert kinds == ["FAILED", "FAILED"]
    # The conversation is still open: the message can be replayed onto it
    assert broker.conversation_endpoint(handle).state is EndpointState.STARTED_OUTBOUND


def test_notify_posts_an_event_and_calls_back_inside_the_transaction(
    events: Broker,
) -> None:
    broker = events
    broker.alter_queue(QUEUE, poison_message_handling=False)
    broker.create_event_notification("poison", QUEUE, "EventService", "POISON_MESSAGE")
    handle = _conversation(broker, "poison")
    seen_by_callback.clear()
    policy = PoisonPolicy(
        threshold=1,
        dispositions=(Log(), Notify(event=True, callback=f"{__name__}.answer_with_failure")),
    )
    broker.set_poison_policy(QUEUE, policy)
    assert broker.poison_policy(QUEUE) == policy
    detector = PoisonDetector(broker, QUEUE)  # the queue's stored policy
    assert [o.status for o in _drain(detector, fail)] == ["failed", "routed"]
    (event,) = broker.receive(EVENTS, timeout=WAIT)
    body = event.json()
    assert body["EventType"] == "POISON_MESSAGE" and body["ObjectName"] == QUEUE
    assert body["ConversationHandle"] == str(_target_of(broker, handle))
    assert body["Failures"] == 1
    (logged,) = broker.poison_messages()
    assert body["PoisonId"] == logged.poison_id
    (called,) = seen_by_callback
    assert called.message.text == "poison" and called.poison_id == logged.poison_id
    # What the callback sent in the routing transaction reached the caller
    (answer,) = broker.receive("InitiatorQueue", timeout=WAIT)
    assert answer.message_type_name == "AsyncDone" and answer.body == b"failed: poison"


def test_a_parked_message_comes_back_after_its_delay_until_its_cycles_run_out(
    no_builtin: Broker,
) -> None:
    broker = no_builtin
    handle = _conversation(broker, "poison", "next")
    delay = 0.5
    policy = PoisonPolicy(
        threshold=1, dispositions=(Park(delay=delay, max_cycles=2), EndConversation())
    )
    detector = PoisonDetector(broker, QUEUE, policy)
    handled: list[str] = []

    def handler(tx: Transaction, message: Message) -> None:
        if message.text == "poison":
            raise Boom("still poison")
        handled.append(message.text or "")

    # Fails once, then is parked; the next message of its conversation is not held up
    assert [o.status for o in _drain(detector, handler)] == ["failed", "routed", "handled"]
    assert handled == ["next"]
    (parked,) = broker.poison_messages(state="PARKED")
    assert parked.cycles == 1 and parked.redeliver_at is not None
    assert parked.redeliver_at - parked.recorded_at == pytest.approx(delay, abs=0.05)
    assert broker.peek(QUEUE) == []
    # The timer thread brings it back after the delay, with its sequence number
    back = poll(lambda: broker.peek(QUEUE), WAIT, "the parked message came back")
    assert [(m.text, m.message_sequence_number) for m in back] == [("poison", 0)]
    assert time.time() >= parked.redeliver_at
    assert broker.poison_messages() == []
    # Counted afresh: one more failure parks it a second (and last) time
    assert [o.status for o in _drain(detector, handler)] == ["failed", "routed"]
    assert broker.poison_messages(state="PARKED")[0].cycles == 2
    poll(lambda: broker.peek(QUEUE), WAIT, "the parked message came back again")
    # Cycles used up: the policy's other disposition applies
    assert [o.status for o in _drain(detector, handler)] == ["failed", "routed"]
    (error,) = broker.receive("InitiatorQueue", timeout=WAIT)
    assert error.message_type_name == ERROR and error.conversation_handle == handle
    assert broker.poison_messages() == []


def test_park_alone_logs_when_its_cycles_run_out(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "poison")
    policy = PoisonPolicy(threshold=1, dispositions=(Park(delay=0.2, max_cycles=1),))
    detector = PoisonDetector(broker, QUEUE, policy)
    _drain(detector, fail)
    poll(lambda: broker.peek(QUEUE), WAIT, "the parked message came back")
    _drain(detector, fail)
    (logged,) = broker.poison_messages()
    assert logged.state == "LOGGED" and logged.cycles == 1 and logged.dispositions == "log"


def test_a_parked_message_whose_conversation_ended_is_kept_for_an_operator(
    no_builtin: Broker,
) -> None:
    broker = no_builtin
    handle = _conversation(broker, "poison")
    policy = PoisonPolicy(threshold=1, dispositions=(Park(delay=0.3),))
    _drain(PoisonDetector(broker, QUEUE, policy), fail)
    _end_both_sides(broker, handle)
    logged = poll(
        lambda: broker.poison_messages(state="LOGGED"), WAIT, "the parked message was logged"
    )
    assert "conversation ended while it was parked" in (logged[0].last_error or "")
    assert broker.peek(QUEUE) == []


def test_replay_requeues_exactly_the_chosen_messages(no_builtin: Broker) -> None:
    broker = no_builtin
    for body in ("a", "b", "c"):
        _conversation(broker, body)
    policy = PoisonPolicy(threshold=1, dispositions=(Log(),))
    _drain(PoisonDetector(broker, QUEUE, policy), fail)
    logged = {p.message.text: p for p in broker.poison_messages()}
    assert set(logged) == {"a", "b", "c"}
    assert broker.replay_poison_messages([logged["a"].poison_id, logged["c"].poison_id]) == 2
    assert sorted(m.text or "" for m in broker.peek(QUEUE)) == ["a", "c"]
    assert [p.message.text for p in broker.poison_messages()] == ["b"]
    # Their failures are forgotten: the handler gets them again
    message = broker.peek(QUEUE)[0]
    assert broker.failure_history(message).failures == 0
    assert broker.drop_poison_messages([logged["b"].poison_id]) == 1
    assert broker.poison_messages() == []


def test_replay_is_all_or_none(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "kept")
    ended = _conversation(broker, "ended")
    policy = PoisonPolicy(threshold=1, dispositions=(Log(),))
    _drain(PoisonDetector(broker, QUEUE, policy), fail)
    ids = {p.message.text: p.poison_id for p in broker.poison_messages()}
    _end_both_sides(broker, ended)
    with pytest.raises(ConversationNotFound, match=r"has ended"):
        broker.replay_poison_messages([ids["kept"], ids["ended"]])
    assert broker.peek(QUEUE) == []
    assert len(broker.poison_messages()) == 2
    with pytest.raises(NotFound, match=r"poison message 999 does not exist"):
        broker.replay_poison_messages([999])
    with pytest.raises(NotFound, match=r"poison message 999 does not exist"):
        broker.drop_poison_messages([ids["kept"], 999])
    assert len(broker.poison_messages()) == 2


# --- leases: long work, silent failures --------------------------------------------------


def test_take_then_complete_with_the_answer(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    handle = _conversation(broker, "long task")
    (lease,) = broker.take(QUEUE, timeout=0, lease=30)
    assert lease.message.text == "long task"
    assert broker.peek(QUEUE) == []  # off the queue while the work runs
    (held,) = broker.leases(QUEUE)
    assert held["lease_id"] == lease.lease_id and held["worker"] == lease.worker
    with broker.transaction() as tx:
        tx.send(lease.message.conversation_handle, "AsyncDone", "done")
        tx.complete(lease)
    assert broker.leases() == []
    (answer,) = broker.receive("InitiatorQueue", timeout=0)
    assert answer.conversation_handle == handle and answer.body == b"done"
    with pytest.raises(LeaseLost):
        broker.complete(lease)


def test_the_answer_completes_the_lease_in_the_same_send(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    handle = _conversation(broker, "task")
    (lease,) = broker.take(QUEUE, timeout=0, lease=30)
    # When the answer is sent completing the lease
    with broker.transaction() as tx:
        tx.send(lease.message.conversation_handle, "AsyncDone", "done", completing=lease)
    # Then the lease is over and the answer is there, once
    assert broker.leases() == []
    (answer,) = broker.receive("InitiatorQueue", timeout=0)
    assert answer.conversation_handle == handle and answer.body == b"done"
    # And a second answer completing the same lease is refused and sends nothing
    with pytest.raises(LeaseLost), broker.transaction() as tx:
        tx.send(lease.message.conversation_handle, "AsyncDone", "again", completing=lease)
    assert broker.receive("InitiatorQueue", timeout=0) == []
    # ... also in its short form, which runs in a transaction of its own
    with pytest.raises(LeaseLost):
        broker.send(lease.message.conversation_handle, "AsyncDone", "again", completing=lease)
    assert broker.receive("InitiatorQueue", timeout=0) == []


def test_an_answer_completing_an_expired_lease_rolls_back(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "task")
    (lease,) = broker.take(QUEUE, timeout=0, lease=0.3)
    # Given the lease expired (nobody renewed it) and its message went back
    poll(lambda: broker.peek(QUEUE), WAIT, "the expired lease's message came back")
    # When the late worker answers completing it, Then nothing is sent
    with pytest.raises(LeaseLost), broker.transaction() as tx:
        tx.send(lease.message.conversation_handle, "AsyncDone", "too late", completing=lease)
    assert broker.receive("InitiatorQueue", timeout=0) == []
    assert [m.text for m in broker.peek(QUEUE)] == ["task"]


def test_keep_alive_holds_a_lease_past_its_duration(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "long task")
    (lease,) = broker.take(QUEUE, timeout=0, lease=0.6)
    with broker.keep_alive([lease]) as lost:
        time.sleep(2.0)  # the work: more than three lease durations
    assert lost == {}
    broker.complete(lease)
    assert broker.peek(QUEUE) == [] and broker.poison_messages() == []


def test_an_expired_lease_is_retried_then_routed_and_the_caller_told(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    broker.set_poison_policy(QUEUE, PoisonPolicy(threshold=2))  # default: Log + EndConversation
    handle = _conversation(broker, "long task")
    (first,) = broker.take(QUEUE, timeout=0, lease=0.3)
    # Nobody renews it: the timer thread counts a failure and puts it back
    back = poll(lambda: broker.peek(QUEUE), WAIT, "the expired lease's message came back")
    assert [m.text for m in back] == ["long task"]
    history = broker.failure_history(back[0])
    assert history.failures == 1 and "lease expired" in (history.last_error or "")
    # The late worker cannot answer: its transaction rolls back
    with pytest.raises(LeaseLost), broker.transaction() as tx:
        tx.send(first.message.conversation_handle, "AsyncDone", "too late")
        tx.complete(first)
    assert broker.receive("InitiatorQueue", timeout=0) == []
    # The second silent failure reaches the threshold: logged, and the caller told
    broker.take(QUEUE, timeout=0, lease=0.3)
    (error,) = broker.receive("InitiatorQueue", timeout=WAIT)
    assert error.message_type_name == ERROR and error.conversation_handle == handle
    (logged,) = broker.poison_messages()
    assert logged.failures == 2 and logged.message.text == "long task"
    assert broker.leases() == []


def test_abandon_counts_a_failure_and_requeues(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "task")
    (lease,) = broker.take(QUEUE, timeout=0, lease=30)
    assert broker.abandon(lease, Boom("out of memory")) == "requeued"
    (back,) = broker.peek(QUEUE)
    assert back.message_sequence_number == lease.message.message_sequence_number
    assert "Boom: out of memory" in (broker.failure_history(back).last_error or "")
    with pytest.raises(LeaseLost):
        broker.abandon(lease)


def test_a_worker_killed_during_a_long_task_fails_its_caller_within_the_heartbeat_bound(
    scheduler_catalog: Broker, db_url: str
) -> None:
    broker = scheduler_catalog
    broker.set_poison_policy(
        QUEUE, PoisonPolicy(threshold=1, dispositions=(Log(), EndConversation()))
    )
    handle = _conversation(broker, "long task")
    lease_seconds = 2.0
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    worker = ctx.Process(
        target=__import__("poison_workers").take_and_hang,
        args=(db_url, QUEUE, lease_seconds, results),
    )
    with running([worker]):
        ((pid, lease_id),) = collect(results, 1)
        assert [row["lease_id"] for row in broker.leases()] == [lease_id]
        time.sleep(lease_seconds * 1.5)  # the worker renews it: still held
        assert [row["lease_id"] for row in broker.leases()] == [lease_id]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        (error,) = broker.receive("InitiatorQueue", timeout=WAIT)
        waited = time.monotonic() - killed
    assert error.message_type_name == ERROR and error.conversation_handle == handle
    assert error.error is not None and "lease expired" in error.error[1]
    # The bound: the lease's duration, plus the timer thread's poll, plus slack for a
    # loaded machine
    assert waited <= lease_seconds + TIMER_POLL_INTERVAL + 3.0
    (logged,) = broker.poison_messages()
    assert logged.message.text == "long task"
    (incident,) = broker.poison_incidents(logged.message.conversation_handle, 0)
    assert incident["kind"] == "EXPIRED" and str(pid) in incident["worker"]


# --- nothing is lost -------------------------------------------------------------------


def _number(message: Message) -> int:
    return int((message.text or "").split(":")[0])


def test_every_message_sent_is_accounted_for(no_builtin: Broker) -> None:
    """Many conversations, two readers with a detector, flaky and poison messages, a
    parked cycle, a dropping queue and expired leases: at the end every message sent is
    handled once, logged, or dropped on purpose — none lost, none twice."""
    broker = no_builtin
    broker.create_queue("DropQueue", poison_message_handling=False)
    broker.create_service("DropService", "DropQueue", ["AsyncContract"])
    sent: dict[tuple[str, int], str] = {}  # (target queue, body id) -> kind
    kinds = ["good"] * 6 + ["flaky", "poison"]
    for i in range(40):
        kind = kinds[i % len(kinds)]
        to = "TargetService" if i % 5 else "DropService"
        h = broker.begin_dialog("InitiatorService", to, "AsyncContract")
        broker.send(h, "AsyncSent", f"{i}:{kind}")
        sent[("TargetQueue" if i % 5 else "DropQueue", i)] = kind
    # Three messages are taken under leases that their worker never renews
    abandoned = broker.take(QUEUE, top=1, timeout=0, lease=0.2)
    abandoned += broker.take(QUEUE, top=1, timeout=0, lease=0.2)
    attempts: dict[int, int] = {}
    lock = threading.Lock()

    def handler(tx: Transaction, message: Message) -> None:
        number, kind = (message.text or "").split(":")
        with lock:
            attempts[int(number)] = attempts.get(int(number), 0) + 1
            tries = attempts[int(number)]
        if kind == "poison" or (kind == "flaky" and tries == 1):
            raise Boom(f"{kind} attempt {tries}")

    policies = {
        QUEUE: PoisonPolicy(threshold=2, dispositions=(Park(delay=0.2, max_cycles=1), Log())),
        "DropQueue": PoisonPolicy(threshold=2, dispositions=(Drop(),)),
    }
    outcomes: list[Any] = []

    def reader(queue: str) -> None:
        detector = PoisonDetector(broker, queue, policies[queue])
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 3.0:  # parked ones return within 0.2 s
            got = detector.handle_next(handler, timeout=0.2)
            if got:
                idle_since = time.monotonic()
                with lock:
                    outcomes.extend((queue, o) for o in got)

    threads = [threading.Thread(target=reader, args=(q,)) for q in (QUEUE, QUEUE, "DropQueue")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    handled = [
        (q, int((o.message.text or "").split(":")[0])) for q, o in outcomes if o.status == "handled"
    ]
    dropped = [
        (q, int((o.message.text or "").split(":")[0]))
        for q, o in outcomes
        if o.status == "routed" and o.dispositions == ("drop",)
    ]
    logged = [
        (p.message.queue_name, int((p.message.text or "").split(":")[0]))
        for p in broker.poison_messages(state="LOGGED")
    ]
    # Nothing is anywhere else
    assert broker.peek(QUEUE) == [] and broker.peek("DropQueue") == []
    assert broker.leases() == [] and broker.poison_messages(state="PARKED") == []
    assert broker.transmission_queue() == []
    # Each message exactly once in exactly one place
    accounted = handled + dropped + logged
    assert len(accounted) == len(set(accounted))
    assert sorted(accounted) == sorted(sent)
    # And in the place its kind says
    for place, kind in ((handled, {"good", "flaky"}), (dropped, {"poison"}), (logged, {"poison"})):
        assert {sent[key] for key in place} <= kind
    assert {key for key in logged} == {
        key for key, kind in sent.items() if kind == "poison" and key[0] == QUEUE
    }
    assert all(lease.message.queue_name == QUEUE for lease in abandoned)


def broken_callback(event: PoisonEvent) -> None:
    event.tx.send(event.message.conversation_handle, "AsyncDone", b"half done")
    raise RuntimeError("the callback is broken")


def test_a_broken_callback_does_not_hold_the_routing_up(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "poison")
    policy = PoisonPolicy(
        threshold=1, dispositions=(Log(), Notify(event=False, callback=broken_callback))
    )
    outcomes = _drain(PoisonDetector(broker, QUEUE, policy), fail)
    assert [o.status for o in outcomes] == ["failed", "routed"]
    assert [p.message.text for p in broker.poison_messages()] == ["poison"]
    # What the callback did before it failed was undone with it (its savepoint)
    assert broker.receive("InitiatorQueue", timeout=0) == []


def test_events_find_a_new_dialog_when_the_subscriber_ended_the_old_one(events: Broker) -> None:
    broker = events
    broker.alter_queue(QUEUE, poison_message_handling=False)
    broker.create_event_notification("poison", QUEUE, "EventService", "POISON_MESSAGE")
    detector = PoisonDetector(
        broker, QUEUE, PoisonPolicy(threshold=1, dispositions=(Log(), Notify()))
    )
    _conversation(broker, "first")
    _drain(detector, fail)
    (first,) = broker.receive(EVENTS, timeout=WAIT)
    broker.end_conversation(first.conversation_handle)  # the subscriber hangs up
    _conversation(broker, "second")
    _drain(detector, fail)
    (*_, second) = broker.receive(EVENTS, top=10, timeout=WAIT)
    assert second.message_type_name == "EventNotification"
    assert second.json()["EventType"] == "POISON_MESSAGE"
    assert second.conversation_handle != first.conversation_handle
    assert len(broker.poison_messages()) == 2


def test_routing_that_ends_a_conversation_discards_the_rest_of_its_batch(
    no_builtin: Broker,
) -> None:
    broker = no_builtin
    _conversation(broker, "poison", "after 1", "after 2")
    policy = PoisonPolicy(threshold=1, dispositions=(Log(), EndConversation()))
    detector = PoisonDetector(broker, QUEUE, policy)
    handled: list[str] = []

    def handler(tx: Transaction, message: Message) -> None:
        if message.text == "poison":
            raise Boom("poison")
        handled.append(message.text or "")

    assert [o.status for o in detector.handle_next(handler, timeout=0, top=10)] == ["failed"]
    outcomes = detector.handle_next(handler, timeout=0, top=10)
    assert [(o.message.text, o.status) for o in outcomes] == [
        ("poison", "routed"),
        ("after 1", "discarded"),
        ("after 2", "discarded"),
    ]
    assert handled == []
    (error,) = broker.receive("InitiatorQueue", timeout=WAIT)
    assert error.message_type_name == ERROR


def test_replay_onto_a_conversation_this_side_ended_is_refused(no_builtin: Broker) -> None:
    broker = no_builtin
    _conversation(broker, "poison")
    policy = PoisonPolicy(threshold=1, dispositions=(Log(), EndConversation()))
    _drain(PoisonDetector(broker, QUEUE, policy), fail)
    (logged,) = broker.poison_messages()
    with pytest.raises(ConversationStateError, match=r"DISCONNECTED_OUTBOUND on this side"):
        broker.replay_poison_messages([logged.poison_id])
    assert broker.poison_messages() == [logged]


def test_turning_detection_off_and_on_restarts_the_count(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    _conversation(broker, "poison")
    for _ in range(4):
        _roll_back_a_receive(broker)
    broker.alter_queue(QUEUE, poison_message_handling=False)
    broker.alter_queue(QUEUE, poison_message_handling=True)
    assert broker.queue(QUEUE).consecutive_rollbacks == 0
    _roll_back_a_receive(broker)
    assert broker.queue(QUEUE).is_receive_enabled
