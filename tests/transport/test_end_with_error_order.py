"""END CONVERSATION across two brokers, as on one (tests/integration/test_end_and_errors.py):
the far side's END WITH ERROR is received before the messages it sent earlier that still
wait ("Broker System Messages", ms166088: an Error comes first, the rest stays
receivable), and END cancels the endpoint's conversation timer while it waits for the far
side's END."""

from __future__ import annotations

from multiproc import poll
from transport_catalog import CONTRACT, FAST_RETRY, INITIATOR, KEY, REQUEST, TARGET
from transport_catalog import INITIATOR_QUEUE as A_QUEUE
from transport_catalog import TARGET_QUEUE as B_QUEUE

from scheduler_lib.broker import DIALOG_TIMER, END_DIALOG, ERROR, Broker, EndpointState
from scheduler_lib.broker.transport import TransportEndpoint

OPTIONS = {"key": KEY, "listen": "127.0.0.1:0", **FAST_RETRY}
DEADLINE = 30.0  # seconds a delivery or a timer may take
TIMER = 0.3  # seconds: the timer END must cancel
CONTROL_TIMER = 0.6  # seconds: a timer due later, whose firing shows the first was due too


def test_far_side_error_is_received_before_the_messages_still_queued(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    with TransportEndpoint(a, **OPTIONS) as ea, TransportEndpoint(b, **OPTIONS) as eb:
        a.create_route("to target", TARGET, eb.address or "")
        b.create_route("to initiator", INITIATOR, ea.address or "")
        # Given two messages from A waiting on B's queue
        handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
        assert a.send(handle, REQUEST, b"first") == 0
        assert a.send(handle, REQUEST, b"second") == 1
        poll(lambda: len(b.peek(B_QUEUE)) == 2, DEADLINE, "both messages on B's queue")

        # When A ends the conversation with an error
        a.end_conversation(handle, error=42, description="gave up")
        poll(lambda: len(b.peek(B_QUEUE)) == 3, DEADLINE, "the Error on B's queue")

        # Then B receives the Error first (sequence -1), then the two messages in order
        got = b.receive(B_QUEUE, top=10, timeout=0)
        assert [(m.message_type_name, m.message_sequence_number) for m in got] == [
            (ERROR, -1),
            (REQUEST, 0),
            (REQUEST, 1),
        ], got
        assert got[0].error == (42, "gave up")
        assert [m.body for m in got[1:]] == [b"first", b"second"]
        far = got[0].conversation_handle
        assert b.conversation_endpoint(far).state is EndpointState.ERROR
        # and B's END closes both sides
        b.end_conversation(far)
        poll(
            lambda: a.conversation_endpoint(handle).state is EndpointState.CLOSED,
            DEADLINE,
            "A closes when B's EndDialog arrives",
        )


def test_end_cancels_the_conversation_timer(pair: tuple[Broker, Broker]) -> None:
    a, b = pair
    with TransportEndpoint(a, **OPTIONS) as ea, TransportEndpoint(b, **OPTIONS) as eb:
        a.create_route("to target", TARGET, eb.address or "")
        b.create_route("to initiator", INITIATOR, ea.address or "")
        # Given a dialog B knows of, whose A side set a timer, and a control dialog
        handle = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
        a.send(handle, REQUEST, b"job")
        control = a.begin_dialog(INITIATOR, TARGET, CONTRACT)
        poll(lambda: len(b.peek(B_QUEUE)) == 1, DEADLINE, "the message on B's queue")
        a.begin_conversation_timer(handle, TIMER)

        # When A ends while B stays open (A waits in DO for B's END)
        a.end_conversation(handle)
        a.begin_conversation_timer(control, CONTROL_TIMER)
        assert a.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND
        poll(
            lambda: END_DIALOG in {m.message_type_name for m in b.peek(B_QUEUE)},
            DEADLINE,
            "A's EndDialog on B's queue",
        )

        # Then once the later timer has fired, A's ended endpoint got no DialogTimer
        def control_fired() -> bool:
            a.fire_timers()
            return any(m.conversation_handle == control for m in a.peek(A_QUEUE))

        poll(control_fired, DEADLINE, "the control DialogTimer on A's queue")
        assert [(m.conversation_handle, m.message_type_name) for m in a.peek(A_QUEUE)] == [
            (control, DIALOG_TIMER)
        ]
        assert a.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND
