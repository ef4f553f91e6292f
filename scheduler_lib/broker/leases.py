"""Leases: messages taken for long work (seed 004's recovery for workers that die).

A take RECEIVEs messages and moves them under a lease in one short transaction (one
statement on PostgreSQL), so the conversation group is free at once and the work runs with
no transaction open. The worker's heartbeat (:class:`LeaseKeeper`, through
:meth:`Broker.keep_alive`) renews the lease; the answer ends it (:meth:`LeaseOperations.complete`,
or ``send(..., completing=lease)``) in the transaction that answers. A lease nobody renews
expires (:func:`expire_leases`, run by the broker's timer thread): a silent failure,
counted and retried or routed by the queue's poison policy (:mod:`~scheduler_lib.broker.poison`).

The fronts' operations here are one line each into :mod:`scheduler_lib.broker.ops.leases`
(the checked take, renew, complete, abandon, release, expiry). The one-statement take and
its wait (``Broker.take`` with ``durable=False``, ``Broker.take_recorded``) are there too;
the broker's front gives each of its looks a transaction of its own, on a connection that
commits without the WAL flush. The heartbeat thread, :class:`LeaseKeeper`, is here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from scheduler_lib.broker import exceptions
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import connections, session
from scheduler_lib.broker.ops import leases, poison
from scheduler_lib.broker.ops.leases import DEFAULT_LEASE, Lease, expire_leases, lease_from_row

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LEASE",
    "Lease",
    "LeaseKeeper",
    "LeaseOperations",
    "expire_leases",
    "lease_from_row",
]


class LeaseOperations:
    """Taking messages under leases, and ending them; on the broker (each in a
    transaction of its own) and inside a transaction."""

    def _operation(self) -> contextlib.AbstractContextManager[session.InTransaction]:
        raise NotImplementedError  # Broker and Transaction provide it

    def _take_alone(
        self, queue: str, top: int, duration: float, holder: str, timeout: float | None
    ) -> list[Lease] | None:
        """A take that is a transaction of its own, committed without the WAL flush, in
        one statement where the dialect has one (waiting until ``timeout``); ``None`` for
        "take inside a transaction" — always, inside a transaction."""
        return None

    def take(
        self,
        queue: str,
        top: int = 1,
        timeout: float | None = None,
        *,
        lease: float = DEFAULT_LEASE,
        worker: str | None = None,
        durable: bool = True,
    ) -> list[Lease]:
        """RECEIVE for long work: the messages leave the queue and wait under a lease of
        ``lease`` seconds, renewed by :meth:`Broker.keep_alive`. Once the transaction
        commits the receive is over and its conversation group free; the work runs with
        no transaction open and is answered (and :meth:`complete`-d) in another.

        A lease nobody renews expires: the message's failure is recorded and the queue's
        poison policy puts it back on its queue or routes it (by default logging it and
        ending its conversation with an error, so the partner is told).

        :param lease: seconds the lease lasts without a renewal
        :param worker: who holds it (default: host:pid:thread)
        :param durable: ``False`` lets the taking transaction commit without waiting for
            the WAL flush (PostgreSQL), so the conversation group is free again sooner.
            A crash right after may then undo the take: the message is back on its
            queue, as after an expired lease. Safe when the worker commits something
            durably (e.g. "started") before the work begins, which flushes the take too.
            Only for a take that runs in a transaction of its own.
        :return: the leases, ``[]`` when the timeout passed
        """
        duration = checks.timeout(lease, "lease")
        if not duration:
            raise exceptions.InvalidArgument("a lease needs a duration greater than 0 seconds")
        wait = checks.timeout(timeout)
        holder = worker or poison.worker_name()
        top = checks.positive_int(top, "top")
        if not durable:
            taken = self._take_alone(queue, top, duration, holder, wait)
            if taken is not None:
                return taken
        with self._operation() as tx:
            return leases.take(tx.session, queue, top, wait, duration, holder, durable)

    def renew(self, lease: Lease) -> float:
        """The worker is alive: the lease lasts another ``lease.duration`` seconds.

        :return: the new expiry
        :raises LeaseLost: when the lease already expired or ended
        """
        with self._operation() as tx:
            return leases.renew(tx.session, lease)

    def complete(self, lease: Lease) -> None:
        """End the lease: the work is done. Call it in the transaction that answers, so the
        answer and the completion commit together.

        :raises LeaseLost: when the lease expired meanwhile (the message went back to its
            queue or to its disposition) — the answer must not be sent; roll back
        """
        with self._operation() as tx:
            leases.complete(tx.session, lease)

    def abandon(self, lease: Lease, error: BaseException | str | None = None) -> str:
        """Give the message back: its failure is recorded and the queue's poison policy
        retries it (back on its queue) or routes it.

        :return: ``"requeued"`` or ``"routed"``
        :raises LeaseLost: when the lease already expired or ended
        """
        with self._operation() as tx:
            return leases.abandon(tx.session, lease, error)

    def holds(self, lease: Lease) -> bool:
        """Whether the lease still exists (not expired, completed, abandoned — nor undone
        by a server crash, for a take that committed without the WAL flush)."""
        with self._operation() as tx:
            return leases.holds(tx.session, lease)

    def release(self, lease: Lease) -> None:
        """Give the message back untouched: the work never began (its start could not
        be recorded). Not a failure — nothing is counted; it is next on its queue.

        :raises LeaseLost: when the lease already expired or ended
        """
        with self._operation() as tx:
            leases.release(tx.session, lease)

    def leases(self, queue: str | None = None) -> list[Mapping[str, Any]]:
        """Leases held now, oldest first (message bodies left out)."""
        with self._operation() as tx:
            return leases.listed(tx.session, queue)


RENEW_RETRY = 1.0  # seconds before a renewal that failed is tried again


class Renewing(Protocol):
    """What the heartbeat thread needs of its broker (a ``Broker``): declared here, so
    that this module, which the broker imports, names no front of its own."""

    availability: connections.Availability

    def renew(self, lease: Lease) -> float: ...


class LeaseKeeper:
    """One thread per broker that renews the leases its workers hold (their heartbeat):
    each at a third of its duration, or at the interval a holder asked for. Workers
    register leases for the duration of a ``with`` block; a lease found lost is reported
    to its holder and no longer renewed."""

    def __init__(self, broker: Renewing) -> None:
        self.broker = broker
        self._held: dict[str, tuple[Lease, float, dict[str, exceptions.LeaseLost]]] = {}
        self._due: dict[str, float] = {}  # lease id -> monotonic time of its next renewal
        self._changed = threading.Condition()
        self._stopped = False
        self._sleeps_until = 0.0  # monotonic time the thread wakes up on its own
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def holding(
        self, leases: Sequence[Lease], interval: float | None = None
    ) -> Iterator[dict[str, exceptions.LeaseLost]]:
        lost: dict[str, exceptions.LeaseLost] = {}
        now = time.monotonic()
        with self._changed:
            soonest = float("inf")
            for lease in leases:
                every = interval if interval is not None else lease.duration / 3
                self._held[lease.lease_id] = (lease, every, lost)
                self._due[lease.lease_id] = now + every
                soonest = min(soonest, now + every)
            # Wake the thread only when it would sleep past this renewal: on a busy
            # worker every task takes a lease, and a wake-up per task is a thread switch.
            if soonest < self._sleeps_until:
                self._changed.notify()
        try:
            yield lost
        finally:
            with self._changed:
                for lease in leases:
                    self._held.pop(lease.lease_id, None)
                    self._due.pop(lease.lease_id, None)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                now = time.monotonic()
                due = [self._held[i] for i, t in self._due.items() if t <= now]
                for lease, every, _ in due:
                    self._due[lease.lease_id] = now + every
                if not due:
                    soonest = min(self._due.values(), default=now + 1.0)
                    self._sleeps_until = soonest
                    self._changed.wait(max(0.0, soonest - now))
                    self._sleeps_until = 0.0
                    continue
            for lease, _, lost in due:
                try:
                    self.broker.renew(lease)
                except exceptions.LeaseLost as exc:
                    lost[lease.lease_id] = exc
                    with self._changed:
                        self._due.pop(lease.lease_id, None)
                except Exception as exc:  # a passing database error: try again soon
                    # (renew itself rides through an outage up to the reconnect deadline)
                    self.broker.availability.report(
                        log, f"renewing lease {lease.lease_id} failed", exc
                    )
                    with self._changed:
                        if lease.lease_id in self._due:
                            self._due[lease.lease_id] = time.monotonic() + RENEW_RETRY
