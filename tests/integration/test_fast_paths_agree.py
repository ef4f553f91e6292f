"""PostgreSQL's one-statement fast paths agree with the checked path on every case (issue
27: "no rule written twice: where a PostgreSQL fast path re-encodes a check the Python
path makes ... a test proves they agree on every case").

On PostgreSQL, SEND (``send_fast``, ``send_many_fast``), RECEIVE (``receive_fast``,
``receive_fast_conversation``) and the take (``take_fast``) are single statements that
re-encode checks the Python ("checked") path makes: the sender's and the far endpoint's
state, the contract and which side may send a type, the type's validation (as the
broker's cache knows it), the target queue being on, retention on the sender's queue, the
fair-share clock; for RECEIVE and the take, a queue that is on, without retention or
aging, served group by group in level, fair-share and arrival order. When the statement
returns nothing the code falls back to the checked path, which raises the precise error
or does the special work. Each case below runs twice from the same database — once on a
broker with the fast paths, once on a broker without them — and the two runs must be
indistinguishable:

- what the operation returned (sequence numbers; the messages received or taken: their
  conversation and group by role, type, body, sequence number, level, status, in the same
  order), or the class of what it raised — and then, on each run, that it wrote nothing;
- the database after it: every endpoint (state, send and receive sequence, fair clock,
  level, group), every queued row (queue, status, type, body, level, fair-share stamp),
  the transmission queue (held and outgoing messages), the leases, the groups, and the
  queues' settings and rollback counts;
- the same before it: the state the case built, whose own SENDs, RECEIVEs and takes
  already went the fast way on one side and the checked way on the other.

How the fast paths are switched off: the second broker's store gets SQLite's strategies
for them (``store.features``: no one-statement SEND, RECEIVE or take; see
``scheduler_lib/broker/db/dialects.py``) and forgets the five statements (they leave its own
dict of named queries, which each ``Store`` copies for itself). That broker then takes the
path a dialect without them takes, and a caller that ran one of them unguarded would fail
with a KeyError instead of quietly shortcutting the checked run. Editing the SQL would
touch the library. The fast run's store is
watched (which of the statements ran, and whether it answered), and each case says
whether the one-statement path answers it: a comparison must never be of the checked path
with itself.

Both brokers start with a warm validation cache (every message type's validation, as a
broker that already sent each type has it): SEND's fast path runs only for types whose
validation it knows. A case may then change a type's validation behind the cache.

Random ids are compared by the role they play ("a.t": the target endpoint of conversation
a; "a.t.group": its group), times not at all, except the fair-share stamps and clocks:
with a quantum of 1000 s a stamp is its conversation's turn, ``round((stamp - time the
dialog began) / quantum)``, or "unstamped". Not compared: ``Lease.taken_at``, which only
the one-statement take knows (as ``Lease`` documents), and the queue monitors'
bookkeeping.

The two runs of a case go side by side on two databases — the template (migrated, with
the catalog) and its clone — each put back to the template's contents (every table's
rows, every sequence) before each run: both start from a fresh database's state, without
a CREATE and a DROP DATABASE per run (each DROP costs the shared server a checkpoint).

States are set up through the public API, but one: a conversation with one endpoint in
ER and the other still able to send, the window lifetime expiry leaves between the two
rows (the timer thread's SKIP LOCKED), is forged with one UPDATE — without it, the
statements' sender-state and far-state checks would each hide behind the other. No
sleeps: timers are fired with ``fire_timers`` until the state is there, within a
deadline. Known disagreements are kept as strict xfails that name them.

Not covered: SEND with ``before=`` (the same statements, pipelined after a layer's own
statement) and ``take_recorded`` (the same take, followed by a layer's statement);
RECEIVE with ``group=``, which has no fast path; races between transactions.
"""

from __future__ import annotations

import dataclasses
import re
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import DIALOG_TIMER, Broker, EndpointState, Lease, Message
from scheduler_lib.broker.db.store import Store

pytestmark = pytest.mark.postgres

FAST_PATHS = (
    "send_fast",
    "send_many_fast",
    "receive_fast",
    "receive_fast_one",  # TOP 1
    "receive_fast_conversation",
    "take_fast",
    "target_create_fast",  # a conversation's first SEND: its target endpoint, ahead of it
)
INITIATOR, TARGET, URGENT, REMOTE = "InitiatorService", "TargetService", "Urgent", "Elsewhere"
IQ, TQ = "InitiatorQueue", "TargetQueue"
CONTRACT = "WorkContract"
QUANTUM = 1000.0  # fair-share seconds: a stamp is then plainly its conversation's turn
LEASE = 300.0  # seconds: no lease expires during a test
WORKER = "worker-1"
DEADLINE = 5.0  # seconds a timer may take to fire
MAX_LOOKS = 50  # RECEIVEs or takes one case may make before it must have emptied a queue
BODIES = [b"1", b"2", b"3"]
UUID_TEXT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
NOT_COMPARED = {  # columns of random ids, or of times
    "message_id",
    "lease_id",
    "created_at",
    "modified_at",
    "enqueued_at",
    "closed_at",
    "disabled_at",
    "last_attempt_at",
    "taken_at",
    "heartbeat_at",
    "waiting_receivers",  # bookkeeping of waiting receivers, not an outcome
}


