"""The transport endpoint: the broker's TCP listener and its connections to peers
(``CREATE ENDPOINT ... FOR SERVICE_BROKER``).

It runs an asyncio loop in a thread of its own, next to whatever else the process does:

- a **loader** thread reads outgoing messages from the transmission queue (woken when a
  transaction puts one there, on any process: NOTIFY on PostgreSQL, the data-version
  watcher on SQLite) and hands them to the loop with their route;
- per peer address a :class:`~.links.Link` schedules fragments and keeps one connection,
  dialled on demand and closed when idle — or adopted from the peer, when the peer dialled
  us and said it listens at that address;
- arriving fragments are stored in batches, one transaction per batch, by one database
  thread; each is acknowledged on the connection it came by once that transaction has
  committed — piggy-backed on the next outgoing frame there, or in an ACK frame alone;
- an acknowledged message leaves the transmission queue; one that is not acknowledged in
  time goes again, with exponential backoff;
- the loader looks up the route of every service with messages in flight again once its
  cached lookup is older than ``ROUTE_CACHE_TTL``: when it changed, the loop moves those
  messages to the new address's link (every fragment goes again), and when it is gone,
  stops sending them and lets them wait for a route.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import secrets
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import counters, exceptions
from scheduler_lib.broker.db import wakeup
from scheduler_lib.broker.ops import routes
from scheduler_lib.broker.transport import delivery, frames, links, reports

if TYPE_CHECKING:
    from scheduler_lib.broker import broker as brokers

log = logging.getLogger(__name__)

# 2: the handshake proves the key both ways (HELLO, WELCOME, CONFIRM); 3: frames are
# numbered per direction, each must be above the last accepted (frames.ReplayGuard)
PROTOCOL_VERSION = 3
RETRY_INITIAL = 2.5  # seconds before an unacknowledged message goes again (then doubling)
RETRY_MAX = 60.0  # seconds; the backoff's cap
FRAGMENT_SIZE = 64 * 1024  # bytes of body per fragment
IDLE_TIMEOUT = 90.0  # seconds without traffic before a connection is closed
CONNECT_TIMEOUT = 5.0  # seconds to open a connection and finish the handshake
DIAL_RETRY_FIRST = 0.2  # seconds before dialling again after a failure (then doubling)
WINDOW = 2000  # messages in flight per endpoint; the loader waits beyond it
LOAD_BATCH = 500  # messages read from the transmission queue at a time
RESCAN_INTERVAL = 2.0  # seconds; look behind the cursor for messages committed late
LOAD_POLL_INTERVAL = 0.5  # seconds; the loader looks even without a wakeup
STARVATION_AFTER = 10.0  # seconds a fragment waits before it goes regardless of priority
DELIVERY_BATCH = 500  # arriving fragments stored per transaction at most
ACKS_PER_FRAME = 500  # acknowledgements per frame (about 60 bytes each; headers < 64 KiB)
REJECTS_PER_FRAME = 100  # refusals per frame (reasons cut to REJECT_REASON_MAX characters)
REJECT_REASON_MAX = 300
INCOMING_MAX = 5000  # fragments waiting to be stored before readers stop reading
HANDSHAKE_MAX_BODY = 0  # a HELLO has no body: a large one is not a peer
ROUTE_CACHE_TTL = 1.0  # seconds a route lookup is trusted (a changed route applies after it)
TICK = 0.1  # seconds between looks for retransmissions and idle connections
PRUNE_INTERVAL = 60.0  # seconds between removals of old closed remote endpoints
CONNECTIONS_INTERVAL = 2.0  # seconds between writes of the connections view
CONNECTIONS_STALE = 30.0  # seconds after which a silent endpoint's rows are removed
WRITE_BUFFER_HIGH = 1024 * 1024  # bytes buffered on a socket before the writer waits
# Bytes the writer writes before it lets the loop run: a send that failed under TLS, or
# the peer's FIN, is known to the connection only once the loop has run its callbacks.
WRITE_SLICE = 16 * 1024
PING_AFTER = 1.0  # seconds of silence, while messages wait, before the peer is PINGed
PING_TIMEOUT = 5.0  # seconds a PING may wait for any frame back before the connection goes
MAX_CONNECTIONS = 64  # inbound connections at once (in their handshake or served)
MAX_HANDSHAKES = 16  # inbound connections still in their handshake at once
EVENTS_RETENTION = 7 * 24 * 3600.0  # seconds transport_events rows are kept
EVENTS_MAX = 100_000  # transport_events rows kept at most (the newest)


class TransportEndpoint:
    """A broker's endpoint for broker-to-broker messages.

    ::

        with TransportEndpoint(broker, key=secret, listen="127.0.0.1:4022"):
            ...  # messages to services with routes elsewhere go out; theirs come in

    :param broker: the broker (database) this endpoint serves
    :param key: the transport key shared by the brokers that talk to each other (16+
        bytes, or text); it signs every frame
    :param listen: ``host:port`` to accept connections on (port 0: any free port), or
        ``None`` to only dial out
    :param advertise: the address peers reach us at (``tcp://host:port``), told them in
        the handshake so they can send on our connection instead of dialling back;
        default the listening address
    :param server_ssl: TLS for accepted connections
    :param client_ssl: TLS for dialled connections
    :param retry_initial: seconds before an unacknowledged message is sent again
    :param retry_max: the cap of the doubling backoff, in seconds
    :param fragment_size: bytes of body per fragment
    :param idle_timeout: seconds without traffic before a connection is closed
    :param window: messages in flight at most
    :param max_connections: inbound connections at once; more are closed as they come
    :param max_handshakes: inbound connections still in their handshake at once (what a
        stranger without the key can hold open); a newer one closes the oldest
    :param events_retention: seconds a ``transport_events`` row is kept
    :param events_max: ``transport_events`` rows kept at most (the newest)
    """

    def __init__(
        self,
        broker: brokers.Broker,
        *,
        key: bytes | str,
        listen: str | None = f"127.0.0.1:{routes.DEFAULT_PORT}",
        advertise: str | None = None,
        server_ssl: ssl.SSLContext | None = None,
        client_ssl: ssl.SSLContext | None = None,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        fragment_size: int = FRAGMENT_SIZE,
        idle_timeout: float = IDLE_TIMEOUT,
        window: int = WINDOW,
        max_connections: int = MAX_CONNECTIONS,
        max_handshakes: int = MAX_HANDSHAKES,
        events_retention: float = EVENTS_RETENTION,
        events_max: int = EVENTS_MAX,
    ) -> None:
        self._broker = broker
        self._key = _transport_key(key)
        self._listen = None if listen is None else _host_port(listen, "listen")
        if advertise is not None:
            routes.parse_address(advertise)
        self._advertise = advertise
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        for name, value in (
            ("retry_initial", retry_initial),
            ("retry_max", retry_max),
            ("idle_timeout", idle_timeout),
            ("events_retention", events_retention),
        ):
            _check_seconds(name, value)
        for name, count in (
            ("window", window),
            ("max_connections", max_connections),
            ("max_handshakes", max_handshakes),
            ("events_max", events_max),
        ):
            _check_count(name, count)
        if retry_max < retry_initial:
            raise exceptions.InvalidArgument("retry_max must not be below retry_initial")
        if (
            isinstance(fragment_size, bool)
            or not isinstance(fragment_size, int)
            or fragment_size < 1024
        ):
            raise exceptions.InvalidArgument(
                f"fragment_size must be an integer of at least 1024 bytes, got {fragment_size!r}"
            )
        if retry_initial < TICK:
            raise exceptions.InvalidArgument(
                f"retry_initial must be at least {TICK:g} seconds (the housekeeping tick), "
                f"got {retry_initial!r}"
            )
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.fragment_size = min(fragment_size, frames.MAX_BODY)
        self.idle_timeout = idle_timeout
        self.window = window
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.events_retention = events_retention
        self.events_max = events_max
        self.broker_instance = broker.broker_instance
        self.address: str | None = None  # tcp://host:port once listening
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loader: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopping = threading.Event()
        self._stop_async: asyncio.Event | None = None
        self._db = concurrent.futures.ThreadPoolExecutor(1, "transport-deliver")
        self._writes = concurrent.futures.ThreadPoolExecutor(1, "transport-writes")
        self._receiver = delivery.Receiver(broker)
        # Loop state (touched only on the loop's thread).
        self._links: dict[str, links.Link] = {}
        self._connections: set[links.Connection] = set()
        self._by_key: dict[tuple[str, bool, int], links.Outgoing] = {}
        self._incoming: asyncio.Queue[tuple[delivery.Fragment, links.Connection]] | None = None
        self._acked: list[tuple[int, str, int]] = []  # (id, handle, seq) to delete
        self._statuses: dict[int, tuple[str, int]] = {}  # id -> (status, attempts)
        self._dirty_statuses: set[int] = set()  # statuses not written yet
        self._inflight: dict[int, links.Outgoing] = {}
        self._events: list[tuple[float, str, str | None, str]] = []
        self._reports = reports.Reports(lambda *event: self._events.append(event))
        self._inbound = 0  # inbound connections open (in their handshake or served)
        # Inbound connections in their handshake, oldest first -> their peer
        self._handshakes: dict[asyncio.StreamWriter, str] = {}
        # TLS listener: connections before their TLS handshake is done, oldest first
        self._peeking: dict[str, asyncio.Task[None]] = {}
        self._accepting: set[asyncio.Task[None]] = set()
        self._released: list[tuple[int, str, int, str, int]] = []  # statuses of unrouted ones
        self._honor_priority = False
        # Shared with the loader thread.
        self._known_lock = threading.Lock()
        self._known: set[int] = set()  # in flight or being deleted: the loader skips them
        self._written_status: dict[int, str] = {}  # loader: last status it wrote per id
        self._route_cache: dict[str, tuple[float, routes.Route | None]] = {}
        self._unrouted: set[int] = set()  # loader: ids waiting for a route
        # loader: (address, broker instance) each service's messages went to the loop with
        self._handed_routes: dict[str, tuple[str, str | None]] = {}
        self._endpoint_id = str(uuid.uuid4())  # this running endpoint, in the connections view
        self._connections_written_at = 0.0
        self._connections_shown = False

    # --- lifecycle (any thread) ----------------------------------------------------------

    def start(self) -> TransportEndpoint:
        """Start listening and sending; returns once the listener is bound.

        :raises BrokerError: when it cannot listen (the address is in use, ...)
        """
        self._thread = threading.Thread(target=self._run, name="transport-endpoint", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise exceptions.BrokerError(
                f"transport endpoint cannot start: {self._startup_error}"
            ) from self._startup_error
        self._loader = threading.Thread(target=self._load_loop, name="transport-load", daemon=True)
        self._loader.start()
        return self

    def stop(self) -> None:
        """Close every connection and stop. Unacknowledged messages stay in the
        transmission queue for the next start."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._broker.waiting.wakeups.notify({wakeup.TRANSMISSION})
        if self._loop is not None and self._stop_async is not None:
            self._loop.call_soon_threadsafe(self._stop_async.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._loader is not None:
            self._loader.join(timeout=10)
        self._db.shutdown(wait=True)
        self._writes.shutdown(wait=True)

    def __enter__(self) -> TransportEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connections(self) -> list[links.ConnectionInfo]:
        """The open connections (``sys.dm_broker_connections``)."""
        if self._loop is None or self._stopping.is_set():
            return []
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        return future.result(timeout=5)

    async def _snapshot(self) -> list[links.ConnectionInfo]:
        return [c.info() for c in sorted(self._connections, key=lambda c: c.opened_at)]

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by start() when it happens before ready
            if not self._ready.is_set():
                self._startup_error = exc
                self._ready.set()
            else:
                log.exception("transport endpoint stopped by an error")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_async = asyncio.Event()
        self._incoming = asyncio.Queue(INCOMING_MAX)
        server: asyncio.Server | None = None
        listener: socket.socket | None = None
        tasks = []
        if self._listen is not None and self._server_ssl is None:
            host, port = self._listen
            server = await asyncio.start_server(self._on_inbound, host, port)
            bound = server.sockets[0].getsockname()
            self.address = f"tcp://{host}:{bound[1]}"
        elif self._listen is not None:
            # TLS: accepted here, so that what comes first can be looked at before the TLS
            # handshake (asyncio's own TLS server drops a failed one without a word).
            host, port = self._listen
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.create_server((host, port), family=family)
            listener.setblocking(False)
            self.address = f"tcp://{host}:{listener.getsockname()[1]}"
            tasks.append(asyncio.create_task(self._accept_loop(listener), name="transport-accept"))
        tasks += [
            asyncio.create_task(self._deliver_loop(), name="transport-deliver"),
            asyncio.create_task(self._tick_loop(), name="transport-tick"),
        ]
        self._ready.set()
        log.info(
            "transport endpoint of broker %s listening at %s", self.broker_instance, self.address
        )
        try:
            await self._stop_async.wait()
        finally:
            if server is not None:
                server.close()
            if listener is not None:
                listener.close()
            for conn in list(self._connections):
                await self._close(conn, "endpoint stopping")
            for task in tasks:
                task.cancel()
            for link in self._links.values():
                if link.dialing is not None:
                    link.dialing.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._reports.flush(time.time(), force=True)
            await self._flush_writes()
            with contextlib.suppress(Exception):  # the view must not outlive us
                await self._write_connections(time.time() + CONNECTIONS_INTERVAL)

    # --- the loader thread -------------------------------------------------------------

    def _load_loop(self) -> None:
        broker = self._broker
        broker.waiting.hear_other_processes()  # their sends wake the loader too
        cursor, last_rescan = 0, 0.0
        while not self._stopping.is_set():
            seen = broker.waiting.wakeups.generation(wakeup.TRANSMISSION)
            try:
                self._follow_routes()
                read, cursor, last_rescan = self._load_once(cursor, last_rescan)
            except Exception:  # the loader must outlive a passing database error
                _database_failed("reading the transmission queue")
                read = 0
            if read >= LOAD_BATCH:
                continue  # more are waiting past the cursor
            broker.waiting.wakeups.wait(wakeup.TRANSMISSION, seen, LOAD_POLL_INTERVAL)

    def _load_once(self, cursor: int, last_rescan: float) -> tuple[int, int, float]:
        """Read what is new past the cursor (and, every ``RESCAN_INTERVAL``, what is
        behind it) and hand the routed messages to the loop. Returns how many rows were
        read past the cursor, the new cursor and the time of the last rescan."""
        with self._known_lock:
            room = self.window - len(self._known)
            if not self._known and not self._unrouted:
                # Nothing held: read from the start. SQLite reuses the ids of deleted
                # rows, so a new message may sit below the cursor.
                cursor = 0
        if room <= 0:
            return 0, cursor, last_rescan
        rows = delivery.load_outgoing(
            self._broker, "outgoing_after", min(LOAD_BATCH, room), after=cursor
        )
        read = len(rows)
        if rows:
            cursor = max(cursor, max(r["message_id"] for r in rows))
        now = time.monotonic()
        if now - last_rescan >= RESCAN_INTERVAL:
            last_rescan = now
            rows += self._rescan(cursor, {r["message_id"] for r in rows})
            self._honor_priority = bool(self._broker.honor_broker_priority())
        routed: list[tuple[dict[str, Any], routes.Route]] = []
        unrouted: list[tuple[int, str, int, str, int]] = []
        # One lookup per service and batch: were the route to change between two, the
        # loop would move the messages handed before the change (none of this batch's:
        # they go to it after the move) and the batch would go both ways, its early
        # messages to the old route for good.
        batch_routes: dict[str, routes.Route | None] = {}
        for row in rows:
            service = row["to_service_name"]
            if service not in batch_routes:
                batch_routes[service] = self._route(service)
                self._hand_route(service, batch_routes[service])
            route = batch_routes[service]
            if route is None:
                self._unrouted.add(row["message_id"])
                status = _no_route(row["to_service_name"])
                if self._written_status.get(row["message_id"]) != status:
                    self._written_status[row["message_id"]] = status
                    unrouted.append(
                        (
                            row["message_id"],
                            row["conversation_handle"],
                            row["message_sequence_number"],
                            status,
                            0,
                        )
                    )
            else:
                self._unrouted.discard(row["message_id"])
                self._written_status.pop(row["message_id"], None)  # the loop says from now
                routed.append((row, route))
        if unrouted:
            delivery.set_statuses(self._broker, unrouted)
        if routed and self._loop is not None:
            with self._known_lock:
                self._known.update(row["message_id"] for row, _ in routed)
            self._loop.call_soon_threadsafe(self._on_loaded, routed)
        return read, cursor, last_rescan

    def _rescan(self, cursor: int, just_read: set[int]) -> list[dict[str, Any]]:
        """Look behind the cursor: a transaction that took an id below it may have
        committed after we read past it (PostgreSQL), and messages without a route wait
        there. When the look covers everything, the loop also forgets what it holds
        that is gone (a conversation cleaned up meanwhile)."""
        with self._known_lock:
            known = set(self._known)
        limit = len(known) + len(self._unrouted) + LOAD_BATCH
        present = delivery.load_outgoing(self._broker, "outgoing_present", limit, upto=cursor)
        if len(present) < limit and self._loop is not None:
            keys = {
                (r["message_id"], r["conversation_handle"], r["message_sequence_number"])
                for r in present
            }
            self._loop.call_soon_threadsafe(self._forget_missing, keys, cursor)
            self._unrouted &= {r["message_id"] for r in present}
        behind = [
            r["message_id"]
            for r in present
            if r["message_id"] not in known and r["message_id"] not in just_read
        ]
        if not behind:
            return []
        late = delivery.load_outgoing(self._broker, "outgoing_upto", limit, upto=cursor)
        wanted = set(behind)
        return [r for r in late if r["message_id"] in wanted]

    def _route(self, service: str) -> routes.Route | None:
        now = time.monotonic()
        cached = self._route_cache.get(service)
        if cached is not None and now - cached[0] < ROUTE_CACHE_TTL:
            return cached[1]
        with self._broker.transaction() as tx:
            route = routes.remote_route(tx.session, service)
        self._route_cache[service] = (now, route)
        return route

    def _follow_routes(self) -> None:
        """Look up the route of every service whose messages are in flight again (each
        at most once per ``ROUTE_CACHE_TTL``): the loop moves them when it changed."""
        with self._known_lock:
            if not self._known:
                self._handed_routes.clear()  # nothing in flight that a change could move
                return
        for service in list(self._handed_routes):
            self._hand_route(service, self._route(service))

    def _hand_route(self, service: str, route: routes.Route | None) -> None:
        """Note the route ``service``'s messages go to the loop with; when it is another
        than the one those in flight got (or none), have the loop move them."""
        previous = self._handed_routes.get(service)
        way = None if route is None else (route.address, route.broker_instance)
        if way == previous:
            return
        if way is None:
            del self._handed_routes[service]
        else:
            self._handed_routes[service] = way
        if previous is not None and self._loop is not None:
            # Queued behind the messages handed before: the loop moves those too.
            self._loop.call_soon_threadsafe(self._reroute, service, route)

    # --- sending (loop thread) ---------------------------------------------------------

    def _on_loaded(self, routed: list[tuple[dict[str, Any], routes.Route]]) -> None:
        now = time.time()
        for row, route in routed:
            if row["message_id"] in self._inflight:
                continue
            body = row["message_body"]
            if body is None:
                parts: list[bytes | None] = [None]
            else:
                body = bytes(body)
                size = self.fragment_size
                parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
            message = links.Outgoing(
                message_id=row["message_id"],
                handle=row["conversation_handle"],
                conversation_id=row["conversation_id"],
                from_initiator=bool(row["is_initiator"]),
                seq=int(row["message_sequence_number"]),
                priority=int(row["priority"]),
                enqueued_at=float(row["enqueued_at"]),
                address=route.address,
                header={
                    "c": row["conversation_id"],
                    "i": int(bool(row["is_initiator"])),
                    "s": int(row["message_sequence_number"]),
                    "n": len(parts),
                    "fs": row["from_service_name"],
                    "ts": row["to_service_name"],
                    "ct": row["service_contract_name"],
                    "mt": row["message_type_name"],
                    "lt": row["lifetime_expires_at"],
                },
                fragments=parts,
                backoff=self.retry_initial,
            )
            link = self._link(route)
            link.messages[message.message_id] = message
            self._by_key[message.key] = message
            self._inflight[message.message_id] = message
            if link.connection is not None:
                link.start_round(message, now)
                link.connection.wake.set()
            else:
                self._connect(link)

    def _forget_missing(self, present: set[tuple[int, str, int]], cursor: int) -> None:
        """Drop what is in flight up to ``cursor`` but no longer in the transmission
        queue (its conversation was cleaned up, or its id reused by another message)."""
        gone = [
            m
            for m in self._inflight.values()
            if m.message_id <= cursor and (m.message_id, m.handle, m.seq) not in present
        ]
        for message in gone:
            self._drop(message)
        if gone:
            with self._known_lock:
                self._known.difference_update(m.message_id for m in gone)

    def _drop(self, message: links.Outgoing) -> None:
        """Forget a message in flight (acknowledged, gone from the database, or its route
        dropped)."""
        self._by_key.pop(message.key, None)
        self._inflight.pop(message.message_id, None)
        self._statuses.pop(message.message_id, None)
        link = self._links.get(message.address)
        if link is not None:
            link.remove(message)

    def _reroute(self, service: str, route: routes.Route | None) -> None:
        """``service``'s route changed: its messages in flight go the new way from now on
        (each from its first fragment: the new address has none of them; the receiver
        drops a copy it has), or, with no route left, stop going anywhere and wait in
        the transmission queue until the loader finds one."""
        now = time.time()
        left: set[links.Link] = set()
        released: list[links.Outgoing] = []
        for message in [m for m in self._inflight.values() if m.to_service == service]:
            old = self._links.get(message.address)
            if route is not None and message.address == route.address:
                continue
            if old is not None:
                left.add(old)
            if route is None:
                counted = self._statuses.get(message.message_id, ("", 0))[1]
                self._drop(message)
                released.append(message)
                status = (message.message_id, message.handle, message.seq, _no_route(service))
                self._released.append((*status, counted))
                continue
            if old is not None:
                old.remove(message)
            message.address = route.address
            message.acked.clear()  # acknowledged by the old address: says nothing here
            message.pending = []
            message.due = None
            message.rejected = None
            message.backoff = self.retry_initial
            link = self._link(route)
            link.messages[message.message_id] = message
            self._status(message, f"route changed: sending to {route.address}", 0)
            if link.connection is not None:
                link.start_round(message, now)
                link.connection.wake.set()
            else:
                self._connect(link)
        if route is not None and route.address in self._links:
            # The way is another broker instance at the same address, or none.
            self._expect(self._links[route.address], route.broker_instance)
        for link in left:
            if not link.has_work() and link.dialing is not None:
                link.dialing.cancel()  # nothing to send there: no more attempts
                link.dialing = None
        if released:
            log.info(
                "transport: no route to service %r any more: %d messages wait for one",
                service,
                len(released),
            )
            with self._known_lock:  # the loader reads them again, and routes them anew
                self._known.difference_update(m.message_id for m in released)

    def _link(self, route: routes.Route) -> links.Link:
        link = self._links.get(route.address)
        if link is None:
            link = self._links[route.address] = links.Link(route.address, route.broker_instance)
        elif route.broker_instance is not None:
            self._expect(link, route.broker_instance)
        return link

    def _expect(self, link: links.Link, instance: str | None) -> None:
        """From now on the link sends only to broker ``instance`` (any, with ``None``): a
        connection to another broker stops carrying its messages (it stays open for what
        that broker sends us), and the next connection is checked in its handshake."""
        link.expected_instance = instance
        conn = link.connection
        if conn is not None and not self._acceptable(link, conn):
            log.info(
                "transport: broker %s at %s is not the route's broker instance %s any more",
                conn.peer_broker,
                link.address,
                instance,
            )
            link.connection = None
            conn.link = None
            if link.has_work():
                self._connect(link)

    def _connect(self, link: links.Link) -> None:
        """Give the link a connection: adopt one the peer dialled, else dial."""
        if link.connection is not None or link.dialing is not None or self._stopping.is_set():
            return
        for conn in self._connections:
            if (
                conn.peer_address == link.address
                and not conn.closed
                and self._acceptable(link, conn)
            ):
                self._attach(link, conn)
                return
        link.dialing = asyncio.create_task(self._dial(link), name=f"dial {link.address}")

    def _acceptable(self, link: links.Link, conn: links.Connection) -> bool:
        return link.expected_instance is None or link.expected_instance == conn.peer_broker

    def _attach(self, link: links.Link, conn: links.Connection) -> None:
        link.connection = conn
        link.last_error = None
        conn.link = link
        now = time.time()
        for message in link.messages.values():
            if not message.pending:  # written into a connection that may be gone: again
                message.backoff = self.retry_initial
                link.start_round(message, now)
        conn.wake.set()

    async def _dial(self, link: links.Link) -> None:
        delay = DIAL_RETRY_FIRST
        try:
            while link.has_work() and not self._stopping.is_set():
                waiting_for = ["connection", ""]  # what the dial waits for, a hint (_open's)
                try:
                    conn = await asyncio.wait_for(self._open(link, waiting_for), CONNECT_TIMEOUT)
                except Exception as exc:
                    why = (
                        f"no {waiting_for[0]} within {CONNECT_TIMEOUT:g} s{waiting_for[1]}"
                        if isinstance(exc, asyncio.TimeoutError)  # "TimeoutError: TimeoutError"
                        else _describe(exc)
                    )
                    error = f"cannot connect to {link.address}: {why}"
                    if error != link.last_error:
                        log.warning("transport: %s", error)
                        if isinstance(exc, HandshakeRefused):
                            self._event("CONNECTION_REJECTED", link.address, str(exc), None)
                    link.last_error = error
                    for message in link.messages.values():
                        self._status(message, error, 0)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.retry_initial)
                    continue
                if conn.closed:
                    # It ended between the handshake and now (the far side refused our
                    # CONFIRM, or a cut): a link holding it would wait on it for good.
                    link.last_error = f"cannot connect to {link.address}: closed at once"
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.retry_initial)
                    continue
                link.dialing = None
                self._attach(link, conn)
                return
        finally:
            if link.dialing is asyncio.current_task():
                link.dialing = None

    async def _open(self, link: links.Link, waiting_for: list[str]) -> links.Connection:
        """Dial ``link``'s address and run the dialler's side of the handshake
        (frames.py): nothing but the HELLO is written before the far side has proved
        that it holds the transport key. ``waiting_for`` is kept at what it waits for
        and a hint, for the caller's message if its deadline passes."""
        host, port = routes.parse_address(link.address)
        waiting_for[:] = (
            ["connection", " (is anything listening there?)"]
            if self._client_ssl is None
            else ["connection and TLS handshake", " (is anything listening there, with TLS?)"]
        )
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=self._client_ssl)
        except (ssl.SSLError, ConnectionResetError, asyncio.IncompleteReadError) as exc:
            if self._client_ssl is None:
                raise
            raise HandshakeRefused(
                f"the TLS handshake failed ({_describe(exc)}): does the peer use TLS too, "
                "with a certificate our CA signed?"
            ) from None
        try:
            nonce = secrets.token_hex(frames.NONCE_BYTES)
            hello = {
                "v": PROTOCOL_VERSION,
                "broker": self.broker_instance,
                "nonce": nonce,
                "listen": self._advertise or self.address,
            }
            writer.write(frames.encode(frames.Kind.HELLO, hello, None, self._key))
            waiting_for[:] = [
                "WELCOME",
                ": the peer took the connection and did not answer our HELLO (is it a "
                "scheduler_lib broker's endpoint?)",
            ]
            try:
                welcome = await frames.read(reader, self._key, max_body=HANDSHAKE_MAX_BODY)
            except frames.CorruptFrame:
                raise HandshakeRefused(
                    "the peer's WELCOME does not verify: the two brokers have different "
                    "transport keys"
                ) from None
            except frames.GarbageFrame as exc:
                raise HandshakeRefused(f"the peer answered with {exc}") from None
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                partial = getattr(exc, "partial", b"")
                if partial[:2] in frames.TLS_RECORDS:  # a TLS endpoint's alert
                    raise HandshakeRefused(
                        "the peer uses TLS and this side does not (give both endpoints TLS, "
                        "--tls-cert/--tls-key/--tls-ca, or neither)"
                    ) from None
                raise ConnectionError(_closed_in_handshake(exc, self._client_ssl)) from None
            header = welcome.header
            if welcome.kind is not frames.Kind.WELCOME:
                raise HandshakeRefused(f"expected WELCOME, got {welcome.kind.name}")
            if header.get("v") != PROTOCOL_VERSION:
                raise HandshakeRefused(_other_version(header.get("v")))
            peer_broker = header.get("broker")
            if not isinstance(peer_broker, str) or not isinstance(header.get("nonce"), str):
                raise HandshakeRefused("a WELCOME without broker id or nonce")
            try:
                keys = frames.handshake_keys(
                    self._key, nonce, header["nonce"], self.broker_instance, peer_broker
                )
            except ValueError as exc:
                raise HandshakeRefused(f"a WELCOME with a malformed nonce: {exc}") from None
            if not frames.proof_holds(header.get("proof"), keys.welcome_proof):
                raise HandshakeRefused(
                    "the peer did not prove it holds the transport key for this connection "
                    "(a replayed or forged WELCOME): nothing was sent to it"
                )
            if peer_broker == self.broker_instance:
                raise HandshakeRefused(
                    f"{link.address} is this broker itself (a route that leads back here)"
                )
            if link.expected_instance not in (None, peer_broker):
                raise ConnectionError(
                    f"broker {peer_broker} answers at {link.address}, but the route names "
                    f"broker instance {link.expected_instance}"
                )
            confirm = {"proof": keys.confirm_proof, frames.NUMBER: 0}
            writer.write(frames.encode(frames.Kind.CONFIRM, confirm, None, keys.send_out))
        except BaseException:
            writer.close()
            raise
        conn = links.Connection(
            reader,
            writer,
            direction="outbound",
            peer_broker=peer_broker,
            peer_address=link.address,
            send_key=keys.send_out,
            receive_key=keys.send_in,
        )
        self._serve(conn)
        return conn

    # --- accepting (loop thread) -------------------------------------------------------

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept TLS connections: each is looked at (:meth:`_accepted`), then served."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, ...: not the end of serving
                log.warning("transport: accepting a connection failed: %s", _describe(exc))
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted(sock), name="transport-accepted")
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def _accepted(self, sock: socket.socket) -> None:
        """A connection to the TLS listener: a peer that does not start with TLS is named
        as such (it dials without TLS), a TLS handshake that fails is recorded with its
        reason, and the rest is served as any connection. Until its TLS handshake is done
        it holds one of ``max_handshakes`` places (a newer one cancels the oldest) and
        has :data:`CONNECT_TIMEOUT` for both steps."""
        try:
            host, port = sock.getpeername()[:2]
        except OSError:
            sock.close()
            return
        peer = f"{host}:{port}"
        if len(self._peeking) >= self.max_handshakes:
            # Cancelled, not closed under it: its reader must leave the selector while
            # its descriptor is still its own (a closed one is soon another socket's).
            oldest = next(iter(self._peeking))
            self._peeking.pop(oldest).cancel()
        task = asyncio.current_task()
        assert task is not None
        key = f"{peer}#{id(task)}"
        self._peeking[key] = task
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        reason: str | None = None
        transport: asyncio.Transport | None = None
        try:
            first = await asyncio.wait_for(_first_bytes(sock), CONNECT_TIMEOUT)
            if first and first[:2] in frames.TLS_RECORDS:
                transport, _ = await asyncio.wait_for(
                    loop.connect_accepted_socket(lambda: protocol, sock, ssl=self._server_ssl),
                    CONNECT_TIMEOUT,
                )
            elif first:
                reason = (
                    "a plain connection to a TLS endpoint (the peer dials without TLS: "
                    "give it --tls-cert/--tls-key/--tls-ca too)"
                )
                with contextlib.suppress(OSError):  # said in TLS's words, which diallers know
                    sock.recv(65536)  # unread bytes would turn the close into a reset
                    sock.send(TLS_ALERT)
        except asyncio.CancelledError:
            reason = f"still in its handshake when {self.max_handshakes} newer ones came"
            if self._stopping.is_set():
                reason = None
        except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
            reason = f"no TLS handshake within {CONNECT_TIMEOUT:g} s"
        except (ssl.SSLError, OSError) as exc:
            reason = f"its TLS handshake failed: {_describe(exc)}"
        finally:
            self._peeking.pop(key, None)
        if transport is None:
            sock.close()
            if reason is not None:
                line = f"transport: rejected a connection from {peer}: {reason}"
                self._event("CONNECTION_REJECTED", peer, reason, line)
            return
        await self._on_inbound(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def _on_inbound(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The acceptor's side of the handshake (frames.py): a connection is served once
        the dialler has answered this connection's fresh nonce with its proof, within
        :data:`CONNECT_TIMEOUT` of its opening."""
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        if self._inbound >= self.max_connections and not self._handshakes:
            reason = f"too many connections ({self._inbound} open, the limit)"
            self._reject_connection(writer, peer, reason)
            return
        if len(self._handshakes) >= self.max_handshakes or self._inbound >= self.max_connections:
            # The oldest goes, not the newcomer: a peer with the key finishes its handshake
            # in two round trips, so strangers who hold every place (they cannot finish)
            # keep nobody out for longer than it takes to open that many connections.
            oldest, who = next(iter(self._handshakes.items()))
            del self._handshakes[oldest]
            reason = f"still in its handshake when {self.max_handshakes} newer ones came"
            self._reject_connection(oldest, who, reason)
        self._inbound += 1
        try:
            served = await self._handshake_inbound(reader, writer, peer)
        except BaseException:
            self._inbound -= 1
            raise
        if not served:
            self._inbound -= 1

    async def _handshake_inbound(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> bool:
        """The acceptor's handshake of one connection; whether it is served now."""
        step = "its HELLO"

        async def handshake() -> tuple[str, Any, frames.HandshakeKeys]:
            nonlocal step
            hello = await frames.read(reader, self._key, max_body=HANDSHAKE_MAX_BODY)
            header = hello.header
            if hello.kind is not frames.Kind.HELLO:
                raise frames.GarbageFrame(f"expected HELLO, got {hello.kind.name}")
            if header.get("v") != PROTOCOL_VERSION:
                raise frames.GarbageFrame(_other_version(header.get("v")))
            peer_broker, listen = header.get("broker"), header.get("listen")
            if not isinstance(header.get("nonce"), str) or not isinstance(peer_broker, str):
                raise frames.GarbageFrame("HELLO without broker id or nonce")
            nonce = secrets.token_hex(frames.NONCE_BYTES)
            try:
                keys = frames.handshake_keys(
                    self._key, header["nonce"], nonce, peer_broker, self.broker_instance
                )
            except ValueError as exc:
                raise frames.GarbageFrame(f"HELLO with a malformed nonce: {exc}") from None
            welcome = {
                "v": PROTOCOL_VERSION,
                "broker": self.broker_instance,
                "nonce": nonce,
                "proof": keys.welcome_proof,
            }
            writer.write(frames.encode(frames.Kind.WELCOME, welcome, None, self._key))
            step = "its CONFIRM"
            confirm = await frames.read(reader, keys.send_out, max_body=HANDSHAKE_MAX_BODY)
            if (
                confirm.kind is not frames.Kind.CONFIRM
                or not frames.proof_holds(confirm.header.get("proof"), keys.confirm_proof)
                or not _is_zero(confirm.header.get(frames.NUMBER))
            ):
                raise frames.CorruptFrame(confirm.kind, 0)
            return peer_broker, listen, keys

        self._handshakes[writer] = peer
        try:
            peer_broker, listen, keys = await asyncio.wait_for(handshake(), CONNECT_TIMEOUT)
        except frames.CorruptFrame:
            reason = (
                "its HELLO does not verify (wrong transport key?)"
                if step == "its HELLO"
                else "it did not prove it holds the transport key (a replayed HELLO?)"
            )
            self._reject_connection(writer, peer, reason)
            return False
        except frames.GarbageFrame as exc:
            self._reject_connection(writer, peer, f"garbage instead of {step}: {exc}")
            return False
        except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
            self._reject_connection(
                writer, peer, f"no {step.removeprefix('its ')} within {CONNECT_TIMEOUT:g} s"
            )
            return False
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug(  # strangers do this by the thousand: not for the log
                "transport: connection from %s ended before %s (%s)", peer, step, _describe(exc)
            )
            writer.close()
            return False
        finally:
            self._handshakes.pop(writer, None)
        conn = links.Connection(
            reader,
            writer,
            direction="inbound",
            peer_broker=peer_broker,
            peer_address=listen if isinstance(listen, str) else None,
            send_key=keys.send_in,
            receive_key=keys.send_out,
        )
        self._serve(conn)
        self._adopt(conn)
        return True

    def _adopt(self, conn: links.Connection) -> None:
        """An inbound connection proved itself: carry our messages for the address it
        listens at on it, instead of dialling back."""
        link = self._links.get(conn.peer_address or "")
        if link is not None and link.connection is None and self._acceptable(link, conn):
            if link.dialing is not None:
                link.dialing.cancel()
                link.dialing = None
            self._attach(link, conn)

    def _reject_connection(self, writer: asyncio.StreamWriter, peer: str, reason: str) -> None:
        line = f"transport: rejected a connection from {peer}: {reason}"
        self._event("CONNECTION_REJECTED", peer, reason, line)
        if writer.get_extra_info("sslcontext") is not None:
            # Aborted, not closed: a TLS close waits up to 30 s for the stranger's
            # close_notify, holding its place all the while.
            writer.transport.abort()
        else:
            writer.close()

    # --- a connection's reader and writer ----------------------------------------------

    def _serve(self, conn: links.Connection) -> None:
        self._connections.add(conn)
        conn.tasks = [
            asyncio.create_task(self._read_loop(conn), name=f"read {conn.peer}"),
            asyncio.create_task(self._write_loop(conn), name=f"write {conn.peer}"),
        ]

    async def _read_loop(self, conn: links.Connection) -> None:
        reason = "closed by the peer"
        try:
            while True:
                try:
                    frame = await frames.read(conn.reader, conn.receive_key)
                except frames.CorruptFrame as exc:
                    conn.corrupted += 1
                    counters.bad_frame("corrupted")
                    line = f"transport: dropped a corrupted frame from {conn.peer}: {exc}"
                    self._event("CORRUPTED_MESSAGE", conn.peer, str(exc), line)
                    continue
                number = frame.header.get(frames.NUMBER)
                if not conn.received.accept(number):
                    # Signed with this connection's key, so written on it before: someone
                    # on the path wrote it again. Its first copy was acted on.
                    detail = (
                        f"{frame.kind.name} frame number {number} is not above the last "
                        f"accepted, {conn.received.highest} (a replay)"
                    )
                    line = f"transport: dropped a replayed frame from {conn.peer}: {detail}"
                    counters.bad_frame("replayed")
                    self._event("REPLAYED_FRAME", conn.peer, detail, line)
                    continue
                conn.last_activity = conn.last_received = time.time()
                conn.frames_received += 1
                conn.bytes_received += len(frame.body or b"") + frames.PREFIX.size
                fragment = self._on_frame(conn, frame)
                if fragment is not None:
                    await self._queue_incoming(fragment, conn)
        except frames.GarbageFrame as exc:
            reason = f"garbage on the connection: {exc}"
            line = f"transport: closing the connection with {conn.peer}: {reason}"
            self._event("CONNECTION_REJECTED", conn.peer, reason, line)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError) as exc:
            reason = _describe(exc)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # a reader that died would leave the connection counted
            log.exception("transport: reading from %s failed", conn.peer)
            reason = f"reader failed: {_describe(exc)}"
        await self._close(conn, reason)

    async def _queue_incoming(self, fragment: delivery.Fragment, conn: links.Connection) -> None:
        """Hand a fragment to the storing thread; while storing lags, wait (the reader
        reads no more: backpressure) but keep telling the peer that we are alive — it
        would take the silence for a dead connection and dial again, resending its
        whole window to a broker already behind."""
        assert self._incoming is not None
        if not self._incoming.full():
            self._incoming.put_nowait((fragment, conn))
            return
        put = asyncio.ensure_future(self._incoming.put((fragment, conn)))
        try:
            while not (await asyncio.wait({put}, timeout=PING_AFTER))[0]:
                conn.pong_due = True
                conn.wake.set()
        finally:
            put.cancel()  # done already, unless this reader itself was cancelled

    def _on_frame(self, conn: links.Connection, frame: frames.Frame) -> delivery.Fragment | None:
        """Act on a frame's acknowledgements and refusals; the fragment it carries."""
        header = frame.header
        conn.ping_sent_at = None  # anything from the peer answers a PING
        if header.get("p"):
            conn.pong_due = True
            conn.wake.set()
        try:
            if header.get("a"):
                conn.last_acked = conn.last_received
            for c, i, s, f in header.get("a", ()):
                self._on_ack((str(c), bool(i), int(s)), int(f), conn)
            for c, i, s, _f, reason in header.get("r", ()):
                self._on_reject((str(c), bool(i), int(s)), str(reason), conn)
            if frame.kind is frames.Kind.MESSAGE:
                fragment = delivery.Fragment(
                    conversation_id=str(header["c"]),
                    from_initiator=bool(header["i"]),
                    seq=int(header["s"]),
                    index=int(header["f"]),
                    count=int(header["n"]),
                    from_service=str(header["fs"]),
                    to_service=str(header["ts"]),
                    contract=str(header["ct"]),
                    message_type=str(header["mt"]),
                    body=frame.body,
                    lifetime_expires_at=header.get("lt"),
                )
                if not 0 <= fragment.index < fragment.count:
                    raise ValueError(f"fragment {fragment.index} of {fragment.count}")
                return fragment
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            raise frames.GarbageFrame(f"malformed {frame.kind.name} header: {exc!r}") from None
        return None

    async def _write_loop(self, conn: links.Connection) -> None:
        writer = conn.writer
        try:
            while not conn.closed:
                await conn.wake.wait()
                conn.wake.clear()
                unyielded = 0
                while not conn.closed:
                    if _lost(writer.transport):
                        # Lost under us: what would be written now would only be counted
                        # as sent. The link gets another connection.
                        await self._close(conn, "the connection was lost")
                        return
                    data = self._next_frame(conn)
                    if data is None:
                        break
                    writer.write(data)
                    conn.frames_sent += 1
                    conn.bytes_sent += len(data)
                    conn.last_activity = time.time()
                    unyielded += len(data)
                    if writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH:
                        await writer.drain()
                        unyielded = 0
                    elif unyielded >= WRITE_SLICE:
                        # A TLS connection whose socket failed a send says so only
                        # after the loop has run (its socket drops what it is given
                        # meanwhile, so the buffer never fills): without this, a link's
                        # whole window went into the void, each frame counted as sent.
                        await asyncio.sleep(0)
                        unyielded = 0
                await writer.drain()
        except asyncio.CancelledError:
            return
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            await self._close(conn, _describe(exc))
        except Exception as exc:  # a writer that died would leave the link mute for good
            log.exception("transport: writing to %s failed", conn.peer)
            await self._close(conn, f"writer failed: {_describe(exc)}")

    def _next_frame(self, conn: links.Connection) -> bytes | None:
        """The next frame for a connection: a fragment of its link (with the pending
        acknowledgements on it), else rejections, else acknowledgements alone."""
        link = conn.link if conn.link is not None and conn.link.connection is conn else None
        now = time.time()
        entry = None if link is None else link.pop(now, self._honor_priority, STARVATION_AFTER)
        acks = conn.acks[:ACKS_PER_FRAME]
        del conn.acks[: len(acks)]
        ping = conn.ping_sent_at is None and conn.ping_due
        if ping:
            conn.ping_due, conn.ping_sent_at = False, now
        if entry is not None:
            assert link is not None
            message = entry.message
            header = dict(message.header, f=entry.index)
            if acks:
                header["a"] = acks
            if ping:
                header["p"] = 1
            conn.pong_due = False
            if message.round_at is None:  # the round's first frame on a live connection
                message.round_at = now
                message.attempts += 1
                if message.attempts > 1:
                    self._status(
                        message, f"not acknowledged; sent again (attempt {message.attempts})", 1
                    )
            link.written(message, entry.index, now)
            return conn.seal(frames.Kind.MESSAGE, header, message.fragments[entry.index])
        if conn.rejects:
            rejects = conn.rejects[:REJECTS_PER_FRAME]
            del conn.rejects[: len(rejects)]
            header = {"r": rejects}
            if acks:
                header["a"] = acks
            return conn.seal(frames.Kind.REJECT, header, None)
        if acks or ping or conn.pong_due:
            conn.pong_due = False
            header = {"a": acks, "p": 1} if ping else {"a": acks}
            return conn.seal(frames.Kind.ACK, header, None)
        return None

    async def _close(self, conn: links.Connection, reason: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._connections.discard(conn)
        if conn.direction == "inbound":
            self._inbound -= 1
        conn.wake.set()
        log.info("transport: connection with %s closed: %s", conn.peer, reason)
        with contextlib.suppress(Exception):
            conn.writer.close()
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        link = conn.link
        if link is not None and link.connection is conn:
            link.connection = None
            if link.has_work():
                self._connect(link)

    # --- acknowledgements and rejections -----------------------------------------------

    def _on_ack(self, key: tuple[str, bool, int], index: int, conn: links.Connection) -> None:
        message = self._by_key.get(key)
        if message is None or not 0 <= index < len(message.fragments):
            return
        if conn.peer_address != message.address:
            return  # from where the message went before its route changed
        message.acked.add(index)
        if message.done:
            self._drop(message)
            self._acked.append((message.message_id, message.handle, message.seq))

    def _on_reject(self, key: tuple[str, bool, int], reason: str, conn: links.Connection) -> None:
        message = self._by_key.get(key)
        if message is None or conn.peer_address != message.address:
            return  # (see _on_ack)
        if message.rejected != reason:
            log.warning(
                "transport: %s refused message %d of conversation %s: %s",
                conn.peer,
                message.seq,
                message.conversation_id,
                reason,
            )
        message.rejected = reason
        message.pending = []
        message.line += 1  # what it still had in line goes with the next round, not now
        message.due = time.time() + message.backoff
        message.backoff = min(message.backoff * 2, self.retry_max)
        self._status(message, f"refused by broker {conn.peer_broker}: {reason}", 0)

    def _status(self, message: links.Outgoing, status: str, attempts: int) -> None:
        previous = self._statuses.get(message.message_id)
        if previous is None or previous[0] != status or attempts:
            counted = attempts + (previous[1] if previous else 0)
            self._statuses[message.message_id] = (status, counted)
            self._dirty_statuses.add(message.message_id)

    def _event(self, kind: str, peer: str | None, detail: str, line: str | None) -> None:
        """An event and its log line (``None``: none), at a bounded rate per peer host."""
        self._reports.report(time.time(), kind, peer, detail, line)

    # --- arriving fragments ------------------------------------------------------------

    async def _deliver_loop(self) -> None:
        assert self._incoming is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._incoming.get()]
            while len(batch) < DELIVERY_BATCH and not self._incoming.empty():
                batch.append(self._incoming.get_nowait())
            fragments = [fragment for fragment, _ in batch]
            try:
                outcomes = await loop.run_in_executor(
                    self._db, self._receiver.accept_batch, fragments
                )
            except Exception:  # not acknowledged: the sender will send them again
                _database_failed(f"storing {len(batch)} fragments")
                continue
            for (fragment, conn), outcome in zip(batch, outcomes, strict=True):
                if outcome == delivery.NOT_YET:
                    continue  # neither taken nor refused: the sender tries again later
                if outcome is not None:
                    self._event("MESSAGE_REJECTED", conn.peer, outcome, None)
                if conn.closed:
                    continue  # its acknowledgement is lost with it; the copy will be acked
                if outcome is None:
                    conn.acks.append(list(fragment.key))
                else:
                    conn.rejects.append([*fragment.key, outcome[:REJECT_REASON_MAX]])
                conn.wake.set()

    # --- housekeeping ------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        last_prune = 0.0
        while True:
            await asyncio.sleep(TICK)
            try:
                last_prune = await self._tick(time.time(), last_prune)
            except Exception:  # housekeeping must outlive a passing error (a database one)
                _database_failed("housekeeping")

    async def _tick(self, now: float, last_prune: float) -> float:
        """Retransmit what is due, reconnect links with work, close idle and stalled
        connections, write what was gathered, now and then prune old tombstones."""
        for link in self._links.values():
            woke = False
            conn = link.connection
            for message in link.messages.values():
                if message.due is not None and message.due <= now and not message.done:
                    refused, message.rejected = message.rejected is not None, None
                    if conn is None or conn.closed:
                        # Sent into a connection that is gone: it goes again, from its
                        # first unacknowledged fragment, on the next one (_attach).
                        message.due = None
                        continue
                    if refused:
                        pass  # the far broker said no: its wait doubled then (_on_reject)
                    elif conn.last_acked < (message.round_at or now):
                        # Nothing at all acknowledged since this round went: the peer
                        # may be swamped or gone. Wait longer before the next.
                        message.backoff = min(message.backoff * 2, self.retry_max)
                    else:
                        # The peer acknowledges the rest: this frame, or its
                        # acknowledgement, was lost. Loss is no reason to wait longer.
                        message.backoff = self.retry_initial
                    link.start_round(message, now)
                    woke = True
            if woke and conn is not None:
                conn.wake.set()
            if link.has_work() and link.connection is None:
                self._connect(link)
        silent = max(PING_AFTER, self.retry_initial)
        for conn in list(self._connections):
            carries = conn.link is not None and conn.link.connection is conn
            busy = carries and conn.link is not None and conn.link.has_work()
            if now - conn.last_activity > self.idle_timeout and not busy and not conn.acks:
                await self._close(conn, f"idle for {self.idle_timeout:g} s")
            elif conn.ping_sent_at is not None and now - conn.ping_sent_at > PING_TIMEOUT:
                # A peer gone without a reset (a pulled cable, a NAT that forgot us):
                # its socket would take the kernel's minutes to fail. Dial again.
                await self._close(conn, f"no answer to a PING for {PING_TIMEOUT:g} s")
            elif busy and now - conn.last_received > silent + PING_TIMEOUT:
                # Its PING could not even be written (the socket's buffer is full of
                # what the peer stopped taking): as good as gone.
                await self._close(conn, f"nothing received for {silent + PING_TIMEOUT:g} s")
            elif busy and now - conn.last_received > silent and conn.ping_sent_at is None:
                conn.ping_due = True  # messages wait and the peer has gone quiet: alive?
                conn.wake.set()
        self._reports.flush(now)
        await self._flush_writes()
        if now - self._connections_written_at >= CONNECTIONS_INTERVAL:
            await self._write_connections(now)
        if now - last_prune > PRUNE_INTERVAL:
            last_prune = now
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._writes, delivery.prune_closed, self._broker, now)
            await loop.run_in_executor(
                self._writes,
                delivery.prune_events,
                self._broker,
                now - self.events_retention,
                self.events_max,
            )
        return last_prune

    async def _write_connections(self, now: float) -> None:
        """The connections view (``transport_connections``) for other processes: written
        while there are connections, and once more when the last one has gone."""
        infos = await self._snapshot()
        if not infos and not self._connections_shown:
            return
        self._connections_written_at = now
        self._connections_shown = bool(infos)
        await asyncio.get_running_loop().run_in_executor(
            self._writes,
            delivery.write_connections,
            self._broker,
            self._endpoint_id,
            self.address,
            infos,
            now,
            CONNECTIONS_STALE,
        )

    async def _flush_writes(self) -> None:
        """Write what the loop gathered: deletions of acknowledged messages, statuses,
        events — each in one transaction, off the loop."""
        loop = asyncio.get_running_loop()
        acked, self._acked = self._acked, []
        dirty, self._released = self._released, []
        for message_id in self._dirty_statuses:
            message = self._inflight.get(message_id)
            if message is not None and message_id in self._statuses:
                status, attempts = self._statuses[message_id]
                dirty.append((message_id, message.handle, message.seq, status, attempts))
                self._statuses[message_id] = (status, 0)  # counted once written
        self._dirty_statuses.clear()
        events, self._events = self._events, []
        # Each part is let go once written; what a failure leaves goes back, to be written
        # at the next flush (statuses carry attempts as increments: none written twice).
        try:
            if acked:
                await loop.run_in_executor(self._writes, delivery.acknowledged, self._broker, acked)
                with self._known_lock:
                    self._known.difference_update(message_id for message_id, _, _ in acked)
                self._broker.waiting.wakeups.notify({wakeup.TRANSMISSION})  # room in the window
                acked = []
            if dirty:
                await loop.run_in_executor(self._writes, delivery.set_statuses, self._broker, dirty)
                dirty = []
            if events:
                await loop.run_in_executor(
                    self._writes, delivery.record_events, self._broker, events
                )
                events = []
        except Exception:
            _database_failed("writing to the database")
            self._acked[:0] = acked
            self._released[:0] = dirty
            self._events[:0] = events


