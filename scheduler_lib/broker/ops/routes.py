"""Routes (CREATE / ALTER / DROP ROUTE) and the broker's identity.

A route says where a service lives: ``tcp://host:port`` of the broker that hosts it (its
transport endpoint), or ``LOCAL``. BEGIN DIALOG to a service this database does not host
follows its route; the messages then go through the transmission queue to that broker.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import exceptions
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions

LOCAL = "LOCAL"  # the address of a route to a service of this broker
DEFAULT_PORT = 4022  # Service Broker's customary port
_ADDRESS = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Route:
    """One route, as ``sys.routes`` shows it."""

    route_name: str
    remote_service_name: str
    broker_instance: str | None
    address: str
    created_at: float

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Route:
        return cls(
            route_name=row["route_name"],
            remote_service_name=row["remote_service_name"],
            broker_instance=row["broker_instance"],
            address=row["address"],
            created_at=float(row["created_at"]),
        )

    @property
    def is_local(self) -> bool:
        return self.address == LOCAL

    @property
    def host_port(self) -> tuple[str, int]:
        """Where the far broker's endpoint listens (``LOCAL`` routes have no address)."""
        return parse_address(self.address)


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` as (host, port).

    :raises InvalidArgument: naming what is wrong with it
    """
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None:
        raise exceptions.InvalidArgument(
            f"route address must be 'tcp://host:port' or 'LOCAL', got {address!r}",
            hint=f"e.g. tcp://spark-broker.example.com:{DEFAULT_PORT}",
        )
    port = int(match["port"])
    if not 0 < port < 65536:
        raise exceptions.InvalidArgument(f"route address {address!r}: port {port} out of range")
    return match["host"].strip("[]"), port


def create(
    session: sessions.Session,
    name: str,
    service_name: str,
    address: str,
    broker_instance: str | None,
) -> Route:
    """CREATE ROUTE (the front's ``create_route`` says what each argument is)."""
    name = checks.name(name, "route name")
    service = checks.name(service_name, "service name")
    values = {"address": _address(address), "broker_instance": _instance(broker_instance)}
    if session.one("route_get", name=name) is not None:
        raise exceptions.AlreadyExists(f"route {name!r} already exists")
    session.execute("route_insert", name=name, service=service, now=time.time(), **values)
    session.mark_written()
    return Route.from_row(_required(session, name))


def alter(
    session: sessions.Session,
    name: str,
    service_name: str | None,
    address: str | None,
    broker_instance: str | None,
) -> Route:
    """ALTER ROUTE: change what is given (not ``None``), keep the rest."""
    route = Route.from_row(_required(session, name))
    session.execute(
        "route_update",
        name=name,
        service=route.remote_service_name
        if service_name is None
        else checks.name(service_name, "service name"),
        address=route.address if address is None else _address(address),
        broker_instance=route.broker_instance
        if broker_instance is None
        else _instance(broker_instance),
    )
    session.mark_written()
    return Route.from_row(_required(session, name))


def drop(session: sessions.Session, name: str) -> None:
    """DROP ROUTE."""
    _required(session, name)
    session.execute("route_delete", name=name)
    session.mark_written()


def listed(session: sessions.Session) -> list[Route]:
    """Every route (``sys.routes``)."""
    return [Route.from_row(r) for r in session.all("route_list")]


def broker_instance(session: sessions.Session) -> str:
    """This broker's id (``service_broker_guid``), made by its first asker."""
    instance = session.scalar("setting_get", name="broker_instance")
    if instance is None:  # the first asker names the broker; a racing one agrees
        session.execute("setting_insert_once", name="broker_instance", value=str(uuid.uuid4()))
        session.mark_written()
        instance = session.scalar("setting_get", name="broker_instance")
    return str(instance)


def remote_route(session: sessions.Session, service: str) -> Route | None:
    """The route that takes ``service`` to another broker, or ``None`` (no route, or
    only ``LOCAL`` ones)."""
    for row in session.all("routes_for_service", service=service):
        route = Route.from_row(row)
        if not route.is_local:
            return route
    return None


def _required(session: sessions.Session, name: str) -> Mapping[str, Any]:
    row = session.one("route_get", name=name)
    if row is None:
        raise exceptions.NotFound(f"route {name!r} does not exist")
    return row


def _address(value: Any) -> str:
    if isinstance(value, str) and value.upper() == LOCAL:
        return LOCAL
    parse_address(value)
    return str(value)


def _instance(value: Any) -> str | None:
    return None if value is None else checks.handle(value, "broker_instance")
