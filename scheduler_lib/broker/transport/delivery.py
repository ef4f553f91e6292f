"""The conversation protocol's database side: accepting what arrives from another broker
(exactly once, in order, whole) and keeping what goes out until it is acknowledged.

Everything here runs inside a broker transaction on the endpoint's database thread; the
network side (:mod:`.endpoint`) acknowledges a fragment only after the transaction that
stored it committed, so an acknowledged fragment is never lost, and a fragment that was
not acknowledged is sent again and recognised as a duplicate if it had in fact arrived.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.ops import endpoints, sending

if TYPE_CHECKING:
    from scheduler_lib.broker import broker as brokers

log = logging.getLogger(__name__)

SENDABLE = (
    models.EndpointState.STARTED_OUTBOUND,
    models.EndpointState.STARTED_INBOUND,
    models.EndpointState.CONVERSING,
)
CLOSED_RETENTION = 1800.0  # seconds a remote conversation's closed endpoint is kept
CACHE_TTL = 60.0  # seconds the catalog facts checked on arrival are trusted
INVALID_MESSAGE_CODE = checks.INVALID_MESSAGE_CODE  # "message failed validation"
# An outcome that is neither an acknowledgement nor a refusal: the sender tries again
# later (a conversation's later message before the one that creates its endpoint).
NOT_YET = "\x00not yet"


@dataclasses.dataclass(frozen=True)
class Fragment:
    """One fragment of a conversation message as it arrived (a small message is one)."""

    conversation_id: str
    from_initiator: bool  # which side sent it
    seq: int
    index: int
    count: int
    from_service: str
    to_service: str
    contract: str
    message_type: str
    body: bytes | None
    lifetime_expires_at: float | None = None

    @property
    def key(self) -> tuple[str, bool, int, int]:
        """What its acknowledgement names."""
        return (self.conversation_id, self.from_initiator, self.seq, self.index)


class Receiver:
    """Accepts arriving fragments into one broker's queues.

    Keeps two hints in memory, both safe to be stale in one direction only: the
    conversations that may have fragments waiting (a superset: an extra look costs one
    query), and the catalog facts it checks messages against (re-read on a miss).
    """

    def __init__(self, broker: brokers.Broker) -> None:
        self._broker = broker
        # This batch's endpoints, by (conversation id, side).
        self._endpoints: dict[tuple[str, bool], models.ConversationEndpoint] = {}
        self._waiting: set[tuple[str, bool]] = set()
        self._allowed: dict[tuple[str, str], models.SentBy] = {}  # (contract, type) -> sender
        self._validation: dict[str, models.Validation] = {}
        self._cache_read = time.monotonic()
        self._forget: set[tuple[str, bool]] = set()  # hints to drop at commit
        self.reload()

    def reload(self) -> None:
        """Read which conversations have fragments waiting (at start, after a failure)."""
        with self._broker.transaction() as tx:
            rows = tx.session.all("fragments_waiting")
        self._waiting = {(r["conversation_id"], bool(r["is_initiator"])) for r in rows}

    def accept_batch(self, fragments: Sequence[Fragment]) -> list[str | None]:
        """Store a batch in one transaction.

        :return: per fragment, ``None`` to acknowledge it (stored, or a duplicate of one
            stored before) or the reason it is refused (it is not acknowledged then)
        """
        if time.monotonic() - self._cache_read > CACHE_TTL:
            self._allowed.clear()
            self._validation.clear()
            self._cache_read = time.monotonic()
        self._forget = set()
        try:
            with self._broker.transaction() as tx:
                # Within one transaction the endpoints read stay true but for what this
                # batch changes itself, which _deliver keeps up to date.
                self._endpoints = {}
                tx.session.queue_cache = {}
                outcomes: list[str | None] = []
                i = 0
                while i < len(fragments):
                    run = self._run_at(fragments, i)
                    if run > 1 and self._accept_run(tx, fragments[i : i + run]):
                        outcomes += [None] * run
                        i += run
                    else:
                        outcomes.append(self._accept(tx, fragments[i]))
                        i += 1
        except Exception:
            self.reload()  # the hints may name what the rollback undid
            if len(fragments) == 1:
                raise
            # One fragment broke the batch: take them one by one so only it is refused.
            self.reload()
            log.warning("a batch of %d fragments failed; retrying one by one", len(fragments))
            outcomes = []
            for fragment in fragments:
                try:
                    outcomes.extend(self.accept_batch([fragment]))
                except Exception as exc:  # not stored: refused with the reason, sent again
                    outcomes.append(f"the receiving broker failed to store it: {exc}")
            return outcomes
        self._waiting -= self._forget  # only once the transaction that emptied them committed
        return outcomes

    # --- a run of messages in order ----------------------------------------------------

    @staticmethod
    def _run_at(fragments: Sequence[Fragment], start: int) -> int:
        """How many fragments from ``start`` are whole messages of one conversation, one
        after the other, none of them EndDialog / Error (the common case: a sender's
        backlog arriving in order)."""
        first = fragments[start]
        n = 0
        for f in fragments[start:]:
            if (
                f.count != 1
                or f.message_type in (models.END_DIALOG, models.ERROR)
                or f.conversation_id != first.conversation_id
                or f.from_initiator != first.from_initiator
                or f.seq != first.seq + n
            ):
                break
            n += 1
        return n

    def _accept_run(self, tx: brokers.Transaction, run: Sequence[Fragment]) -> bool:
        """Deliver a run of in-order messages with one UPDATE of the endpoint and one
        batch of INSERTs. ``False`` (nothing written) when any of them needs the one-by-
        one path: a new or ending conversation, a check that fails, a disabled queue."""
        first = run[0]
        endpoint = self._endpoint(tx, first.conversation_id, not first.from_initiator)
        if (
            endpoint is None
            or endpoint.state
            not in (models.EndpointState.STARTED_INBOUND, models.EndpointState.CONVERSING)
            or endpoint.receive_sequence != first.seq
        ):
            return False
        for f in run:
            if self._check_message(tx, endpoint, f) or self._check_body(f.message_type, f.body):
                return False
        queue_cache = tx.session.queue_cache if tx.session.queue_cache is not None else {}
        queue = queue_cache.get(endpoint.queue_name) or queue_cache.setdefault(
            endpoint.queue_name, endpoints.queue(tx.session, endpoint.queue_name)
        )
        if not queue.is_receive_enabled:
            return False
        handle = str(endpoint.conversation_handle)
        accepted = tx.session.one("endpoint_accept_run", handle=handle, seq=first.seq, n=len(run))
        if accepted is None:
            self._endpoints.pop((str(endpoint.conversation_id), endpoint.is_initiator), None)
            return False
        now = time.time()
        common = {
            "queue": endpoint.queue_name,
            "group_id": accepted["conversation_group_id"],
            "handle": handle,
            "priority": accepted["priority"],
            "service": accepted["service_name"],
            "contract": accepted["contract_name"],
            "now": now,
            "fair_at": 0.0,
        }
        tx.session.execute_many(
            "message_insert",
            [{**common, "seq": f.seq, "message_type": f.message_type, "body": f.body} for f in run],
        )
        tx.session.mark_written()
        tx.session.touched(endpoint.queue_name)
        tx.session.tally(counters.SENT, endpoint.queue_name, n=len(run))
        key = (str(endpoint.conversation_id), endpoint.is_initiator)
        self._endpoints[key] = dataclasses.replace(endpoint, receive_sequence=first.seq + len(run))
        self._drain(tx, first.conversation_id, first.from_initiator)
        return True

    def _check_body(self, message_type: str, body: bytes | None) -> str | None:
        """Why a whole message's body cannot be delivered, or ``None``."""
        validation = self._validation.get(message_type)
        if validation is not None:
            try:
                checks.check_body(message_type, validation, body)
            except exceptions.InvalidMessageBody as exc:
                return str(exc)
        if body is not None and len(body) > self._broker.max_message_size:
            return f"message of {len(body)} bytes exceeds this broker's limit"
        return None

    # --- one fragment ------------------------------------------------------------------

    def _accept(self, tx: brokers.Transaction, f: Fragment) -> str | None:
        endpoint = self._endpoint(tx, f.conversation_id, not f.from_initiator)
        if endpoint is None:
            if not f.from_initiator:
                # The initiator's endpoint is gone (ended WITH CLEANUP): nobody to give it.
                log.info("dropped a message for unknown conversation %s", f.conversation_id)
                return None
            refused = self._check_new_conversation(tx, f)
            if refused:
                return refused
            if f.seq != 0:
                # Only the first message opens a conversation; a later one may also be a
                # late copy from a conversation whose closed endpoint is long gone.
                return NOT_YET
            endpoint = self._create_target(tx, f)
        if endpoint.state is models.EndpointState.CLOSED or f.seq < endpoint.receive_sequence:
            return None  # a copy of something delivered before
        refused = self._check_message(tx, endpoint, f)
        if refused:
            return refused
        if f.count == 1 and f.seq == endpoint.receive_sequence:
            refused = self._deliver(tx, endpoint, f.seq, f.message_type, f.body)
            if refused:
                return refused
            if (f.conversation_id, f.from_initiator) in self._waiting:
                # A copy of it may be held from before (its acknowledgement was lost).
                tx.session.execute(
                    "fragments_delete_message",
                    conversation_id=f.conversation_id,
                    is_initiator=f.from_initiator,
                    seq=f.seq,
                )
        else:
            if f.count == 1:
                refused = self._check_body(f.message_type, f.body)
                if refused:
                    return refused
            tx.session.execute(
                "fragment_insert",
                conversation_id=f.conversation_id,
                is_initiator=f.from_initiator,
                seq=f.seq,
                fragment_index=f.index,
                fragment_count=f.count,
                message_type=f.message_type,
                body=f.body,
                now=time.time(),
            )
            tx.session.mark_written()
            key = (f.conversation_id, f.from_initiator)
            self._waiting.add(key)
            self._forget.discard(key)  # something waits again: keep the hint at commit
            if f.seq != endpoint.receive_sequence:
                return None  # held until its predecessors arrive
        self._drain(tx, f.conversation_id, f.from_initiator)
        return None

    def _drain(self, tx: brokers.Transaction, conversation_id: str, from_initiator: bool) -> None:
        """Deliver the messages waiting in fragments that are now whole and next in line."""
        key = (conversation_id, from_initiator)
        if key not in self._waiting:
            return
        while True:
            endpoint = self._endpoint(tx, conversation_id, not from_initiator)
            if endpoint is None or endpoint.state is models.EndpointState.CLOSED:
                self._forget.add(key)
                return
            seq = endpoint.receive_sequence
            parts = tx.session.all(
                "fragments_of_message",
                conversation_id=conversation_id,
                is_initiator=from_initiator,
                seq=seq,
            )
            if not parts:
                self._forget_if_empty(tx, key)
                return
            count = int(parts[0]["fragment_count"])
            indexes = [int(p["fragment_index"]) for p in parts]
            if indexes != list(range(count)) or any(
                int(p["fragment_count"]) != count for p in parts
            ):
                return  # not whole yet (or of two layouts: the complete one will come)
            body_parts = [p["message_body"] for p in parts]
            body = None if body_parts == [None] else b"".join(p or b"" for p in body_parts)
            tx.session.execute(
                "fragments_delete_message",
                conversation_id=conversation_id,
                is_initiator=from_initiator,
                seq=seq,
            )
            refused = self._deliver(tx, endpoint, seq, parts[0]["message_type_name"], body)
            if refused:
                # Acknowledged long ago, whole only now, and not acceptable here: the
                # conversation fails, as SQL Server's does (this side gets an Error).
                log.warning("conversation %s: %s", conversation_id, refused)
                error = json.dumps({"code": INVALID_MESSAGE_CODE, "description": refused})
                self._deliver(tx, endpoint, seq, models.ERROR, error.encode())

    def _forget_if_empty(self, tx: brokers.Transaction, key: tuple[str, bool]) -> None:
        # Whatever is still waiting for this conversation lies further ahead; the hint
        # stays while anything does, so the next arrival looks again.
        conversation_id, from_initiator = key
        if not tx.session.one(
            "fragments_any_of_conversation",
            conversation_id=conversation_id,
            is_initiator=from_initiator,
        ):
            self._forget.add(key)

    def _deliver(
        self,
        tx: brokers.Transaction,
        endpoint: models.ConversationEndpoint,
        seq: int,
        message_type: str,
        body: bytes | None,
    ) -> str | None:
        """Message ``seq`` is whole and next: put it on the queue (or act on it, for
        ``EndDialog`` / ``Error``) and move the endpoint's expected number on."""
        refused = self._check_body(message_type, body)
        if refused:
            return refused
        handle = str(endpoint.conversation_handle)
        accepted = tx.session.one("endpoint_accept", handle=handle, seq=seq)
        key = (str(endpoint.conversation_id), endpoint.is_initiator)
        if accepted is None:
            self._endpoints.pop(key, None)
            return None  # raced with another delivery of the same number: a duplicate
        tx.session.mark_written()
        state = models.EndpointState(accepted["state"])  # read under the row's lock, not before
        if (
            message_type in (models.END_DIALOG, models.ERROR)
            or state is models.EndpointState.STARTED_OUTBOUND
        ):
            self._endpoints.pop(key, None)  # its state changes below: read it again
        else:
            self._endpoints[key] = dataclasses.replace(endpoint, receive_sequence=seq + 1)
        if message_type in (models.END_DIALOG, models.ERROR):
            if state is models.EndpointState.DISCONNECTED_OUTBOUND:
                endpoints.close(
                    tx.session, endpoint
                )  # both sides have ended: this one was waiting for it
            elif state in SENDABLE:
                # An Error (the far side's END WITH ERROR, or one this broker makes for a
                # message it refuses) is received ahead of the conversation's messages
                # still queued, as on a local conversation; EndDialog keeps its place.
                at = seq if message_type == models.END_DIALOG else models.ERROR_SEQUENCE
                sending.enqueue(tx.session, accepted, handle, at, message_type, body)
                new = (
                    models.EndpointState.DISCONNECTED_INBOUND
                    if message_type == models.END_DIALOG
                    else models.EndpointState.ERROR
                )
                tx.session.execute("endpoint_set_state", handle=handle, state=new.value)
            return None
        if state in SENDABLE:
            sending.enqueue(tx.session, accepted, handle, seq, message_type, body)
            if state is models.EndpointState.STARTED_OUTBOUND:
                tx.session.execute(
                    "endpoint_set_state", handle=handle, state=models.EndpointState.CONVERSING.value
                )
        # else: this side has ended or failed; what the far side still sent is dropped.
        return None

    # --- checks and lookups ------------------------------------------------------------

    def _endpoint(
        self, tx: brokers.Transaction, conversation_id: str, is_initiator: bool
    ) -> models.ConversationEndpoint | None:
        cached = self._endpoints.get((conversation_id, is_initiator))
        if cached is not None:
            return cached
        row = tx.session.one(
            "endpoint_of_conversation", conversation_id=conversation_id, is_initiator=is_initiator
        )
        if row is None:
            return None
        endpoint = self._endpoints[(conversation_id, is_initiator)] = (
            models.ConversationEndpoint.from_row(row)
        )
        return endpoint

    @staticmethod
    def _check_new_conversation(tx: brokers.Transaction, f: Fragment) -> str | None:
        if tx.session.one("service_get", name=f.to_service) is None:
            return f"service {f.to_service!r} does not exist on this broker"
        if not tx.session.one("service_accepts", name=f.to_service, contract=f.contract):
            return f"service {f.to_service!r} does not accept contract {f.contract!r}"
        return None

    def _check_message(
        self, tx: brokers.Transaction, endpoint: models.ConversationEndpoint, f: Fragment
    ) -> str | None:
        if f.message_type in (models.END_DIALOG, models.ERROR):
            return None
        key = (endpoint.contract_name, f.message_type)
        if key not in self._allowed:
            self._load_contract(tx, endpoint.contract_name)
        sent_by = self._allowed.get(key)
        if sent_by is None:
            return (
                f"message type {f.message_type!r} is not part of contract "
                f"{endpoint.contract_name!r} on this broker"
            )
        side = models.SentBy.INITIATOR if f.from_initiator else models.SentBy.TARGET
        if sent_by not in (side, models.SentBy.ANY):
            return (
                f"contract {endpoint.contract_name!r} lets only the {sent_by.value} send "
                f"{f.message_type!r}"
            )
        return None

    def _load_contract(self, tx: brokers.Transaction, contract: str) -> None:
        for row in tx.session.all("contract_message_types", name=contract):
            self._allowed[(contract, row["message_type_name"])] = models.SentBy(row["sent_by"])
            if row["message_type_name"] not in self._validation:
                mt = tx.session.one("message_type_get", name=row["message_type_name"])
                if mt is not None:
                    self._validation[row["message_type_name"]] = models.Validation(mt["validation"])

    @staticmethod
    def _create_target(tx: brokers.Transaction, f: Fragment) -> models.ConversationEndpoint:
        """The target endpoint comes into being with the conversation's first message."""
        return endpoints.create_target(
            tx.session,
            conversation_id=f.conversation_id,
            service_name=f.to_service,
            far_service=f.from_service,
            contract=f.contract,
            lifetime_expires_at=f.lifetime_expires_at,
            is_remote=True,
        )


