"""Tasks an executor took ahead (prefetch): one take of several tasks, each started only
when a reader of this process runs it.

A take is the costliest statement of a task's path on PostgreSQL, and it serves one
reader at a time per conversation group (a wave is one): taking one task per take
serializes a wave's readers on it. While a queue's tasks run short, an executor takes up
to ``prefetch`` tasks at once: it runs the first (whose start the take recorded) and
leaves the others here, under their leases (renewed by the broker's lease keeper), for
the next reader of this process that looks for work — its own next look, or a sibling's.
A task held here is ``QUEUED`` in its row: its start is recorded, durably, when it runs,
as every start is (``Executor._start``) — on PostgreSQL in the answer of the task the
reader ran before it, which takes it from here first (``Executor._next_start``) — so the
execution status shows a task running at most one round trip before it does, and a task
cancelled meanwhile is answered, not run.

What it costs, and its bounds:

- A held task is out of its queue: another process's idle reader cannot take it. Tasks
  are held only while this queue's tasks run short (their typical run below
  ``SHORT``; a long run turns prefetch off at once), and a task held for ``HOLD``
  seconds without a free reader (this process's readers all busy with long tasks) goes
  back to its queue, where any reader can take it.
- Priority: a take holds tasks of the first task's level only (lower ones go back at
  once); a task of a higher level that arrives after the take waits for the few held
  ones of this process, at most ``prefetch - 1`` per take.
- Fair share (and FIFO) across schedulers: a take asks for several only after
  ``ONE_SCHEDULER`` takes in a row served one conversation group (one scheduler); while
  the takes serve several in turn, each take gets one task, as without prefetch. A
  scheduler that joins while another is prefetched waits one take of several at most.
- A reader that stops (its runtime stopping) gives every held task back; a process that
  dies leaves them to their leases' expiry, as the task it was running.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from scheduler_lib.broker import Broker, DatabaseError, LeaseLost
from scheduler_lib.broker.leases import Lease

log = logging.getLogger(__name__)

PREFETCH = 4  # tasks a reader takes per look while its queue's tasks run short
SHORT = 0.05  # seconds: below this typical run a queue's tasks run short
HOLD = 1.0  # seconds a held task waits for a free reader before it goes back
ONE_SCHEDULER = 4  # takes in a row from one conversation group before prefetch
SWEEPER_IDLE = 20  # ticks (HOLD / 4) with nothing held before the sweeper thread ends


class Prefetched:
    """The leases this process's executors of one queue took ahead and have not started
    yet (one per broker and queue: :meth:`of`), oldest first."""

    _lock = threading.Lock()

    def __init__(self, broker: Broker, queue: str) -> None:
        self.broker = broker
        self.queue = queue
        self._held: collections.deque[tuple[Lease, float, contextlib.ExitStack]] = (
            collections.deque()
        )
        self._guard = threading.Lock()
        self._typical: float | None = None  # seconds a task of this queue typically runs
        # the conversation groups the last takes here came from (any reader's)
        self._groups: collections.deque[object] = collections.deque(maxlen=ONE_SCHEDULER)
        self._sweeper: threading.Thread | None = None

    @classmethod
    def of(cls, broker: Broker, queue: str) -> Prefetched:
        with cls._lock:
            registry = getattr(broker, "_prefetched", None)
            if registry is None:
                registry = broker._prefetched = {}  # type: ignore[attr-defined]
            found: Prefetched | None = registry.get(queue)
            if found is None:
                found = registry[queue] = cls(broker, queue)
            return found

    # --- how many to take ------------------------------------------------------------

    def ran(self, seconds: float) -> None:
        """A task of this queue ran for ``seconds``: a longer run than the typical one
        counts at once (one long task turns prefetch off), shorter ones slowly."""
        typical = self._typical
        if typical is None or seconds > typical:
            self._typical = seconds
        else:
            self._typical = 0.8 * typical + 0.2 * seconds

    def took(self, group: object) -> None:
        """A take here got a message of conversation ``group``."""
        self._groups.append(group)

    def top(self, prefetch: int) -> int:
        """How many tasks a take asks for: ``prefetch`` while this queue's tasks run
        short and its last takes all served one scheduler, else (and before any ran
        here) one. Takes that serve several schedulers in turn are fair share at work
        (or FIFO across them): a take of several would serve one of them several turns
        at once."""
        typical = self._typical
        if typical is None or typical >= SHORT:
            return 1
        groups = self._groups
        if len(groups) < ONE_SCHEDULER or any(g != groups[0] for g in list(groups)):
            return 1
        return prefetch

    # --- holding ---------------------------------------------------------------------

    def hold(self, leases: Sequence[Lease]) -> None:
        """Keep ``leases`` (taken, not started) for this process's next free reader."""
        if not leases:
            return
        now = time.monotonic()
        entries = []
        for lease in leases:
            keeping = contextlib.ExitStack()
            keeping.enter_context(self.broker.keep_alive([lease]))
            entries.append((lease, now, keeping))
        with self._guard:
            self._held.extend(entries)
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(
                    target=self._sweep, name=f"prefetch-sweeper-{self.queue}", daemon=True
                )
                self._sweeper.start()

    def pop(self) -> Lease | None:
        """The oldest held lease, no longer held (``None``: none is)."""
        popped = self.pop_renewed()
        if popped is None:
            return None
        lease, keeping = popped
        keeping.close()  # the reader renews it while the task runs
        return lease

    def pop_renewed(self) -> tuple[Lease, contextlib.ExitStack] | None:
        """The oldest held lease, no longer held, still renewed until the caller closes
        the stack returned with it (``None``: none is held)."""
        if not self._held:  # the common case, without the lock
            return None
        with self._guard:
            if not self._held:
                return None
            lease, _, keeping = self._held.popleft()
        return lease, keeping

    def give_back(self, older_than: float | None = None) -> int:
        """Put held leases back on their queue — every one, or those held longer than
        ``older_than`` seconds; one that cannot be given back now (the database away)
        stays held, renewed, for the next try. How many went back."""
        now = time.monotonic()
        with self._guard:
            going = [e for e in self._held if older_than is None or now - e[1] >= older_than]
            for entry in going:
                self._held.remove(entry)
        back = 0
        kept = []
        for entry in going:
            lease, _, keeping = entry
            try:
                self.broker.release(lease)
                back += 1
            except LeaseLost:
                pass  # it expired meanwhile: its queue's poison policy has it
            except DatabaseError as exc:
                log.warning("a prefetched task of %s stays held: %s", self.queue, exc)
                kept.append(entry)
                continue
            except Exception as exc:
                # It cannot go back (its queue or conversation changed under it): no
                # longer renewed, it expires, and the poison policy retries or fails it.
                log.warning(
                    "a prefetched task of %s could not go back to its queue; its lease "
                    "will expire: %s",
                    self.queue,
                    exc,
                )
            keeping.close()
        if kept:
            with self._guard:
                self._held.extendleft(reversed(kept))
        return back

    def _sweep(self) -> None:
        """Give back what waited ``HOLD`` seconds for a reader; end after a while with
        nothing held (the next hold starts another)."""
        idle = 0  # rounds with nothing held
        while not self.broker.closed:
            try:
                idle = self._sweep_once(idle)
            except Exception:  # a bug of ours: said, and the sweep goes on
                log.exception("giving back prefetched tasks of %s failed", self.queue)
                time.sleep(HOLD)
                continue
            if idle > SWEEPER_IDLE:
                with self._guard:
                    if not self._held:
                        self._sweeper = None
                        return

    def _sweep_once(self, idle: int) -> int:
        """One round of :meth:`_sweep`: wait for the oldest held lease's ``HOLD`` (a
        tick, with none held) and give back what waited that long. The idle rounds."""
        with self._guard:
            oldest = self._held[0][1] if self._held else None
        if oldest is None:
            time.sleep(HOLD / 4)  # a lease held meanwhile waits HOLD and a tick at most
            return idle + 1
        wait = oldest + HOLD - time.monotonic()
        if wait > 0:
            time.sleep(wait)
            return 0
        went = self.give_back(older_than=HOLD)
        with self._guard:
            stuck = bool(self._held) and time.monotonic() - self._held[0][1] >= HOLD
        if stuck:  # the database is away: try again in a while, not at once
            time.sleep(HOLD)
        if went:
            log.info(
                "%d prefetched task(s) of %s went back to their queue: no reader of this "
                "process was free for %.1f s",
                went,
                self.queue,
                HOLD,
            )
        return 0