# A TLS alert record (fatal, unexpected_message): a TLS endpoint's answer to a plain dialler.
TLS_ALERT = b"\x15\x03\x03\x00\x02\x02\x0a"


async def _first_bytes(sock: socket.socket) -> bytes:
    """The first bytes a peer sent on an accepted socket, left there to be read (b"" when
    it closed without a word)."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, ready)
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    return sock.recv(2, socket.MSG_PEEK)


def _is_zero(number: object) -> bool:
    """The CONFIRM's number: the integer 0 (not ``False``, not ``0.0``)."""
    return type(number) is int and number == 0


def _lost(transport: asyncio.BaseTransport) -> bool:
    """Whether a connection's transport can write no more: closing, or lost under a TLS
    transport of Python 3.10, which still says ``is_closing() == False`` then (and whose
    ``get_write_buffer_size()`` raises) — but has no socket under it any more."""
    return transport.is_closing() or transport.get_extra_info("socket") is None


def _database_failed(what: str) -> None:
    """Log a failure of one of the endpoint's loops, which all try again (call it in the
    ``except`` block). A lost database is the broker's to tell, once per outage
    ("database ... unavailable", "... is back after 4.8 s"): a line per loop and try
    buried it (1,400 lines with tracebacks for a 5 s restart, 100 without), so those go
    to DEBUG. Anything else is a WARNING with its traceback."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (exceptions.ConnectionLost, exceptions.DatabaseUnavailable)):
        log.debug("transport: %s failed: %s; trying again", what, exc)
    else:
        log.warning("transport: %s failed; trying again", what, exc_info=True)


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    ):
        raise exceptions.InvalidArgument(
            f"{name} must be a finite number of seconds > 0, got {value!r}"
        )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise exceptions.InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")


class HandshakeRefused(ConnectionError):
    """The far side failed the handshake: it did not prove the key, or is not our kind."""


def _no_route(service: str) -> str:
    """The status of a message whose service has no route (to another broker)."""
    return f"no route to service {service!r}"


def _other_version(version: object) -> str:
    return (
        f"the peer speaks transport protocol {version!r}, this broker {PROTOCOL_VERSION}: "
        "run the same scheduler_lib release on both brokers"
    )


def _closed_in_handshake(exc: BaseException, tls: ssl.SSLContext | None) -> str:
    """Why a peer may have closed the connection before its WELCOME (its transport
    events say which)."""
    causes = "different transport keys, or another protocol version"
    if tls is None:
        causes += ", or it expects TLS"
    else:
        # With TLS 1.3 a refused client certificate is told after our side has finished
        # its TLS handshake, and asyncio drops the alert: it looks like a plain close.
        causes += ", or it refused our TLS certificate (not signed by its --tls-ca?)"
    return (
        f"the peer closed the connection during the handshake ({causes}; its "
        "transport events say which)"
    )


def _transport_key(key: bytes | str) -> bytes:
    data = key.encode() if isinstance(key, str) else key
    if not isinstance(data, bytes) or len(data) < 16:
        raise exceptions.InvalidArgument(
            "the transport key must be at least 16 bytes (or characters)",
            hint="e.g. python -c 'import secrets; print(secrets.token_hex(32))'",
        )
    return data


def _host_port(value: str, what: str) -> tuple[str, int]:
    """``host:port`` (or ``tcp://host:port``); port 0 picks a free port."""
    text = value[len("tcp://") :] if value.startswith("tcp://") else value
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise exceptions.InvalidArgument(f"{what} must be host:port, got {value!r}")
    return host.strip("[]"), int(port)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, ConnectionError) else f"{type(exc).__name__}: {text}"


