"""Activation: queue monitors that start readers (internal activation) or post
``QUEUE_ACTIVATION`` events (external activation), as seed 000 describes.

A monitor decides with the seed's two rules, never with the unread-message count alone:

(a) the queue has messages and no activated reader is running; or
(b) the queue has messages, nobody is waiting in an unfiltered RECEIVE, no unfiltered
    RECEIVE has come back empty for ``empty_grace`` seconds (the readers are all busy
    and messages pile up), and the last reader started at least ``empty_grace`` ago.

"Nobody is waiting" is read from ``queue_monitors.last_empty_rowset_at``, which every
unfiltered RECEIVE stamps when it comes back empty: a waiting receiver re-checks at least
every poll interval and so keeps the stamp fresh, and a dead one stops. One conversation
group is served by one reader at a time, so a backlog on a single conversation starts at
most one more reader, which then waits — and while it waits, rule (b) does not fire.

(The seed's sentence for (b) reads, in translation, as if RECEIVE *returned* empty for a
few seconds; its own example — a second reader is started for a one-conversation backlog
while the first never sees an empty result — only works the way it is implemented here.)
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import wakeup
from scheduler_lib.broker.ops import endpoints, events

if TYPE_CHECKING:
    from scheduler_lib.broker import broker as brokers

log = logging.getLogger(__name__)

CHECK_INTERVAL = 2.0  # seconds between a monitor's unprompted re-checks
EMPTY_GRACE = 3.0  # seconds without an empty RECEIVE before readers count as busy
HEARTBEAT_INTERVAL = 5.0  # seconds between a runtime's heartbeats for its readers
HEARTBEAT_EXPIRY = 30.0  # seconds without a heartbeat after which a reader is gone
LOOP_GRACE = 60.0  # seconds a loop's turn may take (a call riding through a short outage)
NOTIFICATION_TIMEOUT = 30.0  # seconds an external activator has to RECEIVE before a re-post
READER_MODES = ("thread", "process")
PARENT_WATCH_INTERVAL = 0.2  # seconds; how soon a reader process notices its runtime died


@dataclass(frozen=True)
class Decision:
    """What one check of a queue decided (returned for tests and the ``queues`` view)."""

    queue_name: str
    messages_ready: bool
    readers_running: int
    readers_started: int
    events_posted: int
    eager: bool = False  # the queue starts a reader per ready message


_reader = threading.local()  # the activated task this thread runs as, if any


def current_reader() -> str | None:
    """The ``task_id`` (in ``activated_tasks``) of the activated reader running the
    calling thread, or ``None`` outside activated readers: how a procedure says who ran a
    piece of work (the blog's SPID)."""
    return getattr(_reader, "task_id", None)


def stopping() -> bool:
    """Whether the runtime that activated the calling reader is stopping: a procedure
    that waits in long RECEIVEs checks it between them and returns."""
    stopped = getattr(_reader, "stopped", None)
    return stopped is not None and stopped.is_set()


def _run_in_process(
    url: str, procedure: str, queue: str, task_id: str, setup: Callable[[], None] | None = None
) -> None:
    """A reader in its own process: ``setup`` (the runtime's ``reader_setup``: a spawned
    process starts without its parent's logging), a broker of its own, then the
    procedure. It ends itself when its runtime dies (even by SIGKILL), so no reader
    outlives the heartbeat that vouched for it."""
    from scheduler_lib.broker import broker as brokers

    if setup is not None:
        setup()

    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_INTERVAL)
        os._exit(1)

    threading.Thread(target=watch_parent, name="reader-parent-watch", daemon=True).start()
    _reader.task_id = task_id
    with brokers.Broker(url, migrate=False, timers=False) as broker:
        checks.resolve(procedure)(broker, queue)