# --- the sending side's writes ---------------------------------------------------------


def acknowledged(broker: brokers.Broker, messages: Iterable[tuple[int, str, int]]) -> None:
    """The far broker has the messages — (id, sending handle, sequence number) — so
    they leave the transmission queue."""
    rows = [{"message_id": i, "handle": h, "seq": s} for i, h, s in messages]
    if rows:
        with broker.transaction() as tx:
            tx.session.execute_many("outgoing_delete", rows)
            tx.session.mark_written()


def set_statuses(
    broker: brokers.Broker, statuses: Iterable[tuple[int, str, int, str, int]]
) -> None:
    """Record messages' last transmission outcome: (id, sending handle, sequence number,
    status, attempts made since the last record)."""
    now = time.time()
    rows = [
        {"message_id": i, "handle": h, "seq": s, "status": status[:1024], "attempts": n, "now": now}
        for i, h, s, status, n in statuses
    ]
    if rows:
        with broker.transaction() as tx:
            tx.session.execute_many("outgoing_set_status", rows)
            tx.session.mark_written()


def record_events(
    broker: brokers.Broker, events: Sequence[tuple[float, str, str | None, str]]
) -> None:
    """Write transport events: (when, type, peer, detail)."""
    if events:
        rows = [
            {"now": when, "event_type": kind, "peer": peer, "detail": detail[:1024]}
            for when, kind, peer, detail in events
        ]
        with broker.transaction() as tx:
            tx.session.execute_many("transport_event_insert", rows)
            tx.session.mark_written()


