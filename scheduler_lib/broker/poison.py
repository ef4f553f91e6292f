"""Poison messages and failure recovery (seed 004, DESIGN.md section 7).

Three mechanisms, from the bluntest to the finest:

* **Built-in detection** (queue option ``poison_message_handling``, on by default): five
  consecutive rollbacks of transactions that received from a queue turn the queue off
  and post ``BROKER_QUEUE_DISABLED``. A transaction that received and commits resets the
  count (the reset is written inside the receiving transaction, so it only counts if that
  transaction commits). Turning the queue back on is explicit: ``alter_queue(q,
  status=True)``.
* **The seed's detector** (:class:`PoisonDetector`, for queues with built-in detection
  off): failures are recorded *outside* the failed transaction, in
  ``poison_message_details``; a message that has failed ``threshold`` times is routed to
  its policy's dispositions on its next receive instead of to the handler.
* **Leases** for long work (:mod:`~scheduler_lib.broker.leases`): the message leaves its queue
  in a short transaction and waits under its worker's heartbeat. A lease whose heartbeat
  runs out is a silent failure, counted like any other; the policy retries it or routes
  it, and a policy with :class:`EndConversation` (the default) tells the partner.

Counts are "at least", not exact: a failure is recorded after its transaction rolled
back, so another reader can receive the message again before the record is committed
(it then sees the older count and runs the handler once more), and a process that dies
between the rollback and the record does not record at all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker.failures import PoisonOperations
from scheduler_lib.broker.ops import poison as poisoning
from scheduler_lib.broker.ops.poison import (
    DEFAULT_THRESHOLD,
    POISON_ERROR_CODE,
    REPLAYABLE_STATES,
    ROLLBACK_LIMIT,
    Disposition,
    Drop,
    EndConversation,
    History,
    Log,
    Notify,
    Park,
    PoisonEvent,
    PoisonMessage,
    PoisonPolicy,
    error_text,
    worker_name,
)

if TYPE_CHECKING:
    from scheduler_lib.broker import broker as brokers

__all__ = [
    "DEFAULT_THRESHOLD",
    "POISON_ERROR_CODE",
    "REPLAYABLE_STATES",
    "ROLLBACK_LIMIT",
    "Disposition",
    "Drop",
    "EndConversation",
    "History",
    "Log",
    "Notify",
    "Outcome",
    "Park",
    "PoisonDetector",
    "PoisonEvent",
    "PoisonMessage",
    "PoisonOperations",
    "PoisonPolicy",
    "error_text",
    "worker_name",
]

log = logging.getLogger(__name__)

POLICY_REFRESH = 5.0  # seconds a detector trusts the queue's stored policy


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a :class:`PoisonDetector` did with one message: ``handled`` (the handler
    committed), ``failed`` (the handler raised; the failure was recorded), ``routed``
    (the message had failed ``threshold`` times and went to its dispositions) or
    ``discarded`` (received in the same batch as a routed message whose disposition
    ended their conversation)."""

    message: models.Message
    status: str
    error: str | None = None
    dispositions: tuple[str, ...] = ()


# --- the seed's detector ---------------------------------------------------------------


Handler = Callable[["brokers.Transaction", models.Message], Any]


class PoisonDetector:
    """The seed's application-level detector around a message handler.

    Each message is received and handled in one transaction. When the handler raises, the
    transaction rolls back (the message is back on its queue) and the failure is recorded
    in a transaction of its own. A message that has failed ``policy.threshold`` times is
    routed to the policy's dispositions on its next receive, instead of to the handler.

    Use it on a queue with built-in detection off (``poison_message_handling=False``), or
    with a threshold below 5: otherwise the fifth rollback turns the queue off first, as
    in SQL Server.

    :param policy: the policy to apply; default: the queue's stored policy, re-read every
        few seconds
    """

    def __init__(
        self,
        broker: brokers.Broker,
        queue: str,
        policy: PoisonPolicy | None = None,
        *,
        worker: str | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, PoisonPolicy):
            raise exceptions.InvalidArgument(f"expected a PoisonPolicy or None, got {policy!r}")
        self.broker = broker
        self.queue = queue
        self.worker = worker
        self._policy = policy
        self._stored: tuple[float, PoisonPolicy] | None = None
        self.counts = {"handled": 0, "failed": 0, "routed": 0, "discarded": 0}

    @property
    def policy(self) -> PoisonPolicy:
        if self._policy is not None:
            return self._policy
        now = time.monotonic()
        if self._stored is None or now - self._stored[0] > POLICY_REFRESH:
            self._stored = (now, self.broker.poison_policy(self.queue))
        return self._stored[1]

    def handle_next(
        self, handler: Handler, *, timeout: float | None = None, top: int = 1
    ) -> list[Outcome]:
        """Receive up to ``top`` messages (one conversation group) and handle each.

        :param handler: ``handler(tx, message)``; it runs inside the receiving transaction
        :return: what happened to each message; ``[]`` when the timeout passed. After a
            failure, only the failed message is reported: the others went back unhandled
        """
        policy = self.policy
        tx = self.broker.transaction()
        current: models.Message | None = None
        try:
            messages = tx.receive(self.queue, top, timeout)
            outcomes = []
            histories: dict[str, list[Mapping[str, Any]]] = {}
            ended: set[str] = set()
            for message in messages:
                handle = str(message.conversation_handle)
                if handle in ended:
                    # An earlier message's disposition ended this conversation: what
                    # else it had is discarded with it, as END CONVERSATION does.
                    outcomes.append(Outcome(message, "discarded"))
                    continue
                if handle not in histories:
                    histories[handle] = tx.session.all("poison_history_conversation", handle=handle)
                hist = poisoning.summarize(
                    [
                        r
                        for r in histories[handle]
                        if int(r["message_sequence_number"]) == message.message_sequence_number
                    ]
                )
                if hist.failures >= policy.threshold:
                    applied, was_ended = poisoning.route(tx.session, message, policy, hist)
                    if was_ended:
                        ended.add(handle)
                    outcomes.append(Outcome(message, "routed", hist.last_error, applied))
                    continue
                current = message
                handler(tx, message)
                current = None
                if hist.incidents:
                    tx.session.execute(
                        "poison_history_delete", handle=handle, seq=message.message_sequence_number
                    )
                outcomes.append(Outcome(message, "handled"))
            tx.commit()
        except Exception as exc:
            tx.rollback()
            if current is None:
                raise  # not the handler's failure: not the message's fault
            error = error_text(exc)
            log.warning(
                "handling message %s/%s from %s failed; recorded as a failure",
                current.conversation_handle,
                current.message_sequence_number,
                self.queue,
                exc_info=True,
            )
            self.broker.record_failure(current, error, worker=self.worker)
            self.counts["failed"] += 1
            return [Outcome(current, "failed", error)]
        except BaseException:
            tx.rollback()
            raise
        for outcome in outcomes:
            self.counts[outcome.status] += 1
        return outcomes

    def serve(self, handler: Handler, *, idle_timeout: float = 5.0, top: int = 1) -> int:
        """Handle messages until a receive waits ``idle_timeout`` seconds for nothing (an
        activated reader's loop).

        :return: how many messages were received
        """
        received = 0
        while True:
            outcomes = self.handle_next(handler, timeout=idle_timeout, top=top)
            if not outcomes:
                return received
            received += len(outcomes)
