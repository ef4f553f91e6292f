"""Waking receivers blocked in WAITFOR(RECEIVE) when a message may have arrived.

In-process, a commit that put messages on a queue sets that queue's condition. Across
processes, PostgreSQL's LISTEN/NOTIFY carries the queue name (senders NOTIFY only while a
receiver is registered as waiting); SQLite has no such channel, so a watcher thread reads
``PRAGMA data_version`` (it changes whenever another connection commits) every
``SQLITE_WATCH_INTERVAL`` and wakes the waiters. Every wait is also bounded by a poll
interval, so a lost notification costs a little latency, never a hang.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict

import sqlalchemy as sa

log = logging.getLogger(__name__)

CHANNEL = "scheduler_lib_broker"
CATALOG = "<catalog>"  # the key woken when queues or event notifications change
TRANSMISSION = "<transmission>"  # the key woken when messages enter the transmission queue
SQLITE_WATCH_INTERVAL = 0.005  # seconds between reads of PRAGMA data_version
SQLITE_POLL_INTERVAL = 0.5  # seconds; fallback re-check by a waiter on SQLite
POSTGRESQL_POLL_INTERVAL = 1.0  # seconds; fallback should a NOTIFY be missed
LISTEN_POLL_TIMEOUT = 0.1  # seconds; how quickly the listener notices stop()
LISTENER_FIRST_RETRY = 0.05  # seconds before a lost LISTEN connection is first reopened
LISTENER_RECONNECT_DELAY = 1.0  # seconds between reopening attempts at most


class Wakeups:
    """Per-queue wakeup generations shared by the threads of one process."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation: dict[str, int] = defaultdict(int)

    def generation(self, queue: str) -> int:
        """Take this before checking the queue; pass it to :meth:`wait`."""
        with self._condition:
            return self._generation[queue]

    def notify(self, queues: set[str] | frozenset[str] | list[str]) -> None:
        """Messages may have arrived on these queues."""
        if not queues:
            return
        with self._condition:
            for queue in queues:
                self._generation[queue] += 1
            self._condition.notify_all()

    def notify_all(self) -> None:
        """Wake every waiter (after a reconnect, when notifications may have been lost)."""
        with self._condition:
            for queue in list(self._generation):
                self._generation[queue] += 1
            self._condition.notify_all()

    def wait(self, queue: str, seen: int, timeout: float) -> bool:
        """Block until the queue's generation moves past ``seen`` or ``timeout`` passes.

        :return: whether a notification arrived
        """
        deadline = time.monotonic() + timeout
        with self._condition:
            while self._generation[queue] == seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._condition.wait(remaining)
            return True

    def wait_for_arrivals(
        self, queue: str, seen: int, count: int, window: float, timeout: float
    ) -> int:
        """Block until the queue's generation has moved ``count`` past ``seen``, or
        ``window`` seconds after its first move, or ``timeout`` with no move at all.

        :return: how far the generation moved
        """
        deadline = time.monotonic() + timeout
        gathering = False
        with self._condition:
            while True:
                moved = self._generation[queue] - seen
                if moved >= count:
                    return moved
                if moved > 0 and not gathering:  # the first arrived: gather a while
                    gathering = True
                    deadline = time.monotonic() + window
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return moved
                self._condition.wait(remaining)


class PostgresListener:
    """A daemon thread that LISTENs on the broker channel and feeds :class:`Wakeups`.

    It starts with the first waiter (:meth:`wait_ready`, or :meth:`start` for threads
    that wait without registering: the transport's loader, queue monitors): a process
    that only sends (a producer, ``exec_async`` callers that do not wait) keeps no LISTEN
    connection, whose backend PostgreSQL would signal at every NOTIFY of the database,
    and no thread woken by each of them."""

    def __init__(self, engine: sa.Engine, wakeups: Wakeups) -> None:
        self._engine = engine
        self._wakeups = wakeups
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="broker-listen", daemon=True)
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start listening (once; later calls do nothing)."""
        if self._thread.ident is None and not self._stopped.is_set():
            with self._start_lock:
                if self._thread.ident is None and not self._stopped.is_set():
                    self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether LISTEN is in place (so a NOTIFY sent from now on is seen); the first
        call starts the listener."""
        self.start()
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stopped.set()
        with self._start_lock:
            if self._thread.ident is not None:
                self._thread.join(timeout=5)

    def _run(self) -> None:
        import psycopg  # the PostgreSQL driver; only imported on that backend

        url = self._engine.url.set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        delay = LISTENER_FIRST_RETRY
        while not self._stopped.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._ready.set()
                    if delay > LISTENER_FIRST_RETRY:
                        log.warning("LISTEN connection back")
                    delay = LISTENER_FIRST_RETRY
                    # Every waiter looks at its queue at once: anything sent while we
                    # were away sent a NOTIFY nobody heard.
                    self._wakeups.notify_all()
                    while not self._stopped.is_set():
                        for notification in conn.notifies(timeout=LISTEN_POLL_TIMEOUT):
                            self._wakeups.notify({notification.payload})
            except Exception as exc:  # a dropped connection must not kill wakeups for good
                self._ready.clear()
                if delay == LISTENER_FIRST_RETRY:  # once per outage, not once per retry
                    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    log.warning("LISTEN connection lost (%s); reconnecting", first_line)
                # Waiters poll meanwhile; back soon after the server is, without hammering.
                self._stopped.wait(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, LISTENER_RECONNECT_DELAY)


class SqliteWatcher:
    """A daemon thread that wakes every waiter when another connection commits to the
    SQLite file: ``PRAGMA data_version`` is a cheap read that takes no lock."""

    def __init__(self, path: str, wakeups: Wakeups) -> None:
        self._path = path
        self._wakeups = wakeups
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="broker-sqlite-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import sqlite3

        conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            while not self._stopped.wait(SQLITE_WATCH_INTERVAL):
                current = conn.execute("PRAGMA data_version").fetchone()[0]
                if current != version:
                    version = current
                    self._wakeups.notify_all()
        except Exception:  # waiters still poll; losing the watcher only costs latency
            log.warning("SQLite watcher stopped", exc_info=True)
        finally:
            conn.close()
