"""Named, durable, cross-process semaphores ("at most 2 tasks on the warehouse at once,
across all DAGs").

A permit is a row in ``semaphore_holders`` with an expiry its holder keeps renewing; a
holder that dies (even by SIGKILL) stops renewing, and its permit comes back when it
expires. Acquiring locks the semaphore's row (``FOR UPDATE`` on PostgreSQL, the write
lock on SQLite), so acquirers take turns and never exceed the permits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from scheduler_lib.broker import Broker, NotFound
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.broker.poison import worker_name
from scheduler_lib.scheduler import catalog
from scheduler_lib.scheduler.errors import SchedulerError

log = logging.getLogger(__name__)

DEFAULT_LEASE = 30.0  # seconds a permit is held without a renewal
POLL_MIN, POLL_MAX = 0.02, 0.5  # seconds between tries while all permits are taken
_released = threading.Condition()  # a release in this process wakes its waiters at once


class SemaphoreTimeout(SchedulerError):
    """No permit came free within the timeout."""


@dataclasses.dataclass(frozen=True)
class Permit:
    holder_id: str
    semaphore: str
    holder: str
    lease: float


class Semaphores:
    """The named semaphores of a broker's database."""

    def __init__(self, broker: Broker) -> None:
        catalog.prepare(broker)
        self.broker = broker

    def create(self, name: str, permits: int) -> None:
        """Create the semaphore, or set its permits if it exists (idempotent)."""
        name = checks.name(name, "semaphore name")
        permits = checks.bounded_int(permits, f"semaphore {name!r}: permits", 1)
        with self.broker.transaction() as tx:
            if tx.fetch_one("semaphore_get", name=name) is None:
                tx.run("semaphore_insert", name=name, permits=permits, now=time.time())
            else:
                tx.run("semaphore_set_permits", name=name, permits=permits)

    def status(self) -> list[Mapping[str, Any]]:
        """Every semaphore with its permits and how many hold it now."""
        with self.broker.transaction() as tx:
            return tx.fetch("semaphore_list", now=time.time())

    def holders(self, name: str) -> list[Mapping[str, Any]]:
        """Who holds the semaphore now (expired holders included until someone acquires)."""
        with self.broker.transaction() as tx:
            return tx.fetch("semaphore_holders", name=name)

    def try_acquire(
        self, name: str, *, lease: float = DEFAULT_LEASE, holder: str | None = None
    ) -> Permit | None:
        """A permit if one is free now, else ``None``.

        :raises NotFound: for an unknown semaphore
        """
        duration = checks.timeout(lease, "lease")
        if not duration:
            raise InvalidArgument("a permit needs a lease greater than 0 seconds")
        now = time.time()
        with self.broker.transaction() as tx:
            row = tx.fetch_one("semaphore_get", name=name)  # the lock acquirers queue on
            if row is None:
                raise NotFound(f"semaphore {name!r} does not exist", hint="Semaphores.create")
            tx.run("semaphore_expire", name=name, now=now)
            if int(tx.fetch_value("semaphore_held", name=name)) >= int(row["permits"]):
                return None
            permit = Permit(str(uuid.uuid4()), name, holder or worker_name(), duration)
            tx.run(
                "semaphore_holder_insert",
                holder_id=permit.holder_id,
                name=name,
                holder=permit.holder,
                now=now,
                expires_at=now + duration,
            )
            return permit

    def acquire(
        self,
        name: str,
        timeout: float | None = None,
        *,
        lease: float = DEFAULT_LEASE,
        holder: str | None = None,
    ) -> Permit:
        """Wait for a permit (``timeout=None``: for ever).

        :raises SemaphoreTimeout: when none came free within ``timeout`` seconds
        """
        wait = checks.timeout(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        pause = POLL_MIN
        while True:
            permit = self.try_acquire(name, lease=lease, holder=holder)
            if permit is not None:
                return permit
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise SemaphoreTimeout(f"no permit of semaphore {name!r} came free within {wait} s")
            # Woken at once by a release in this process; other processes are polled.
            with _released:
                _released.wait(pause if remaining is None else min(pause, remaining))
            pause = min(pause * 2, POLL_MAX)

    def renew(self, permit: Permit) -> bool:
        """Keep the permit another ``lease`` seconds; ``False`` if it was lost (expired
        and taken over)."""
        with self.broker.transaction() as tx:
            return bool(
                tx.run(
                    "semaphore_holder_renew",
                    holder_id=permit.holder_id,
                    expires_at=time.time() + permit.lease,
                )
            )

    def release(self, permit: Permit) -> None:
        """Give the permit back (a lost permit is already back: not an error)."""
        with self.broker.transaction() as tx:
            tx.run("semaphore_holder_delete", holder_id=permit.holder_id)
        with _released:
            _released.notify_all()

    @contextlib.contextmanager
    def hold(
        self, name: str, timeout: float | None = None, *, lease: float = DEFAULT_LEASE
    ) -> Iterator[Permit]:
        """Hold a permit for the ``with`` block, renewing it in the background."""
        permit = self.acquire(name, timeout, lease=lease)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(permit.lease / 3):
                try:
                    if not self.renew(permit):
                        log.warning("permit of semaphore %s was lost while held", name)
                        return
                except Exception as exc:  # a passing database error: try again
                    self.broker.availability.report(log, f"renewing a permit of {name} failed", exc)

        renewer = threading.Thread(target=renew, name=f"permit-{name}", daemon=True)
        renewer.start()
        try:
            yield permit
        finally:
            stop.set()
            renewer.join()
            self.release(permit)