def build_catalog(broker: Broker) -> None:
    """The template's catalog: a contract with a type for each side, types either side may
    send under each validation, a type outside it, a service at a higher level and a route
    to another broker."""
    for name, validation in (
        ("Job", "NONE"),
        ("Done", "NONE"),
        ("Note", "NONE"),
        ("Blank", "EMPTY"),
        ("Xml", "WELL_FORMED_XML"),
        ("Json", "JSON"),
        ("Stray", "JSON"),  # in no contract
    ):
        broker.create_message_type(name, validation)
    broker.create_contract(
        CONTRACT,
        {
            "Job": "INITIATOR",
            "Done": "TARGET",
            "Note": "ANY",
            "Blank": "ANY",
            "Xml": "ANY",
            "Json": "ANY",
        },
    )
    broker.create_queue(IQ)
    broker.create_queue(TQ)
    broker.create_service(INITIATOR, IQ)
    broker.create_service(TARGET, TQ, [CONTRACT, "DEFAULT"])
    broker.create_service(URGENT, TQ, [CONTRACT])
    broker.create_priority("urgent", local_service=URGENT, level=8)  # its target endpoints
    broker.create_priority("to-urgent", remote_service=URGENT, level=3)  # their initiators
    broker.create_route("to-elsewhere", REMOTE, "tcp://127.0.0.1:9")


# --- one run, and how its outcome is compared -----------------------------------------------


