"""What each database does for the broker, said once: its fast paths, its locking, its
wake-ups.

The broker runs on SQLite (one file, one writer at a time) and PostgreSQL (row locks,
LISTEN/NOTIFY, commits that may skip the WAL flush). Code that takes a dialect's own path
asks its :class:`Dialect` (``store.features``) — chosen once, from the engine's dialect
name — instead of probing for the name of a statement only one dialect has. Each
capability that rests on named statements lists them (:attr:`Dialect.STATEMENTS`); a unit
test checks that a dialect has those statements exactly when it has the capability.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class Dialect:
    """The broker's strategies on one database."""

    name: str
    #: SEND (one message or several) checked and enqueued in one statement; no row back
    #: means "take the checked path" (a conversation's first SEND: its target endpoint
    #: made by a statement ahead of it, in its round trip)
    one_statement_send: bool
    #: RECEIVE in one statement (lock the first free group, take its messages in order)
    one_statement_receive: bool
    #: a take under a lease in one autocommit statement, committed without the WAL flush,
    #: with a statement of a layer above in its round trip (``Broker.take_recorded``)
    one_statement_take: bool
    #: LISTEN/NOTIFY wakes other processes' waiters (else SQLite's file watcher)
    notifies: bool
    #: a transaction may commit without waiting for the WAL flush (bookkeeping nobody must
    #: find after a crash; a take made durable by the start recorded after it)
    commits_without_flush: bool
    #: read-only transactions that see one moment and hold nobody up (``Broker.snapshot``)
    read_only_snapshots: bool
    #: one writer at a time for the whole database: a process's threads queue for it
    #: (else row locks: ``FOR UPDATE [SKIP LOCKED]``)
    single_writer: bool
    #: a server on a host of its own, shared by processes on other hosts: its clock is the
    #: one they can all read (the timer thread compares this host's with it; SQLite's
    #: processes share one host, and one clock)
    server_clock: bool

    #: the named statements each capability rests on (the broker's own queries)
    STATEMENTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "one_statement_send": ("send_fast", "send_many_fast", "target_create_fast"),
        "one_statement_receive": ("receive_fast", "receive_fast_one", "receive_fast_conversation"),
        "one_statement_take": ("take_fast", "leases_taken"),
        "notifies": ("transmission_notify",),
        "commits_without_flush": ("commit_without_fsync",),
        "read_only_snapshots": ("snapshot_begin",),
        "server_clock": ("server_clock",),
    }


SQLITE = Dialect(
    "sqlite",
    one_statement_send=False,
    one_statement_receive=False,
    one_statement_take=False,
    notifies=False,
    commits_without_flush=False,
    read_only_snapshots=False,
    single_writer=True,
    server_clock=False,
)
POSTGRESQL = Dialect(
    "postgresql",
    one_statement_send=True,
    one_statement_receive=True,
    one_statement_take=True,
    notifies=True,
    commits_without_flush=True,
    read_only_snapshots=True,
    single_writer=False,
    server_clock=True,
)
DIALECTS = {d.name: d for d in (SQLITE, POSTGRESQL)}


def of(name: str) -> Dialect:
    """The broker's strategies for a SQLAlchemy dialect name.

    :raises ValueError: for a database the broker does not run on
    """
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(
            f"the broker runs on {' or '.join(sorted(DIALECTS))}, not {name!r}"
        ) from None
