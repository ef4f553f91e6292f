"""What this process's broker did: counts of events, which the database does not keep.

``scheduler-lib serve`` and ``worker`` export them at ``/metrics`` beside the gauges read
from the database (:mod:`scheduler_lib.scheduler.metrics`); each process counts its own,
so Prometheus adds them up across processes (``sum by (queue) (rate(...))``).

A transaction's messages are counted when it commits (:meth:`Transaction.commit
<scheduler_lib.broker.transaction.Transaction.commit>` hands its tally to :func:`add`):
a rolled-back SEND or RECEIVE did not happen, and is counted as a rollback instead.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

PREFIX = "scheduler_lib"
# What a transaction tallies until it commits: (one of these, *labels) -> n
SENT = "sent"  # (SENT, queue)
RECEIVED = "received"  # (RECEIVED, queue)
POISON = "poison"  # (POISON, queue, disposition)
DISABLED = "disabled"  # (DISABLED, queue)
# Messages sent to another broker go to the transmission queue first: counted under this
# name, as the local queue they land on is the far broker's to count.
TRANSMISSION = "transmission_queue"

REGISTRY = CollectorRegistry(auto_describe=True)
_SENT = Counter(
    f"{PREFIX}_messages_sent",
    "messages put on a queue by this process: sent here, or delivered from another broker "
    f"(queue {TRANSMISSION!r}: sent to another broker)",
    ["queue"],
    registry=REGISTRY,
)
_RECEIVED = Counter(
    f"{PREFIX}_messages_received",
    "messages this process received from a queue (RECEIVE, or a worker's take), committed",
    ["queue"],
    registry=REGISTRY,
)
_ROLLBACKS = Counter(
    f"{PREFIX}_receive_rollbacks",
    "transactions of this process that received from the queue and rolled back (poison "
    "message detection counts them; a lost connection is not counted)",
    ["queue"],
    registry=REGISTRY,
)
_DISABLED = Counter(
    f"{PREFIX}_queues_disabled",
    "times this process's poison message detection turned the queue off",
    ["queue"],
    registry=REGISTRY,
)
_POISON = Counter(
    f"{PREFIX}_poison_messages",
    "poison messages this process routed to the policy's dispositions (e.g. 'log', "
    "'park', 'end_conversation')",
    ["queue", "disposition"],
    registry=REGISTRY,
)
_ACTIVATIONS = Counter(
    f"{PREFIX}_activations",
    "activation decisions of this process on a queue with messages: 'started' (a reader "
    "started, counted per reader) or 'at_max_readers' (messages wait, the queue runs "
    "max_queue_readers already)",
    ["queue", "decision"],
    registry=REGISTRY,
)
_RETRANSMITTED = Counter(
    f"{PREFIX}_transport_frames_retransmitted",
    "message fragments this process's transport wrote again (not acknowledged in time, or "
    "the connection was lost)",
    registry=REGISTRY,
)
_BAD_FRAMES = Counter(
    f"{PREFIX}_transport_bad_frames",
    "frames this process's transport dropped: 'corrupted' (failed its signature), "
    "'replayed' (a frame number seen before)",
    ["reason"],
    registry=REGISTRY,
)

_TALLIED = {SENT: _SENT, RECEIVED: _RECEIVED, POISON: _POISON, DISABLED: _DISABLED}


def add(tally: Mapping[tuple[str, ...], int]) -> None:
    """Count what a transaction did, once it committed: ``(SENT, queue) -> n`` etc."""
    for key, n in tally.items():
        _series(key).inc(n)


@functools.lru_cache(maxsize=4096)
def _series(key: tuple[str, ...]) -> Any:
    # Every commit counts: the labelled series are looked up once (``labels()``
    # validates and locks, a few microseconds each time).
    what, *labels = key
    return _TALLIED[what].labels(*labels)


def received(queue: str, n: int) -> None:
    """Messages taken in a statement that commits as it runs (a worker's take)."""
    _RECEIVED.labels(queue).inc(n)


def rolled_back(queues: frozenset[str]) -> None:
    for queue in queues:
        _ROLLBACKS.labels(queue).inc()


def activation(queue: str, decision: str, n: int = 1) -> None:
    _ACTIVATIONS.labels(queue, decision).inc(n)


def retransmitted(frames: int) -> None:
    _RETRANSMITTED.inc(frames)


def bad_frame(reason: str) -> None:
    _BAD_FRAMES.labels(reason).inc()