def tls_contexts(
    cert: str, key: str, ca: str | None = None
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """TLS for an endpoint: (for accepted connections, for dialled ones). Each side shows
    ``cert``; with ``ca`` each also requires and verifies the other's certificate against
    it (mutual TLS), otherwise the system's trust store verifies the server.

    :raises InvalidArgument: naming the file that cannot be used
    """
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        server.load_cert_chain(cert, key)
        if ca is not None:
            server.verify_mode = ssl.CERT_REQUIRED
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        client.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise exceptions.InvalidArgument(
            f"TLS files cert={cert!r} key={key!r} ca={ca!r} cannot be used: {exc}"
        ) from None
    return server, client


def read_key(path: str | None, env: str = "SCHEDULER_LIB_TRANSPORT_KEY") -> bytes:
    """The transport key from a file (its bytes, trailing newline dropped) or else from the
    environment variable ``env``.

    :raises InvalidArgument: when neither gives one
    """
    import os

    if path is not None:
        try:
            with open(path, "rb") as handle:
                return handle.read().rstrip(b"\r\n")
        except OSError as exc:
            raise exceptions.InvalidArgument(f"cannot read the transport key file: {exc}") from None
    value = os.environ.get(env)
    if not value:
        raise exceptions.InvalidArgument(
            f"a transport endpoint needs a key: --key-file PATH or {env}",
            hint="every broker that talks to this one must have the same key",
        )
    return value.encode()


@contextlib.contextmanager
def running(broker: brokers.Broker, **options: Any) -> Iterator[TransportEndpoint]:
    """A started endpoint for the ``with`` block."""
    endpoint = TransportEndpoint(broker, **options).start()
    try:
        yield endpoint
    finally:
        endpoint.stop()