def prune_events(broker: brokers.Broker, before: float, keep: int) -> int:
    """Remove transport events older than ``before`` and all but the newest ``keep``;
    how many went."""
    with broker.transaction() as tx:
        gone = tx.session.count("transport_events_prune_age", before=before)
        gone += tx.session.count("transport_events_prune_count", keep=keep)
        if gone > 0:
            tx.session.mark_written()
        return gone


def prune_closed(broker: brokers.Broker, now: float, retention: float = CLOSED_RETENTION) -> int:
    """Remove remote conversations' closed endpoints older than ``retention`` seconds."""
    with broker.transaction() as tx:
        rows = tx.session.all("endpoints_closed_before", before=now - retention, limit=1000)
        pruned = 0
        # The group lock first, as END takes it, in group id order; a group someone holds
        # is left for the next prune (this never waits).
        for row in sorted(rows, key=lambda r: str(r["conversation_group_id"])):
            if tx.session.one("group_try_lock", group_id=row["conversation_group_id"]) is None:
                continue
            tx.session.execute("endpoint_delete", handle=row["conversation_handle"])
            tx.session.execute("group_delete_if_empty", group_id=row["conversation_group_id"])
            pruned += 1
        if pruned > 0:
            tx.session.mark_written()
        return pruned


def write_connections(
    broker: brokers.Broker,
    endpoint_id: str,
    address: str | None,
    connections: Sequence[Any],
    now: float,
    stale_after: float,
) -> None:
    """Replace a running endpoint's rows of ``transport_connections`` (and remove the
    rows of endpoints that stopped writing ``stale_after`` seconds ago)."""
    import os
    import socket

    rows = [
        {
            "endpoint_id": endpoint_id,
            "connection_number": n,
            "endpoint_address": address,
            "host_name": socket.gethostname(),
            "process_id": os.getpid(),
            "now": now,
            **dataclasses.asdict(c),
        }
        for n, c in enumerate(connections)
    ]
    with broker.transaction() as tx:
        tx.session.execute("transport_connections_clear", endpoint_id=endpoint_id)
        tx.session.execute("transport_connections_stale", before=now - stale_after)
        if rows:
            tx.session.execute_many("transport_connection_insert", rows)
        tx.session.mark_written()


def load_outgoing(
    broker: brokers.Broker, query: str, limit: int, **params: Any
) -> list[dict[str, Any]]:
    """Outgoing messages (``outgoing_after`` past a cursor, or ``outgoing_upto``)."""
    with broker.transaction() as tx:
        return [dict(r) for r in tx.session.all(query, limit=limit, **params)]