class ActivationRuntime:
    """Runs the queue monitors of one process and the readers they start.

    ``scheduler-lib serve`` runs one; so does the Spark worker. Several runtimes on one
    database cooperate: activation decisions lock the queue's monitor row, and each
    runtime keeps its readers' heartbeats fresh and removes readers whose runtime died.

    :param broker: the broker to serve
    :param clock: seconds since the epoch (injectable for tests)
    :param reader_mode: ``thread`` (default) or ``process``
    :param idle_check_interval: seconds between checks of a queue with nothing ready
        (default: ``check_interval``). Arrivals wake the monitor anyway (NOTIFY, SQLite's
        data_version watcher), so a runtime that checks often to ramp readers up quickly
        need not poll idle queues as often
    :param skip_procedures: activation procedures this runtime never starts (they need
        something only other processes have: ``scheduler-lib serve`` leaves Spark target
        queues to Spark workers)
    :param reader_setup: with ``reader_mode="process"``, called first in each reader
        process (picklable: a module-level function, or a ``functools.partial`` of one);
        ``scheduler-lib serve`` sets up the process's log there
    :param queues: serve only these queues (default: every queue with activation)
    :param reader_cap: at most this many readers per queue in this runtime (the queue's
        ``max_readers`` still caps all runtimes together); beyond it, only external
        activation (``QUEUE_ACTIVATION`` events) can add readers
    """

    def __init__(
        self,
        broker: brokers.Broker,
        *,
        clock: Callable[[], float] = time.time,
        check_interval: float = CHECK_INTERVAL,
        empty_grace: float = EMPTY_GRACE,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        heartbeat_expiry: float = HEARTBEAT_EXPIRY,
        notification_timeout: float = NOTIFICATION_TIMEOUT,
        reader_mode: str = "thread",
        queues: Collection[str] | None = None,
        reader_cap: int | None = None,
        idle_check_interval: float | None = None,
        skip_procedures: Collection[str] = (),
        reader_setup: Callable[[], None] | None = None,
    ) -> None:
        if reader_cap is not None and (
            isinstance(reader_cap, bool) or not isinstance(reader_cap, int) or reader_cap < 1
        ):
            raise exceptions.InvalidArgument(
                f"reader_cap must be an integer >= 1, got {reader_cap!r}"
            )
        if isinstance(queues, str):
            raise exceptions.InvalidArgument(f"queues must be a list of names, got {queues!r}")
        if reader_mode not in READER_MODES:
            raise exceptions.InvalidArgument(
                f"reader_mode must be one of {READER_MODES}, got {reader_mode!r}"
            )
        self.broker = broker
        self.clock = clock
        self.check_interval = check_interval
        self.empty_grace = empty_grace
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_expiry = heartbeat_expiry
        self.notification_timeout = notification_timeout
        self.reader_mode = reader_mode
        self.queues = None if queues is None else frozenset(queues)
        self.reader_cap = reader_cap
        self.idle_check_interval = idle_check_interval
        self.skip_procedures = frozenset(skip_procedures)
        self.reader_setup = reader_setup
        self.runtime_id = str(uuid.uuid4())
        self._host = socket.gethostname()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        # loop -> (monotonic time its last turn began, its interval): what health reads
        self._turns: dict[str, tuple[float, float]] = {}
        self._monitors: dict[str, threading.Thread] = {}
        self._readers: dict[str, threading.Thread] = {}
        self._reader_queues: dict[str, str] = {}  # task id -> queue
        self._starting: set[str] = set()  # task ids being inserted, their thread not yet up
        self._lock = threading.Lock()
        self._listening: set[str] = set()
        self._failed_at: dict[str, float] = {}  # queue -> when a reader last failed
        self._saturated: dict[str, bool] = {}  # queue -> messages wait, no reader may start
        self._warned_serial: set[str] = set()  # SQLite queues already warned about

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> ActivationRuntime:
        """Start the supervisor (monitors follow the catalog) and the heartbeat."""
        # Monitors are woken by arrivals other processes announce (NOTIFY, or on SQLite
        # their commits) even while no reader of theirs waits here.
        self.broker.waiting.hear_other_processes()
        for target, name in (
            (self._supervise, "activation-supervisor"),
            (self._beat, "activation-heartbeat"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop monitoring and wait up to ``timeout`` for running readers to finish."""
        self._stopped.set()
        self.broker.waiting.wakeups.notify_all()
        deadline = time.monotonic() + timeout
        for thread in [*self._threads, *self._monitors.values(), *list(self._readers.values())]:
            thread.join(max(0.0, deadline - time.monotonic()))
        for queue in list(self._listening):
            self._listen(queue, False)

    def __enter__(self) -> ActivationRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poke(self, queue: str) -> None:
        """Make the queue's monitor re-check now (what arrivals and receives do)."""
        self.broker.waiting.wakeups.notify({queue})

    def stalled_loops(self, grace: float = LOOP_GRACE) -> list[str]:
        """Its supervisor and heartbeat loops that stopped, or whose last turn began more
        than ``grace`` seconds plus three intervals ago (stuck in a call): what a health
        check reports. Their failures are logged and retried, so a loop that turns is
        one that works, or waits out an outage it says so of."""
        now = time.monotonic()
        stalled = [t.name for t in self._threads if not t.is_alive()]
        for name, (began, interval) in list(self._turns.items()):
            if name not in stalled and now - began > grace + 3 * interval:
                stalled.append(f"{name} (no turn for {now - began:.0f} s)")
        return stalled

    @property
    def readers(self) -> int:
        """Readers this runtime is running now."""
        with self._lock:
            return len(self._readers)

    def readers_of(self, queue: str) -> int:
        """Readers this runtime is running now on ``queue``."""
        with self._lock:
            return sum(1 for q in self._reader_queues.values() if q == queue)

    # --- monitors --------------------------------------------------------------------

    def _supervise(self) -> None:
        wakeups = self.broker.waiting.wakeups
        interval = self.idle_check_interval or self.check_interval
        while not self._stopped.is_set():
            self._turns["activation-supervisor"] = (time.monotonic(), interval)
            seen = wakeups.generation(wakeup.CATALOG)
            try:
                self._sync_monitors()
            except Exception as exc:
                self.broker.availability.report(
                    log, "activation supervisor: catalog refresh failed", exc
                )
            # An ALTER QUEUE or a new subscription in this process wakes us at once; other
            # processes' are seen within the (idle) interval.
            wakeups.wait(wakeup.CATALOG, seen, interval)

    def _sync_monitors(self) -> None:
        with self.broker.transaction() as tx:
            tx.session.execute("monitor_delete_unused")
            queues = {r["queue_name"] for r in tx.session.all("queues_activating")}
            if self.queues is not None:
                queues &= self.queues
            for queue in queues:
                tx.session.execute("monitor_ensure", queue=queue, now=self.clock())
        with self._lock:
            for queue in queues - set(self._monitors):
                thread = threading.Thread(
                    target=self._monitor, args=(queue,), name=f"queue-monitor-{queue}", daemon=True
                )
                self._monitors[queue] = thread
                thread.start()

    def _monitor(self, queue: str) -> None:
        wakeups = self.broker.waiting.wakeups
        try:
            readers_key = _readers_key(queue)
            while not self._stopped.is_set():
                seen = wakeups.generation(queue)
                seen_readers = wakeups.generation(readers_key)
                try:
                    decision = self.check(queue)
                except exceptions.QueueNotFound:
                    return
                except Exception as exc:
                    self.broker.availability.report(
                        log, f"queue monitor {queue}: check failed", exc
                    )
                    decision = None
                if decision is None:
                    return  # the queue no longer activates
                # While no reader runs, arrivals must wake us across processes too. Having
                # just registered, look once more: a message committed between our check
                # and the registration sent no NOTIFY.
                idle = decision.readers_running + decision.readers_started == 0
                # An eager queue's monitor hears every arrival, readers or not: a wave
                # that comes while some readers idle still needs one reader per task.
                if self._listen(queue, idle or decision.eager) and idle:
                    continue
                interval = self._next_check_in(queue)
                if not decision.messages_ready and self.idle_check_interval is not None:
                    interval = max(interval, self.idle_check_interval)
                if self._saturated.get(queue):
                    # Every reader this runtime may start runs: arrivals and receives
                    # (one per task) cannot change that, so only a reader leaving or the
                    # interval (QUEUE_ACTIVATION events stay on time) wakes us.
                    wakeups.wait(readers_key, seen_readers, interval)
                else:
                    wakeups.wait(queue, seen, interval)
        finally:
            self._listen(queue, False)
            with self._lock:
                self._monitors.pop(queue, None)

    def _next_check_in(self, queue: str) -> float:
        """Seconds until the monitor looks unprompted: the check interval, or sooner when
        a failed reader's back-off ends (a message may be waiting for it)."""
        backoff_left = self._failed_at.get(queue, float("-inf")) + self.empty_grace - self.clock()
        if backoff_left > 0:
            return min(self.check_interval, backoff_left + 0.01)
        return self.check_interval

    def _listen(self, queue: str, on: bool) -> bool:
        """Register (or unregister) for NOTIFY on the queue; whether that changed."""
        if on == (queue in self._listening) or not self.broker.waiting.announced:
            return False
        try:
            self.broker.waiting.set_waiting(queue, +1 if on else -1)
        except Exception as exc:
            self.broker.availability.report(
                log, f"queue monitor {queue}: (un)registering for NOTIFY failed", exc
            )
            return False
        (self._listening.add if on else self._listening.discard)(queue)
        return True

    def check(self, queue: str) -> Decision | None:
        """Apply the activation rules to a queue once; start readers / post events.

        :return: what was decided, or ``None`` when the queue no longer activates
        """
        now = self.clock()
        started: list[tuple[str, str]] = []
        posted = 0
        with self.broker.transaction() as tx:
            monitor = tx.session.one("monitor_lock", queue=queue)
            if monitor is None:
                return None
            info = endpoints.queue(tx.session, queue)
            head = tx.session.scalar("queue_head", queue=queue)
            running = int(tx.session.scalar("task_count", queue=queue))
            full = False
            if head is None or not info.is_receive_enabled:
                self._saturated[queue] = False
                tx.session.execute("monitor_idle", queue=queue, now=now)
                return Decision(queue, head is not None, running, 0, 0, info.is_activation_eager)
            stamps = (
                monitor["last_empty_rowset_at"],
                self.broker.waiting.last_waiting_receiver(queue),
            )
            last_empty = max((t for t in stamps if t is not None), default=None)
            nobody_waiting = last_empty is None or now - last_empty >= self.empty_grace
            if (
                info.is_activation_enabled
                and info.activation_procedure
                and info.activation_procedure not in self.skip_procedures
            ):
                self._warn_serial(info)
                wanted = self._readers_wanted(tx, info, monitor, running, nobody_waiting, now)
                # A procedure that just failed is not restarted in a hot loop.
                if now - self._failed_at.get(queue, float("-inf")) < self.empty_grace:
                    wanted = 0
                if self.reader_cap is not None:
                    wanted = min(wanted, self.reader_cap - self.readers_of(queue))
                for _ in range(max(0, min(wanted, info.max_readers - running))):
                    task_id = str(uuid.uuid4())
                    with self._lock:
                        self._starting.add(task_id)
                    tx.session.execute(
                        "task_insert",
                        task_id=task_id,
                        queue=queue,
                        procedure=info.activation_procedure,
                        runtime_id=self.runtime_id,
                        host=self._host,
                        pid=os.getpid(),
                        reader=f"{self.reader_mode}-{task_id[:8]}",
                        execute_as=info.execute_as,
                        now=now,
                    )
                    tx.session.execute("monitor_activated", queue=queue, now=now)
                    started.append((task_id, info.activation_procedure))
                # This runtime's own cap reached: nothing but a reader leaving lets it start
                # another. (The queue's max_readers is not used the same way: an ALTER or
                # another runtime's readers leaving change it, and a check notices those.)
                full = (
                    self.reader_cap is not None
                    and self.readers_of(queue) + len(started) >= self.reader_cap
                )
            posted = self._post_activation_events(tx, queue, monitor, head, nobody_waiting, now)
        if started:
            counters.activation(queue, "started", len(started))
        elif running >= info.max_readers:
            counters.activation(queue, "at_max_readers")
        for task_id, procedure in started:
            self._start_reader(task_id, queue, procedure)
        with self._lock:
            self._starting.difference_update(t for t, _ in started)
        self._saturated[queue] = full
        return Decision(queue, True, running, len(started), posted, info.is_activation_eager)

    def _warn_serial(self, info: models.QueueInfo) -> None:
        """Say once per queue that SQLite runs its readers one at a time: a reader that
        RECEIVEs inside its transaction holds the whole database's write lock until it
        commits, so a second reader (and every sender) waits for it. Eager queues' readers
        (the scheduler's executors) take messages under leases in short transactions, and
        one reader cannot be serialized with itself."""
        if (
            self.broker.dialect != "sqlite"
            or info.is_activation_eager
            or info.max_readers <= 1
            or info.name in self._warned_serial
        ):
            return
        self._warned_serial.add(info.name)
        log.warning(
            "queue %s: max_queue_readers=%d on SQLite, but SQLite's lock is the whole "
            "database: a reader working inside its transaction blocks the other readers and "
            "every sender until it commits (docs/broker.md, Transactions). Use PostgreSQL "
            "for readers in parallel.",
            info.name,
            info.max_readers,
        )

    def _readers_wanted(
        self,
        tx: Any,
        info: models.QueueInfo,
        monitor: Mapping[str, Any],
        running: int,
        nobody_waiting: bool,
        now: float,
    ) -> int:
        """How many readers to start now.

        Seed 000's gradual rule: one when none runs, one more when messages wait and no
        RECEIVE came back empty for ``empty_grace`` (readers are busy) — a reader holds
        a conversation group while it works, so a backlog on one conversation must not
        get readers it cannot use. Eager queues (``eager_activation``: readers that take
        under leases and hold the group only while they take) get a reader per ready
        message at once: a wave of N tasks starts N readers.
        """
        if info.is_activation_eager:
            ready = int(
                tx.session.scalar("queue_ready_count", queue=info.name, cap=info.max_readers)
            )
            busy = int(tx.session.scalar("queue_lease_count", queue=info.name))
            return min(info.max_readers, busy + ready) - running
        last_started = monitor["last_activated_at"]
        settled = last_started is None or now - last_started >= self.empty_grace
        return 1 if running == 0 or (nobody_waiting and settled) else 0

    def _post_activation_events(
        self,
        tx: Any,
        queue: str,
        monitor: Mapping[str, Any],
        head: int,
        nobody_waiting: bool,
        now: float,
    ) -> int:
        subscribers = tx.session.all(
            "event_notifications_for", queue=queue, event_type=events.QUEUE_ACTIVATION
        )
        if not subscribers or not nobody_waiting:
            return 0
        if monitor["state"] == "NOTIFIED":
            received_since = monitor["notified_head_message_id"] != head or (
                monitor["last_empty_rowset_at"] or 0
            ) > (monitor["last_notified_at"] or 0)
            timed_out = now - (monitor["last_notified_at"] or 0) >= self.notification_timeout
            if not (received_since or timed_out):
                return 0
        posted = events.post(tx.session, queue, events.QUEUE_ACTIVATION, now=now)
        tx.session.execute("monitor_notified", queue=queue, head=head, now=now)
        return posted

    # --- readers ---------------------------------------------------------------------

    def _start_reader(self, task_id: str, queue: str, procedure: str) -> None:
        thread = threading.Thread(
            target=self._run_reader,
            args=(task_id, queue, procedure),
            name=f"reader-{queue}-{task_id[:8]}",
            daemon=True,
        )
        with self._lock:
            self._readers[task_id] = thread
            self._reader_queues[task_id] = queue
        thread.start()

    def _run_reader(self, task_id: str, queue: str, procedure: str) -> None:
        try:
            if self.reader_mode == "process":
                url = self.broker.url.render_as_string(hide_password=False)
                process = multiprocessing.get_context("spawn").Process(
                    target=_run_in_process,
                    args=(url, procedure, queue, task_id, self.reader_setup),
                    daemon=True,
                )
                process.start()
                process.join()
                if process.exitcode:
                    self._failed_at[queue] = self.clock()
                    log.warning("reader process for %s exited with %s", queue, process.exitcode)
            else:
                _reader.task_id, _reader.stopped = task_id, self._stopped
                checks.resolve(procedure)(self.broker, queue)
        except exceptions.QueueNotFound as exc:
            # Its queue was dropped under it (DROP QUEUE, or a database emptied and made
            # again by scheduler-lib init): the reader has nothing to read; no bug to trace.
            self._failed_at[queue] = self.clock()
            log.warning("reader on queue %s ends: %s", queue, exc)
        except Exception:
            self._failed_at[queue] = self.clock()
            log.exception(
                "activation procedure %s on queue %s failed; no new reader for %s s",
                procedure,
                queue,
                self.empty_grace,
            )
        finally:
            with self._lock:
                self._readers.pop(task_id, None)
                self._reader_queues.pop(task_id, None)
            # If the database is away now, the heartbeat removes the row once it is back:
            # it vouches only for readers that still run.
            with contextlib.suppress(Exception), self.broker.transaction() as tx:
                tx.session.execute("task_delete", task_id=task_id)
            # "all readers exited" is a reason to re-check at once
            self.broker.waiting.wakeups.notify({queue, _readers_key(queue)})

    # --- heartbeats ------------------------------------------------------------------

    def _beat(self) -> None:
        self._turns["activation-heartbeat"] = (time.monotonic(), self.heartbeat_interval)
        while not self._stopped.wait(self.heartbeat_interval):
            self._turns["activation-heartbeat"] = (time.monotonic(), self.heartbeat_interval)
            try:
                self.heartbeat()
            except Exception as exc:
                self.broker.availability.report(log, "activation heartbeat failed", exc)

    def heartbeat(self) -> int:
        """Vouch for this runtime's readers and the queues it monitors, and remove readers
        nobody vouched for within ``heartbeat_expiry`` (their runtime died).

        :return: how many dead readers were removed
        """
        now = self.clock()
        with self.broker.transaction() as tx:
            rows = tx.session.all("tasks_of_runtime", runtime_id=self.runtime_id)
            with self._lock:
                live = set(self._readers) | self._starting
            # A reader that ended while the database was away could not remove its row.
            gone = [r["task_id"] for r in rows if r["task_id"] not in live]
            for task_id in gone:
                tx.session.execute("task_delete", task_id=task_id)
            tx.session.execute("tasks_heartbeat", runtime_id=self.runtime_id, now=now)
            with self._lock:
                monitored = [q for q, thread in self._monitors.items() if thread.is_alive()]
            for queue in monitored:
                # Idle, a monitor writes nothing else: without this, a `serve` idle for
                # a while looked gone to `scheduler-lib run`, which refused the plan.
                tx.session.execute("monitor_served", queue=queue, now=now)
            # Only once the runtimes had a whole expiry to vouch for their readers since
            # the database was last back: a live reader is never lost to an outage.
            expired = tx.session.count(
                "tasks_expire",
                cutoff=now - self.heartbeat_expiry,
                recovered_at=self.broker.availability.recovered_at,
            )
            return len(gone) + expired


def _readers_key(queue: str) -> str:
    """The wakeup key a runtime bumps when one of the queue's readers leaves."""
    return f"{queue}\x00readers"


@contextlib.contextmanager
def running(broker: brokers.Broker, **options: Any) -> Iterator[ActivationRuntime]:
    """An activation runtime for the duration of a ``with`` block."""
    runtime = ActivationRuntime(broker, **options).start()
    try:
        yield runtime
    finally:
        runtime.stop()
