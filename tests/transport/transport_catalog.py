"""The transport tests' catalog: the same names on both brokers (imported by conftest and
the tests under a name of its own, so no other folder's conftest can shadow it)."""

from __future__ import annotations

import collections
import socket
import threading

from scheduler_lib.broker import Broker

KEY = "transport-key-for-the-tests-0123456789"
REQUEST, REPLY, CONTRACT = "Request", "Reply", "Work"
INITIATOR, TARGET = "Initiator", "Target"
INITIATOR_QUEUE, TARGET_QUEUE = "InitiatorQueue", "TargetQueue"
FAST_RETRY = {"retry_initial": 0.3, "retry_max": 2.0}  # the tests' faults cost less time


def make_catalog(broker: Broker, *, initiator: bool, target: bool) -> Broker:
    """The same message types and contract on every broker; each service on its own."""
    broker.create_message_type(REQUEST, "NONE")
    broker.create_message_type(REPLY, "NONE")
    broker.create_contract(CONTRACT, {REQUEST: "INITIATOR", REPLY: "TARGET"})
    if initiator:
        broker.create_queue(INITIATOR_QUEUE)
        broker.create_service(INITIATOR, INITIATOR_QUEUE)
    if target:
        broker.create_queue(TARGET_QUEUE)
        broker.create_service(TARGET, TARGET_QUEUE, [CONTRACT])
    return broker


def free_port() -> int:
    """A port nothing listens on now (for a process that must be told it in advance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replier:
    """The target broker's application: answers every request on the target queue with
    ``re `` and the request's first 20 bytes, and keeps what it received per
    conversation, in the order received."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.received: dict[str, list[bytes]] = collections.defaultdict(list)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.broker.transaction() as tx:
                got = tx.receive(TARGET_QUEUE, top=200, timeout=0.2)
                for m in got:
                    tx.send(m.conversation_handle, REPLY, b"re " + (m.body or b"")[:20])
            for m in got:
                self.received[str(m.conversation_handle)].append(m.body or b"")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
