"""The scheduler's catalog on the broker (seed 002): message types, contract, queues and
services, made idempotently, and the scheduler's own schema.

Names default to the blog's (``AsyncSent``, ``AsyncDone``, ``AsyncContract``,
``QueueAsyncInitiator`` …) and are configurable; several target services (e.g. one per
cluster) can share one initiator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from scheduler_lib.broker import Broker, schema
from scheduler_lib.broker.exceptions import (
    AlreadyExists,
    ContractNotFound,
    InvalidArgument,
    SchemaNotCurrent,
)
from scheduler_lib.broker.poison import Notify, PoisonPolicy

MIGRATIONS = schema.MigrationSet("scheduler_lib.scheduler:migrations", "scheduler_alembic_version")
QUERIES = "scheduler_lib.scheduler"
log = logging.getLogger(__name__)
EXECUTOR = "scheduler_lib.scheduler.executor:serve"  # the activation procedure
LOST_TASK_CALLBACK = "scheduler_lib.scheduler.executor:report_lost_task"
DEFAULT_KINDS = ("sql", "python")
FAIR_SHARE = 1.0  # seconds of virtual time per task: schedulers are served in turn


@dataclasses.dataclass(frozen=True)
class Names:
    """The broker objects the scheduler pattern uses (the blog's names by default)."""

    sent: str = "AsyncSent"
    done: str = "AsyncDone"
    contract: str = "AsyncContract"
    initiator_queue: str = "QueueAsyncInitiator"
    initiator_service: str = "ServiceAsyncInitiator"


@dataclasses.dataclass(frozen=True)
class Target:
    """A target service: where tasks go and who runs them.

    :param kinds: task kinds its executor runs; others are refused before sending
    :param max_readers: most tasks it runs at once (activated readers)
    :param retries: how often a task whose worker died silently is run again before it
        fails (its caller is told either way)
    :param activation: start executors on demand (off: run them yourself)
    :param durable_start: a task's start reaches the disk before the task runs (the
        default: a database crash never runs a task twice). ``False`` for tasks whose
        effects are idempotent: on PostgreSQL the task runs without waiting for that
        flush, and its end (its row's, its lease's and the caller's answer) commits
        without waiting for it either; a database server crash may then run it again
        (give it ``retries`` of 1 or more: a task whose end the crash lost counts as
        one whose worker stopped without an answer; ``init`` warns of one without).
        Once the caller has received the answer, all of it is on disk either way
        (docs/scheduler.md, "Durable or lazy start")
    :param address: ``tcp://host:port`` of the broker that hosts this target service,
        when it is not this one: ``init`` then makes a route to it instead of its queue
        and service (the other broker runs ``init`` with the target, and both run a
        transport endpoint, ``scheduler-lib serve --listen``)
    """

    service: str = "ServiceAsyncTarget"
    queue: str = "QueueAsyncTarget"
    kinds: Sequence[str] = DEFAULT_KINDS
    max_readers: int = 4
    retries: int = 0
    activation: bool = True
    procedure: str = EXECUTOR
    address: str | None = None
    durable_start: bool = True


def prepare(broker: Broker, *, migrate: bool = True) -> None:
    """The scheduler's schema and queries on this broker (idempotent, cheap). The
    readers of a wave start together: one of them prepares, the others wait for it.

    :param migrate: bring the schema up to date; without it, only check that it is (for
        roles that may not change the schema: the page's monitor role, a connection with
        ``"migrate": false``)
    :raises SchemaNotCurrent: without ``migrate``, a schema that is missing or not at
        this version's revision
    """
    if getattr(broker, "_scheduler_prepared", False):
        return
    with _PREPARING:
        if getattr(broker, "_scheduler_prepared", False):
            return
        if migrate:
            broker.apply_migrations(MIGRATIONS)
        else:
            current, head = broker.schema_revision(MIGRATIONS), schema.head(MIGRATIONS)
            if current != head:
                shown = broker.url.render_as_string(hide_password=True)
                raise SchemaNotCurrent(
                    f"{shown}: the scheduler's schema is "
                    + ("missing" if current is None else f"at revision {current}")
                    + f", this version needs {head}, and this connection does not migrate",
                    hint=f"run `scheduler-lib init --db URL` as the schema's owner role on {shown}",
                )
        broker.use_queries(QUERIES)
        broker._scheduler_prepared = True  # type: ignore[attr-defined]


_PREPARING = threading.Lock()  # see prepare()


def init(
    broker: Broker,
    names: Names = Names(),
    targets: Sequence[Target] = (Target(),),
    *,
    initiator_address: str | None = None,
) -> None:
    """Create whatever of the scheduler's catalog is missing and (re)write each target's
    settings. Idempotent: safe to run on every start.

    :param initiator_address: on a broker that hosts targets for initiators on another
        broker: ``tcp://host:port`` of that broker, for the route the answers take
    :raises InvalidArgument: for a target without kinds, or kinds given as one string
    """
    names = names or Names()
    if not targets:
        raise InvalidArgument("init needs at least one target service")
    for target in targets:
        if isinstance(target.kinds, str) or not target.kinds:
            raise InvalidArgument(
                f"target {target.service!r}: kinds must be a list of task kinds, "
                f"got {target.kinds!r}"
            )
        if (
            isinstance(target.retries, bool)
            or not isinstance(target.retries, int)
            or target.retries < 0
        ):
            raise InvalidArgument(
                f"target {target.service!r}: retries must be an integer >= 0, "
                f"got {target.retries!r}"
            )
        if not isinstance(target.durable_start, bool):
            raise InvalidArgument(
                f"target {target.service!r}: durable_start must be True or False, "
                f"got {target.durable_start!r}"
            )
        if not target.durable_start and target.retries == 0 and broker.dialect == "postgresql":
            # Allowed (a task that must not run twice may prefer a false failure), but
            # rarely meant: a crash that loses a lazy end reports the task FAILED.
            log.warning(
                "target %r: durable_start=False with retries=0: a database crash right "
                "after a task ends may report it FAILED (worker stopped without an answer) "
                "although it ran; give the target retries=1 or more to run it again instead",
                target.service,
            )
    prepare(broker)
    types = broker.message_types()
    for message_type in (names.sent, names.done):
        if message_type not in types:
            _tolerate_race(functools.partial(broker.create_message_type, message_type, "JSON"))
    try:
        broker.contract(names.contract)
    except ContractNotFound:
        _tolerate_race(
            functools.partial(
                broker.create_contract,
                names.contract,
                {names.sent: "INITIATOR", names.done: "TARGET"},
            )
        )
    queues = {q.name for q in broker.queues()}
    services = {s["service_name"] for s in broker.services()}
    if names.initiator_queue not in queues:
        _tolerate_race(functools.partial(broker.create_queue, names.initiator_queue))
    if names.initiator_service not in services:
        _tolerate_race(
            functools.partial(broker.create_service, names.initiator_service, names.initiator_queue)
        )
    if initiator_address is not None:
        _route(
            broker,
            f"scheduler initiator {names.initiator_service}",
            names.initiator_service,
            initiator_address,
        )
    for target in targets:
        if target.address is not None:
            if target.service in services:
                raise InvalidArgument(
                    f"target {target.service!r} has an address, but a service of that name "
                    "exists on this broker (a local service would take its messages)"
                )
            _route(broker, f"scheduler target {target.service}", target.service, target.address)
            _write_target(broker, target, queue="")
            continue
        settings: dict[str, Any] = {
            "activation_status": target.activation,
            "activation_procedure": target.procedure,
            "max_queue_readers": target.max_readers,
            # Errors are results: a task that raises answers AsyncDone, it never rolls
            # a receive back; silent failures are the lease's business.
            "poison_message_handling": False,
            "fair_share": FAIR_SHARE,
            # Executors take tasks under leases: the tasks of a wave (one conversation)
            # run side by side, so a wave of N gets N readers at once.
            "eager_activation": True,
        }
        if target.queue not in queues:
            _tolerate_race(functools.partial(broker.create_queue, target.queue, **settings))
        else:
            broker.alter_queue(target.queue, **settings)
        if target.service not in services:
            _tolerate_race(
                functools.partial(
                    broker.create_service, target.service, target.queue, [names.contract]
                )
            )
        elif names.contract not in broker.service(target.service)["contracts"]:
            broker.alter_service(target.service, add_contracts=[names.contract])
        broker.set_poison_policy(
            target.queue,
            PoisonPolicy(
                threshold=target.retries + 1,
                dispositions=(Notify(event=False, callback=LOST_TASK_CALLBACK),),
            ),
        )
        _write_target(broker, target, queue=target.queue)


def _write_target(broker: Broker, target: Target, queue: str) -> None:
    """A target's row: its queue ('' when on another broker) and the kinds it runs."""
    for attempt in range(3):  # another init may write the same row at the same time
        try:
            with broker.transaction() as tx:
                tx.run("target_delete", service=target.service)
                tx.run(
                    "target_insert",
                    service=target.service,
                    queue=queue,
                    kinds=",".join(dict.fromkeys(target.kinds)),
                    durable_start=target.durable_start,
                    now=time.time(),
                )
            return
        except AlreadyExists:
            if attempt == 2:
                raise


def _route(broker: Broker, name: str, service: str, address: str) -> None:
    """Create or update the route ``name`` (idempotent, as init is)."""
    if any(r.route_name == name for r in broker.routes()):
        broker.alter_route(name, service_name=service, address=address)
    else:
        _tolerate_race(functools.partial(broker.create_route, name, service, address))


def _tolerate_race(create: Callable[[], object]) -> None:
    """Create an object; another process creating it first is fine (init is idempotent)."""
    with contextlib.suppress(AlreadyExists):
        create()
