"""What one process knows of its own waiting readers (WAITFOR): the state that outlives
any transaction, kept in one place instead of on the broker's private fields.

A :class:`Waiting` belongs to one broker. It holds the process's wakeups (and what feeds
them: PostgreSQL's LISTEN thread, SQLite's watcher), the process's registration as a
waiting receiver per queue (senders NOTIFY only while one is registered), the turns in
which this process's takers of one queue look and wait, and the notes queue monitors read
("a reader of this process waited here"). The wait loop itself is
:func:`scheduler_lib.broker.ops.receiving.wait_for`, which RECEIVE and the take share.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from scheduler_lib.broker import models
from scheduler_lib.broker.db import connections, store, wakeup

log = logging.getLogger(__name__)

EMPTY_RECEIVE_STAMP_INTERVAL = 0.25  # seconds; how often a process stamps empty receives
LISTEN_READY_TIMEOUT = 10.0  # seconds to wait for LISTEN before the first receive relies on it
WAITER_LINGER = 5.0  # seconds a process stays registered as waiting after its last waiter


class Waiting:
    """One process's waiting readers of one broker database.

    :param engine: the broker's engine (registrations and stamps commit on it)
    :param clock: the broker's clock (activation bookkeeping)
    :param write_gate: SQLite's write gate of the process (``None`` elsewhere): a reader
        queued for it is waiting too
    """

    def __init__(
        self,
        engine: sa.Engine,
        store_: store.Store,
        availability: connections.Availability,
        clock: Callable[[], float],
        write_gate: threading.RLock | None,
    ) -> None:
        self._engine = engine
        self._store = store_
        self._availability = availability
        self._clock = clock
        self._write_gate = write_gate
        self.wakeups = wakeup.Wakeups()
        self.listener: wakeup.PostgresListener | None = None
        if store_.features.notifies:
            self.listener = wakeup.PostgresListener(engine, self.wakeups)
        self._watcher: wakeup.SqliteWatcher | None = None
        self._watcher_lock = threading.Lock()
        # queue -> the lock a taking thread holds while it looks and waits (turns)
        self._turns: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._waiters: dict[str, int] = {}  # queue -> this process's waiting receivers
        self._registered: set[str] = set()  # queues where this process counts as waiting
        self._idle_since: dict[str, float] = {}
        self._waiters_lock = threading.Lock()
        self._empty_stamped: dict[str, float] = {}
        self._waiting_noted: dict[str, float] = {}
        self._empty_stamp_lock = threading.Lock()
        # queue -> the group a RECEIVE of this process last got (SQLite's notes)
        self.last_group_received: dict[str, str] = {}
        # queue -> (monotonic time read, settings): what RECEIVE checks before it waits;
        # cleared when this process changes the catalog
        self.waited_queues: dict[str, tuple[float, models.QueueInfo]] = {}

    @property
    def announced(self) -> bool:
        """Whether arrivals are announced to this process (PostgreSQL's NOTIFY) rather
        than found by polling (SQLite's watcher)."""
        return self.listener is not None

    @property
    def poll_interval(self) -> float:
        """Seconds a waiter sleeps at most before it looks again without a wakeup."""
        if self.listener is not None:
            return wakeup.POSTGRESQL_POLL_INTERVAL
        return wakeup.SQLITE_POLL_INTERVAL

    def turn(self, queue: str) -> threading.Lock:
        """The lock whose holder, among this process's takers of ``queue``, looks and
        waits for wakeups (the others wait for the turn)."""
        return self._turns[queue]

    def is_registered(self, queue: str) -> bool:
        """Whether this process counts as waiting on ``queue`` (senders NOTIFY it)."""
        with self._waiters_lock:
            return queue in self._registered

    # --- the process's registration as a waiting receiver ------------------------------

    def set_waiting(
        self, queue: str, delta: int, ready_timeout: float = LISTEN_READY_TIMEOUT
    ) -> bool:
        """Register a PostgreSQL receiver as waiting (senders then NOTIFY).

        The process registers once per queue, on its first waiter, and keeps the
        registration ``WAITER_LINGER`` seconds after its last waiter left: a reader that
        waits again and again (an executor, ``synchronization``) then costs no
        bookkeeping transactions. A registration nobody uses costs extra NOTIFYs only.

        :return: whether the process registered just now: a message sent before then
            sent no NOTIFY, so a look made before it must be made again
        """
        assert self.listener is not None
        if delta > 0:
            self.listener.wait_ready(ready_timeout)
        with self._waiters_lock:
            count = self._waiters.get(queue, 0) + (1 if delta > 0 else -1)
            self._waiters[queue] = max(count, 0)
            if delta > 0:
                self._idle_since.pop(queue, None)
                if queue in self._registered:
                    return False
                self._registered.add(queue)
            else:
                if count <= 0:  # the timer thread unregisters it once the linger is over
                    self._idle_since[queue] = time.monotonic()
                return False
        try:
            self._register(queue, +1)
        except BaseException:
            with self._waiters_lock:  # not registered: the next waiter tries again
                self._registered.discard(queue)
                self._waiters[queue] = max(self._waiters.get(queue, 1) - 1, 0)
            raise
        return True

    def _register(self, queue: str, delta: int) -> None:
        name = "queue_add_waiter" if delta > 0 else "queue_remove_waiter"
        with connections.connect(self._engine) as conn:
            self._store.execute(conn, "commit_without_fsync")
            self._store.execute(conn, name, name=queue)
            conn.commit()

    def unregister_idle(self) -> float | None:
        """Drop registrations whose linger is over; seconds until the next one ends."""
        now = time.monotonic()
        due, soonest = [], None
        with self._waiters_lock:
            for queue, since in list(self._idle_since.items()):
                if now - since >= WAITER_LINGER:
                    del self._idle_since[queue]
                    self._registered.discard(queue)
                    due.append(queue)
                else:
                    left = WAITER_LINGER - (now - since)
                    soonest = left if soonest is None else min(soonest, left)
        for queue in due:
            try:
                self._register(queue, -1)
            except Exception as exc:
                self._availability.report(log, f"could not unregister the waiters of {queue}", exc)
        return soonest

    # --- what feeds the wakeups --------------------------------------------------------

    def hear_other_processes(self) -> None:
        """For a thread that waits for wakeups without registering as a receiver (the
        transport's loader: its NOTIFYs are sent whoever waits; a queue monitor: arrivals
        announced for another process's readers): start LISTENing on PostgreSQL, or the
        watcher of other connections' commits on SQLite."""
        if self.listener is not None:
            self.listener.start()
        else:
            self.watch_sqlite()

    def watch_sqlite(self) -> None:
        """Start the SQLite watcher when the first receiver waits (PostgreSQL LISTENs)."""
        if self.listener is not None or self._watcher is not None:
            return
        with self._watcher_lock:
            if self._watcher is None and self._engine.url.database:
                self._watcher = wakeup.SqliteWatcher(self._engine.url.database, self.wakeups)

    # --- what queue monitors read --------------------------------------------------------

    def note_blocked_receiver(self, queue: str) -> tuple[float | None, float] | None:
        """SQLite: a receiver that must queue for the write gate is waiting in RECEIVE
        too (another transaction holds the database). Noted in memory for this process's
        queue monitors; a database stamp would need the very lock it waits for.

        :return: (the stamp before, the stamp written), for :meth:`unnote_blocked_receiver`
            — or ``None`` when the gate was free (nothing noted)
        """
        gate = self._write_gate
        if gate is None:
            return None
        if gate.acquire(blocking=False):
            gate.release()
            return None
        before, now = self._waiting_noted.get(queue), self._clock()
        self._waiting_noted[queue] = now
        return before, now

    def unnote_blocked_receiver(self, queue: str, noted: tuple[float | None, float]) -> None:
        """The receiver got messages once through the gate: it was busy, not idle. Its note
        would read as "a reader waits for work" and hold back activation while messages
        pile up (on SQLite the gate is busy most of the time under load), so take it back
        unless someone noted since."""
        before, stamp = noted
        if self._waiting_noted.get(queue) == stamp:
            if before is None:
                self._waiting_noted.pop(queue, None)
            else:
                self._waiting_noted[queue] = before

    def last_waiting_receiver(self, queue: str) -> float | None:
        """When a receiver of this process last waited on the queue without the database
        knowing (see :meth:`note_blocked_receiver`)."""
        return self._waiting_noted.get(queue)

    def record_empty_receive(self, queue: str) -> None:
        """Stamp the queue monitor's last empty RECEIVE, at most every
        ``EMPTY_RECEIVE_STAMP_INTERVAL`` per queue and process."""
        now = time.time()
        with self._empty_stamp_lock:
            if now - self._empty_stamped.get(queue, 0.0) < EMPTY_RECEIVE_STAMP_INTERVAL:
                return
            self._empty_stamped[queue] = now
        self._waiting_noted[queue] = self._clock()
        try:
            with self._engine.begin() as conn:
                self._store.execute(conn, "monitor_record_empty", queue=queue, now=self._clock())
        except Exception as exc:  # bookkeeping for monitors must never fail a receive
            self._availability.report(log, f"could not record an empty receive on {queue}", exc)

    def close(self) -> None:
        """Leave no registration behind (senders would NOTIFY for nobody); stop the
        threads that feed the wakeups."""
        with self._waiters_lock:
            registered, self._registered = self._registered, set()
        for queue in registered:
            try:
                self._register(queue, -1)
            except Exception as exc:
                self._availability.report(log, f"could not unregister the waiters of {queue}", exc)
        if self.listener is not None:
            self.listener.stop()
        if self._watcher is not None:
            self._watcher.stop()