class World:
    """One run: its broker, the handles its scenario made, and the names the comparison
    gives the random ids."""

    def __init__(self, broker: Broker, conn: sa.Connection) -> None:
        self.broker = broker
        self.lease: Lease | None = None
        self._conn = conn  # autocommit, to the broker's database
        self._handles: dict[str, uuid.UUID] = {}  # role ("a.i") -> handle
        self._conversations: dict[str, str] = {}  # label -> conversation id
        self._labels: dict[str, str] = {}  # conversation id -> label
        self._began: dict[str, float] = {}  # conversation id -> just before BEGIN DIALOG
        self._names: dict[str, str] = {}  # handle, group id -> its role
        self._conversation_of: dict[str, str] = {}  # handle -> conversation id

    # building the scenario

    def dialog(self, label: str, to: str = TARGET, contract: str = CONTRACT, **kw: Any) -> None:
        began = time.time()
        handle = self.broker.begin_dialog(INITIATOR, to, contract, **kw)
        conversation = str(self.broker.conversation_endpoint(handle).conversation_id)
        self._handles[f"{label}.i"] = handle
        self._conversations[label] = conversation
        self._labels[conversation] = label
        self._began[conversation] = began

    def handle(self, role: str) -> uuid.UUID:
        """The handle of ``role``: "a.i" (initiator of a) or "a.t" (its target, looked up
        once it exists and remembered after it is gone)."""
        if role not in self._handles:
            label, side = role.split(".")
            assert side == "t", role
            self._handles[role] = next(
                e.conversation_handle
                for e in self.broker.conversation_endpoints()
                if str(e.conversation_id) == self._conversations[label] and not e.is_initiator
            )
        return self._handles[role]

    def execute(self, sql: str, **params: Any) -> None:
        self._conn.execute(sa.text(sql), params)

    # what is compared

    def snapshot(self) -> dict[str, list[Any]]:
        """The database as the comparison sees it."""
        endpoints = self._rows("SELECT * FROM conversation_endpoints")
        self._learn_names(endpoints)
        queues = self._rows(
            "SELECT queue_name, is_receive_enabled, is_retention_enabled, disabled_reason,"
            " consecutive_rollbacks, receive_aging_seconds, fair_share_quantum"
            " FROM queues ORDER BY queue_name"
        )
        return {
            "endpoints": sorted((self._row(r) for r in endpoints), key=repr),
            "groups": sorted(
                (self._row(r) for r in self._rows("SELECT * FROM conversation_groups")),
                key=repr,
            ),
            "queue_messages": [
                self._row(r) for r in self._rows("SELECT * FROM queue_messages ORDER BY message_id")
            ],
            "transmission_queue": [
                self._row(r)
                for r in self._rows("SELECT * FROM transmission_queue ORDER BY message_id")
            ],
            "leases": sorted(
                (self._row(r) for r in self._rows("SELECT * FROM message_leases")), key=repr
            ),
            "queues": [self._row(r) for r in queues],
        }

    def normalized(self, value: object) -> object:
        """What an operation returned, its random ids by role."""
        if isinstance(value, list):
            return [self.normalized(v) for v in value]
        if isinstance(value, Message):
            return (
                value.queue_name,
                self._name(str(value.conversation_group_id)),
                self._name(str(value.conversation_handle)),
                value.message_sequence_number,
                value.message_type_name,
                value.body,
                value.priority,
                value.service_name,
                value.service_contract_name,
                value.status,
            )
        if isinstance(value, Lease):
            return ("lease", self.normalized(value.message), value.worker, value.duration)
        return value

    def _rows(self, sql: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self._conn.execute(sa.text(sql)).mappings()]

    def _learn_names(self, endpoints: list[dict[str, Any]]) -> None:
        """Name every endpoint by its conversation's label and side, and a group after the
        first endpoint (by role) seen in it."""
        roles = []
        for row in endpoints:
            label = self._labels.get(row["conversation_id"], "?")
            roles.append((f"{label}.{'i' if row['is_initiator'] else 't'}", row))
        for role, row in sorted(roles, key=lambda pair: pair[0]):
            self._names.setdefault(row["conversation_handle"], role)
            self._names.setdefault(row["conversation_group_id"], f"{role}.group")
            self._conversation_of[row["conversation_handle"]] = row["conversation_id"]

    def _name(self, text: str) -> str:
        return self._names.get(text) or self._labels.get(text) or "<unnamed>"

    def _row(self, row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for column, value in row.items():
            if column in NOT_COMPARED:
                continue
            if column in ("fair_at", "fair_clock"):
                value = self._turn(row, value)
            elif column in ("lifetime_expires_at", "timer_due_at", "redeliver_at"):
                value = value is not None
            elif column == "expires_at":  # a lease's: as long as it lasts
                value = round(value - row["taken_at"], 3)
            elif isinstance(value, str) and UUID_TEXT.fullmatch(value):
                value = self._name(value)
            out[column] = value
        return out

    def _turn(self, row: dict[str, Any], stamp: float) -> object:
        """A fair-share stamp or clock as its conversation's turn."""
        if not stamp:
            return "unstamped"
        conversation = row.get("conversation_id") or self._conversation_of.get(
            row["conversation_handle"], ""
        )
        began = self._began.get(conversation)
        return "?" if began is None else round((stamp - began) / QUANTUM)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run of a case showed."""

    before: dict[str, list[Any]]  # the state the case built (its SENDs went fast, or not)
    returned: object
    raised: str | None  # the class of what the operation raised
    after: dict[str, list[Any]]


@dataclasses.dataclass(frozen=True)
class Case:
    """``given`` builds the state through the public API; ``when`` runs the operation and
    returns what it returned; ``fast``: whether the one-statement path answers it (the
    fast run asserts so); ``disagrees``: a known disagreement (a strict xfail)."""

    id: str
    given: Callable[[World], object]
    when: Callable[[World], object]
    fast: bool
    disagrees: str | None = None


def params(cases: list[Case]) -> list[Any]:
    return [
        pytest.param(
            case,
            id=case.id,
            marks=[pytest.mark.xfail(strict=True, reason=case.disagrees)] if case.disagrees else [],
        )
        for case in cases
    ]


@dataclasses.dataclass
class Database:
    """The database of one side's runs (with the fast paths, or without them), put back
    before each run to the template's contents — every table's rows and every sequence as
    they were once the catalog was built: a fresh database's state, without a CREATE and a
    DROP DATABASE per run (each DROP costs the shared server a checkpoint)."""

    url: str
    conn: sa.Connection  # autocommit: the resets, the snapshots, the one forged UPDATE
    contents: dict[str, list[dict[str, Any]]]  # table -> its rows
    sequences: dict[str, int | None]  # sequence -> its last value (None: never used)

    def reset(self) -> None:
        self.conn.exec_driver_sql(  # a connection the last run left would see the reset
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        self.conn.exec_driver_sql("SET session_replication_role = replica")  # any order
        for table, rows in self.contents.items():
            self.conn.exec_driver_sql(f'DELETE FROM "{table}"')
            if rows:
                self.conn.execute(sa.table(table, *map(sa.column, rows[0])).insert(), rows)
        self.conn.exec_driver_sql("SET session_replication_role = DEFAULT")
        for sequence, last in self.sequences.items():
            self.conn.execute(
                sa.text("SELECT setval(:sequence, :value, :called)"),
                {"sequence": sequence, "value": last or 1, "called": last is not None},
            )


Pair = tuple[Database, Database]  # the fast side's, the checked side's


def contents_of(conn: sa.Connection) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every table's rows and every sequence's last value."""
    tables = conn.exec_driver_sql(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1"
    ).scalars()
    contents = {
        table: [dict(r) for r in conn.exec_driver_sql(f'SELECT * FROM "{table}"').mappings()]
        for table in tables
    }
    sequences = {
        f'"{schema}"."{name}"': last
        for schema, name, last in conn.exec_driver_sql(
            "SELECT schemaname, sequencename, last_value FROM pg_sequences"
        )
    }
    return contents, sequences


@pytest.fixture(scope="module")
def databases(postgres_server: str) -> Iterator[Pair]:
    """The fast side's database and the checked side's: the template (migrated, with the
    catalog) and its clone."""
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    suffix = uuid.uuid4().hex[:12]
    names = [f"scheduler_lib_agree_{side}_{suffix}" for side in ("fast", "checked")]
    urls = [
        sa.make_url(postgres_server).set(database=n).render_as_string(hide_password=False)
        for n in names
    ]
    engines = [
        sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        for url in urls
    ]
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{names[0]}"')
        broker = Broker(urls[0], timers=False)
        try:
            build_catalog(broker)
        finally:
            broker.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{names[1]}" TEMPLATE "{names[0]}"')
        conns = [engine.connect() for engine in engines]
        contents, sequences = contents_of(conns[0])
        yield (
            Database(urls[0], conns[0], contents, sequences),
            Database(urls[1], conns[1], contents, sequences),
        )
    finally:
        for engine in engines:
            engine.dispose()
        with admin.connect() as conn:
            for name in names:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def raised_by_the_library(exc: BaseException) -> bool:
    """An exception the broker raised is an outcome to compare; one the test's own code
    raised is a bug of the test, and goes on."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "/scheduler_lib/" in frames[-1].filename


def run(
    database: Database, case: Case, monkeypatch: pytest.MonkeyPatch, *, fast: bool
) -> tuple[Outcome, list[tuple[str, bool]]]:
    """One run of ``case`` from the template's state: its outcome, and the fast statements
    the operation ran (each with whether it answered)."""
    database.reset()
    broker = Broker(database.url, migrate=False, timers=False)
    ran: list[tuple[str, bool]] = []
    try:
        store = broker._store
        if fast:
            watch_fast_statements(store, ran, monkeypatch)
        else:
            # SQLite's strategies for these paths, on PostgreSQL; and the statements gone
            store.features = dataclasses.replace(
                store.features,
                one_statement_send=False,
                one_statement_receive=False,
                one_statement_take=False,
            )
            for query in FAST_PATHS:
                del store._queries[query]
        # Warm, as a broker that has sent every type once (SEND's fast path needs it)
        broker._shared.validation_cache.update(broker.message_types())
        world = World(broker, database.conn)
        case.given(world)
        before = world.snapshot()
        ran.clear()  # the operation's own statements only
        raised = None
        try:
            returned = world.normalized(case.when(world))
        except Exception as exc:
            if not raised_by_the_library(exc):
                raise
            returned, raised = None, type(exc).__name__
        after = world.snapshot()
        if raised is not None:
            path = "fast" if fast else "checked"
            assert after == before, f"the {path} run raised {raised} yet wrote"
    finally:
        broker.close()
    return Outcome(before, returned, raised, after), ran


def watch_fast_statements(
    store: Store, ran: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    on_driver = store._on_driver

    def watched(conn: Any, query: str, params: Any) -> Any:
        names, rows, count = on_driver(conn, query, params)
        if query in FAST_PATHS:
            ran.append((query, bool(rows)))
        return names, rows, count

    monkeypatch.setattr(store, "_on_driver", watched)
    pipeline = store.pipeline

    def watched_pipeline(conn: Any, statements: Any) -> Any:
        results = pipeline(conn, statements)
        for (query, _), rows in zip(statements, results, strict=True):
            if query in FAST_PATHS:
                ran.append((query, bool(rows)))
        return results

    monkeypatch.setattr(store, "pipeline", watched_pipeline)


def assert_paths_agree(databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the case's state, built the same way on two databases in the template's state
    # When its operation runs on a broker with the fast paths, and on one without them
    # (side by side: they share nothing but the server)
    with ThreadPoolExecutor(max_workers=2) as runs:
        fast_run = runs.submit(run, databases[0], case, monkeypatch, fast=True)
        checked_run = runs.submit(run, databases[1], case, monkeypatch, fast=False)
        (with_fast, ran), (checked, _) = fast_run.result(), checked_run.result()
    # Then the fast run went the one-statement way exactly where the case says it can
    # (else the comparison would be of the checked path with itself)
    answered = [query for query, rows in ran if rows]
    assert bool(answered) == case.fast, f"fast statements run (answered?): {ran}"
    # and the two runs are indistinguishable: what came back, or was raised, and after
    assert with_fast == checked


# --- the state a case starts from: steps through the public API ---------------------------


def steps(*given: Callable[[World], object]) -> Callable[[World], None]:
    def run_all(w: World) -> None:
        for step in given:
            step(w)

    return run_all


def set_queue(name: str, **settings: Any) -> Callable[[World], object]:
    return lambda w: w.broker.alter_queue(name, **settings)


def ended(role: str, **how: Any) -> Callable[[World], object]:
    return lambda w: w.broker.end_conversation(w.handle(role), **how)


def started(w: World) -> None:
    """Conversation c: its initiator began (SO); no target endpoint yet."""
    w.dialog("c")


def job_sent(w: World, label: str = "c", to: str = TARGET) -> None:
    """The initiator sent a Job: initiator SO, target SI, the Job on the target queue."""
    w.dialog(label, to=to)
    w.broker.send(w.handle(f"{label}.i"), "Job", f"{label}-job")
    w.handle(f"{label}.t")


def conversing(w: World) -> None:
    """Both sides sent: CO (the initiator's CO derived, as endpoint_get shows it)."""
    job_sent(w)
    w.broker.send(w.handle("c.t"), "Done", b"done")


initiator_ended = steps(job_sent, ended("c.i"))  # initiator DO, target DI
target_ended = steps(job_sent, ended("c.t"))  # target DO, initiator DI
initiator_failed = steps(job_sent, ended("c.i", error=50, description="gave up"))  # target ER
target_failed = steps(job_sent, ended("c.t", error=50, description="gave up"))  # initiator ER
both_ended = steps(initiator_ended, ended("c.t"))  # both closed: the handles are gone
target_cleaned_up = steps(job_sent, ended("c.t", cleanup=True))  # the initiator's far side gone
initiator_cleaned_up = steps(job_sent, ended("c.i", cleanup=True))  # the target's far side gone


def lifetime_expired(w: World) -> None:
    """Both sides in ER: the dialog's lifetime ran out and the timers fired."""
    w.dialog("c", lifetime=0.001)
    w.broker.send(w.handle("c.i"), "Job", b"job")

    def expired() -> bool:
        states = {w.broker.conversation_endpoint(w.handle(r)).state for r in ("c.i", "c.t")}
        return states == {EndpointState.ERROR}

    fire_timers_until(w, expired)


def expired_first(role: str) -> Callable[[World], None]:
    """Conversing, then ``role`` alone in ER: the window lifetime expiry leaves between the
    two endpoint rows of a conversation (the timer thread's SKIP LOCKED expires one while
    another transaction holds the other). Not reachable on demand through the API: forged
    with one UPDATE."""

    def forge(w: World) -> None:
        conversing(w)
        w.execute(
            "UPDATE conversation_endpoints SET state = 'ER' WHERE conversation_handle = :h",
            h=str(w.handle(role)),
        )

    return forge


def remote_started(w: World) -> None:
    """A dialog with a service on another broker (by route): its messages are outgoing."""
    w.dialog("c", to=REMOTE)


remote_closed = steps(remote_started, ended("c.i"))  # a remote endpoint's tombstone (CD)


def default_contract(w: World) -> None:
    w.dialog("c", contract="DEFAULT")
    w.broker.send(w.handle("c.i"), "DEFAULT", b"first")


def fire_timers_until(w: World, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not done():
        assert time.monotonic() < deadline, "the timers did not fire within the deadline"
        w.broker.fire_timers()


def mixed_traffic(w: World) -> None:
    """On the target queue: five conversations in four groups at two levels (u at 8),
    arrivals interleaved; b moved into a's group; e's initiator ended with an error (an
    Error, number -1), d's ended (an EndDialog); a DialogTimer (number -2) for a."""
    for label, to in (("a", TARGET), ("u", URGENT), ("b", TARGET), ("e", TARGET), ("d", TARGET)):
        w.dialog(label, to=to)
    for n, label in enumerate("auba" + "uedba"):
        w.broker.send(w.handle(f"{label}.i"), "Job", f"{label}{n}")
    group = w.broker.conversation_endpoint(w.handle("a.t")).conversation_group_id
    w.broker.move_conversation(w.handle("b.t"), group)
    w.broker.end_conversation(w.handle("e.i"), error=50, description="gave up")
    w.broker.end_conversation(w.handle("d.i"))
    w.broker.begin_conversation_timer(w.handle("a.t"), 0)
    fire_timers_until(
        w, lambda: any(m.message_type_name == DIALOG_TIMER for m in w.broker.peek(TQ))
    )


def fair_bursts(w: World) -> None:
    """Fair share on the target queue, and bursts of three messages from a, b and c."""
    w.broker.alter_queue(TQ, fair_share=QUANTUM)
    for label in "abc":
        w.dialog(label)
        w.broker.send_many(w.handle(f"{label}.i"), "Job", [f"{label}{n}" for n in range(3)])


def related_replies(w: World) -> None:
    """Replies on the initiator queue: a and b share the initiators' group, c and u have
    their own, u's at level 3 (the priority of dialogs with Urgent, on the initiator's
    side); the targets answered interleaved."""
    w.dialog("a")
    w.dialog("b", related_conversation=w.handle("a.i"))
    w.dialog("c")
    w.dialog("u", to=URGENT)
    for label in "abcu":
        w.broker.send(w.handle(f"{label}.i"), "Job", b"job")
    for n, label in enumerate("cubabuc"):
        w.broker.send(w.handle(f"{label}.t"), "Done", f"{label}{n}")


def crowded_group(w: World) -> None:
    """Six conversations in the initiators' one group, each with one reply on the initiator
    queue, the replies arriving in another order than the dialogs began (and than their
    handles sort, but for one chance in 720)."""
    w.dialog("g0")
    for n in range(1, 6):
        w.dialog(f"g{n}", related_conversation=w.handle("g0.i"))
    for n in range(6):
        w.broker.send(w.handle(f"g{n}.i"), "Job", b"job")
    for n in (3, 0, 5, 1, 4, 2):
        w.broker.send(w.handle(f"g{n}.t"), "Done", f"g{n}")


def levels_in_one_group(w: World) -> None:
    """Two conversations of one group at two levels on the target queue: a's messages
    arrived first, then u's (at 8), then a's again; u moved into a's group."""
    w.dialog("a")
    w.dialog("u", to=URGENT)
    for n, label in enumerate("aaua"):
        w.broker.send(w.handle(f"{label}.i"), "Job", f"{label}{n}")
    group = w.broker.conversation_endpoint(w.handle("a.t")).conversation_group_id
    w.broker.move_conversation(w.handle("u.t"), group)


class _Undo(Exception):
    """Raised to roll a transaction back."""


def rolled_back_receive(w: World) -> None:
    """A transaction received from the target queue and rolled back: its rollback count
    is 1, and the next RECEIVE that gets messages resets it."""
    with pytest.raises(_Undo), w.broker.transaction() as tx:
        assert tx.receive(TQ, top=2, timeout=0)
        raise _Undo


def leased(w: World) -> None:
    """The target took c's Job under a lease (w.lease) to answer it later."""
    job_sent(w)
    [w.lease] = w.broker.take(TQ, timeout=0, lease=LEASE, worker=WORKER)


def lease_completed(w: World) -> None:
    assert w.lease is not None
    w.broker.complete(w.lease)


def lease_released(w: World) -> None:
    assert w.lease is not None
    w.broker.release(w.lease)


# --- the operations -------------------------------------------------------------------------


def send(role: str, message_type: str, body: bytes | None = b"x") -> Callable[[World], object]:
    return lambda w: w.broker.send(w.handle(role), message_type, body)


def send_many(
    role: str, message_type: str, bodies: list[bytes | None] | None = None
) -> Callable[[World], object]:
    return lambda w: w.broker.send_many(w.handle(role), message_type, bodies or BODIES)


def answer(message_type: str = "Done", body: bytes | None = b"done") -> Callable[[World], object]:
    """The target answers c's Job, completing the lease it took."""
    return lambda w: w.broker.send(w.handle("c.t"), message_type, body, completing=w.lease)


def receive_all(queue: str, top: int, conversation: str | None = None) -> Callable[[World], object]:
    """RECEIVE (TOP top) until the queue has nothing more: the batches, in order."""

    def when(w: World) -> object:
        handle = None if conversation is None else w.handle(conversation)
        batches: list[list[Message]] = []
        for _ in range(MAX_LOOKS):
            got = w.broker.receive(queue, top, timeout=0, conversation=handle)
            if not got:
                return batches
            batches.append(got)
        raise AssertionError(f"{queue} still had messages after {MAX_LOOKS} RECEIVEs")

    return when


def take_all(queue: str, top: int, *, durable: bool) -> Callable[[World], object]:
    """Take (TOP top) until the queue has nothing more: the batches of leases, in order."""

    def when(w: World) -> object:
        batches: list[list[Lease]] = []
        for _ in range(MAX_LOOKS):
            got = w.broker.take(queue, top, timeout=0, lease=LEASE, worker=WORKER, durable=durable)
            if not got:
                return batches
            batches.append(got)
        raise AssertionError(f"{queue} still had messages after {MAX_LOOKS} takes")

    return when


def two_receives_in_one_transaction(w: World) -> object:
    with w.broker.transaction() as tx:
        return [tx.receive(TQ, top=2, timeout=0), tx.receive(TQ, top=2, timeout=0)]


# --- the matrix -------------------------------------------------------------------------------

SEND_CASES = [
    # The sender's state and side, with a type its side may send
    # The first message makes the target endpoint (target_create_fast, ahead of the SEND)
    Case("initiator-SO-first-message", started, send("c.i", "Job"), fast=True),
    Case("first-message-target-type", started, send("c.i", "Done"), fast=False),
    Case("first-message-bad-body", started, send("c.i", "Json", b"{"), fast=False),
    Case(
        "first-message-queue-off",
        steps(set_queue(TQ, status=False), started),
        send("c.i", "Job"),
        fast=False,
    ),
    Case(
        "first-message-retention",
        steps(set_queue(IQ, retention=True), started),
        send("c.i", "Job"),
        fast=False,
    ),
    Case("first-message-urgent", lambda w: w.dialog("c", to=URGENT), send("c.i", "Job"), fast=True),
    Case("initiator-SO-target-exists", job_sent, send("c.i", "Job"), fast=True),
    Case("initiator-CO", conversing, send("c.i", "Job"), fast=True),
    Case("initiator-DI-target-ended", target_ended, send("c.i", "Job"), fast=False),
    Case("initiator-DO-it-ended", initiator_ended, send("c.i", "Job"), fast=False),
    Case("initiator-ER-target-ended-with-error", target_failed, send("c.i", "Job"), fast=False),
    Case("initiator-ER-lifetime-expired", lifetime_expired, send("c.i", "Job"), fast=False),
    Case("initiator-closed", both_ended, send("c.i", "Job"), fast=False),
    Case("initiator-far-side-cleaned-up", target_cleaned_up, send("c.i", "Job"), fast=False),
    Case("initiator-ER-forged", expired_first("c.i"), send("c.i", "Job"), fast=False),
    Case("initiator-far-side-ER-forged", expired_first("c.t"), send("c.i", "Job"), fast=False),
    Case("initiator-remote", remote_started, send("c.i", "Job"), fast=False),
    Case("initiator-remote-CD-tombstone", remote_closed, send("c.i", "Job"), fast=False),
    Case("target-SI", job_sent, send("c.t", "Done"), fast=True),
    Case("target-CO", conversing, send("c.t", "Done"), fast=True),
    Case("target-DI-initiator-ended", initiator_ended, send("c.t", "Done"), fast=False),
    Case("target-DO-it-ended", target_ended, send("c.t", "Done"), fast=False),
    Case("target-ER-initiator-ended-with-error", initiator_failed, send("c.t", "Done"), fast=False),
    Case("target-ER-lifetime-expired", lifetime_expired, send("c.t", "Done"), fast=False),
    Case("target-closed", both_ended, send("c.t", "Done"), fast=False),
    Case("target-far-side-cleaned-up", initiator_cleaned_up, send("c.t", "Done"), fast=False),
    Case("target-ER-forged", expired_first("c.t"), send("c.t", "Done"), fast=False),
    Case("target-far-side-ER-forged", expired_first("c.i"), send("c.t", "Done"), fast=False),
    # The message type: the other side's, either side's (ANY), none of the contract's
    Case("initiator-sends-target-type", conversing, send("c.i", "Done"), fast=False),
    Case("target-sends-initiator-type", conversing, send("c.t", "Job"), fast=False),
    Case("initiator-sends-ANY-type", conversing, send("c.i", "Note"), fast=True),
    Case("target-sends-ANY-type", conversing, send("c.t", "Note"), fast=True),
    Case("initiator-type-not-in-contract", conversing, send("c.i", "Stray", b"{}"), fast=False),
    Case("target-type-not-in-contract", conversing, send("c.t", "Stray", b"{}"), fast=False),
    Case("unknown-message-type", conversing, send("c.i", "Nope"), fast=False),
    Case("DEFAULT-contract-DEFAULT-type", default_contract, send("c.i", "DEFAULT"), fast=True),
    Case("DEFAULT-contract-other-type", default_contract, send("c.i", "Job"), fast=False),
    # The type's validation: a body that passes, one that fails
    Case("EMPTY-empty-body", conversing, send("c.i", "Blank", b""), fast=True),
    Case("EMPTY-no-body", conversing, send("c.i", "Blank", None), fast=True),
    Case("EMPTY-a-body", conversing, send("c.i", "Blank", b"x"), fast=False),
    Case("XML-well-formed", conversing, send("c.i", "Xml", b"<job n='1'/>"), fast=True),
    Case("XML-malformed", conversing, send("c.i", "Xml", b"<job>"), fast=False),
    Case("JSON-valid", conversing, send("c.i", "Json", b'{"n": 1}'), fast=True),
    Case("JSON-invalid", conversing, send("c.i", "Json", b"{"), fast=False),
    Case("JSON-no-body", conversing, send("c.i", "Json", None), fast=True),
    Case(
        "validation-loosened-behind-the-cache",
        steps(conversing, lambda w: w.broker.alter_message_type("Json", "NONE")),
        send("c.i", "Json", b"not json"),
        fast=False,
    ),
    Case(
        "validation-tightened-behind-the-cache-bad-body",
        steps(conversing, lambda w: w.broker.alter_message_type("Note", "JSON")),
        send("c.i", "Note", b"not json"),
        fast=False,
    ),
    Case(
        "validation-tightened-behind-the-cache-good-body",
        steps(conversing, lambda w: w.broker.alter_message_type("Note", "JSON")),
        send("c.i", "Note", b"{}"),
        fast=False,
    ),
    # A bad body on a SEND that another check refuses too
    Case(
        "bad-body-and-sender-ended",
        initiator_ended,
        send("c.i", "Json", b"{"),
        fast=False,
    ),
    Case(
        "bad-body-and-type-not-in-contract",
        conversing,
        send("c.i", "Stray", b"{"),
        fast=False,
    ),
    Case(
        "bad-body-and-conversation-gone",
        both_ended,
        send("c.i", "Json", b"{"),
        fast=False,
    ),
    # The queues: the target's off, the sender's off, retention on either side
    Case(
        "target-queue-off",
        steps(job_sent, set_queue(TQ, status=False)),
        send("c.i", "Job"),
        fast=False,
    ),
    Case(
        "initiator-queue-off",
        steps(job_sent, set_queue(IQ, status=False)),
        send("c.t", "Done"),
        fast=False,
    ),
    Case(
        "senders-own-queue-off",
        steps(job_sent, set_queue(IQ, status=False)),
        send("c.i", "Job"),
        fast=True,
    ),
    Case(
        "retention-on-initiators-queue",
        steps(set_queue(IQ, retention=True), job_sent),
        send("c.i", "Job"),
        fast=False,
    ),
    Case(
        "retention-on-targets-queue-target-sends",
        steps(set_queue(TQ, retention=True), job_sent),
        send("c.t", "Done"),
        fast=False,
    ),
    Case(
        "retention-on-receivers-queue-only",
        steps(set_queue(TQ, retention=True), job_sent),
        send("c.i", "Job"),
        fast=True,
    ),
    # Fair share: the stamps and the sender's clock
    Case(
        "fair-share-first-stamp",
        steps(job_sent, set_queue(TQ, fair_share=QUANTUM)),
        send("c.i", "Job"),
        fast=True,
    ),
    Case(
        "fair-share-clock-ahead",
        steps(set_queue(TQ, fair_share=QUANTUM), job_sent, send("c.i", "Job")),
        send("c.i", "Job"),
        fast=True,
    ),
    Case(
        "fair-share-target-to-initiator",
        steps(set_queue(IQ, fair_share=QUANTUM), job_sent, send("c.t", "Done")),
        send("c.t", "Done"),
        fast=True,
    ),
    Case(
        "fair-share-and-retention-on-sender",
        steps(set_queue(TQ, fair_share=QUANTUM), set_queue(IQ, retention=True), job_sent),
        send("c.i", "Job"),
        fast=False,
    ),
    Case(
        "fair-share-target-queue-off",
        steps(set_queue(TQ, fair_share=QUANTUM), job_sent, set_queue(TQ, status=False)),
        send("c.i", "Job"),
        fast=False,
    ),
    # Levels: the message takes its receiving endpoint's
    Case("urgent-target", lambda w: job_sent(w, to=URGENT), send("c.i", "Job"), fast=True),
    Case("urgent-target-answers", lambda w: job_sent(w, to=URGENT), send("c.t", "Done"), fast=True),
]

SEND_MANY_CASES = [
    # The first messages of a conversation: its target endpoint made ahead of them, in
    # their round trip
    Case("first-messages", started, send_many("c.i", "Job"), fast=True),
    Case(
        "first-messages-queue-off",
        steps(set_queue(TQ, status=False), started),
        send_many("c.i", "Job"),
        fast=False,
    ),
    Case("first-messages-target-type", started, send_many("c.i", "Done"), fast=False),
    Case("target-exists", job_sent, send_many("c.i", "Job"), fast=True),
    Case("target-SI", job_sent, send_many("c.t", "Done"), fast=True),
    Case(
        "fair-share-clock-ahead",
        steps(set_queue(TQ, fair_share=QUANTUM), job_sent),
        send_many("c.i", "Job"),
        fast=True,
    ),
    Case(
        "fair-share-first-stamps",
        steps(job_sent, set_queue(TQ, fair_share=QUANTUM)),
        send_many("c.i", "Job"),
        fast=True,
    ),
    Case("sender-ended", initiator_ended, send_many("c.i", "Job"), fast=False),
    Case("target-DI", initiator_ended, send_many("c.t", "Done"), fast=False),
    Case("sender-ER-forged", expired_first("c.i"), send_many("c.i", "Job"), fast=False),
    Case("far-side-ER-forged", expired_first("c.t"), send_many("c.i", "Job"), fast=False),
    Case("other-sides-type", job_sent, send_many("c.i", "Done"), fast=False),
    Case("type-not-in-contract", job_sent, send_many("c.i", "Stray", [b"{}"] * 3), fast=False),
    Case(
        "a-bad-body-among-them",
        job_sent,
        send_many("c.i", "Json", [b"{}", b"{", b"[]"]),
        fast=False,
    ),
    Case(
        "retention-on-senders-queue",
        steps(set_queue(IQ, retention=True), job_sent),
        send_many("c.i", "Job"),
        fast=False,
    ),
    Case(
        "target-queue-off",
        steps(job_sent, set_queue(TQ, status=False)),
        send_many("c.i", "Job"),
        fast=False,
    ),
    Case("remote", remote_started, send_many("c.i", "Job"), fast=False),
    Case(
        "validation-loosened-behind-the-cache",
        steps(job_sent, lambda w: w.broker.alter_message_type("Json", "NONE")),
        send_many("c.i", "Json", [b"not json"] * 3),
        # the stale cache sends the first the checked way, which refreshes it; the rest
        # then go in one statement
        fast=True,
    ),
    Case(
        "bad-body-and-sender-ended",
        initiator_ended,
        send_many("c.i", "Json", [b"{"]),
        fast=False,
    ),
]

COMPLETING_CASES = [
    Case("lease-held", leased, answer(), fast=True),
    # A lease that is gone: the one statement writes nothing (it must not send, as in
    # autocommit it would commit the answer) and the checked path raises LeaseLost
    Case("lease-completed-already", steps(leased, lease_completed), answer(), fast=False),
    Case("lease-released", steps(leased, lease_released), answer(), fast=False),
    Case("lease-held-target-ended", steps(leased, ended("c.t")), answer(), fast=False),
    Case("lease-held-initiator-ended", steps(leased, ended("c.i")), answer(), fast=False),
    Case("lease-held-other-sides-type", leased, answer("Job"), fast=False),
    Case("lease-held-bad-body", leased, answer("Json", b"{"), fast=False),
    Case(
        "lease-held-retention-on-senders-queue",
        steps(set_queue(TQ, retention=True), leased),
        answer(),
        fast=False,
    ),
    Case(
        "lease-held-initiator-queue-off",
        steps(leased, set_queue(IQ, status=False)),
        answer(),
        fast=False,
    ),
    Case(
        "lease-held-fair-share",
        steps(set_queue(IQ, fair_share=QUANTUM), leased),
        answer(),
        fast=True,
    ),
    Case(
        "lease-gone-sender-ended",
        steps(leased, lease_completed, ended("c.i")),
        answer(),
        fast=False,
    ),
    Case(
        "lease-gone-bad-body",
        steps(leased, lease_completed),
        answer("Json", b"{"),
        fast=False,
    ),
]

QUEUE_STATES: list[tuple[str, Callable[[World], object], bool, str | None]] = [
    # (id, given, whether the one-statement RECEIVE and take serve the queue, and how the
    # take(durable=False) disagrees there if it does)
    ("retention", steps(set_queue(TQ, retention=True), mixed_traffic), False, None),
    ("aging", steps(set_queue(TQ, receive_aging=0.001), mixed_traffic), False, None),
    ("queue-off", steps(mixed_traffic, set_queue(TQ, status=False)), False, None),
    ("empty", started, False, None),
    ("fair-share-bursts", fair_bursts, True, None),
    ("after-a-rolled-back-receive", steps(mixed_traffic, rolled_back_receive), True, None),
]

RECEIVE_CASES = [
    Case("levels-groups-system-messages-top-1", mixed_traffic, receive_all(TQ, 1), fast=True),
    Case("levels-groups-system-messages-top-3", mixed_traffic, receive_all(TQ, 3), fast=True),
    Case("levels-groups-system-messages-top-10", mixed_traffic, receive_all(TQ, 10), fast=True),
    Case("one-conversation", mixed_traffic, receive_all(TQ, 10, conversation="a.t"), fast=True),
    Case(
        "one-conversation-queue-off",
        steps(mixed_traffic, set_queue(TQ, status=False)),
        receive_all(TQ, 10, conversation="a.t"),
        fast=False,
    ),
    Case(
        "one-conversation-retention",
        steps(set_queue(TQ, retention=True), mixed_traffic),
        receive_all(TQ, 10, conversation="a.t"),
        fast=False,
    ),
    Case("replies-in-a-related-group", related_replies, receive_all(IQ, 1), fast=True),
    Case("levels-in-one-group-top-1", levels_in_one_group, receive_all(TQ, 1), fast=True),
    Case("levels-in-one-group-top-2", levels_in_one_group, receive_all(TQ, 2), fast=True),
    Case("six-conversations-in-one-group", crowded_group, receive_all(IQ, 10), fast=True),
    Case("two-in-one-transaction", mixed_traffic, two_receives_in_one_transaction, fast=True),
    Case("unknown-queue", started, receive_all("NoSuchQueue", 1), fast=False),
    *(Case(name, given, receive_all(TQ, 2), fast) for name, given, fast, _ in QUEUE_STATES),
]

TAKE_CASES = [
    Case("top-1-not-durable", mixed_traffic, take_all(TQ, 1, durable=False), fast=True),
    Case("top-3-not-durable", mixed_traffic, take_all(TQ, 3, durable=False), fast=True),
    Case("top-10-not-durable", mixed_traffic, take_all(TQ, 10, durable=False), fast=True),
    Case(
        "six-conversations-in-one-group",
        crowded_group,
        take_all(IQ, 10, durable=False),
        fast=True,
    ),
    Case("top-2-durable", mixed_traffic, take_all(TQ, 2, durable=True), fast=True),
    Case(
        "levels-in-one-group",
        levels_in_one_group,
        take_all(TQ, 1, durable=False),
        fast=True,
    ),
    Case("unknown-queue", started, take_all("NoSuchQueue", 1, durable=False), fast=False),
    *(
        Case(f"{name}-not-durable", given, take_all(TQ, 2, durable=False), fast, disagrees)
        for name, given, fast, disagrees in QUEUE_STATES
    ),
    *(
        Case(f"{name}-durable", given, take_all(TQ, 2, durable=True), fast)
        for name, given, fast, _ in QUEUE_STATES
        if name in ("retention", "aging")
    ),
]


@pytest.mark.parametrize("case", params(SEND_CASES))
def test_send(databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_paths_agree(databases, case, monkeypatch)


@pytest.mark.parametrize("case", params(SEND_MANY_CASES))
def test_send_many(databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_paths_agree(databases, case, monkeypatch)


@pytest.mark.parametrize("case", params(COMPLETING_CASES))
def test_send_completing_a_lease(
    databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_paths_agree(databases, case, monkeypatch)


@pytest.mark.parametrize("case", params(RECEIVE_CASES))
def test_receive(databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_paths_agree(databases, case, monkeypatch)


@pytest.mark.parametrize("case", params(TAKE_CASES))
def test_take(databases: Pair, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_paths_agree(databases, case, monkeypatch)
