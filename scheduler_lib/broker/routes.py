"""The route operations of both fronts (``Broker``, ``Transaction``): each one line into
:mod:`scheduler_lib.broker.ops.routes`, in the front's transaction."""

from __future__ import annotations

import contextlib

from scheduler_lib.broker.db import session
from scheduler_lib.broker.ops import routes
from scheduler_lib.broker.ops.routes import LOCAL, Route

__all__ = ["LOCAL", "Route", "RouteOperations"]


class RouteOperations:
    """CREATE / ALTER / DROP ROUTE and the broker's own instance id."""

    def _operation(self) -> contextlib.AbstractContextManager[session.InTransaction]:
        raise NotImplementedError

    def create_route(
        self,
        name: str,
        service_name: str,
        address: str,
        *,
        broker_instance: str | None = None,
    ) -> Route:
        """CREATE ROUTE name WITH SERVICE_NAME, BROKER_INSTANCE, ADDRESS.

        :param name: the route's name
        :param service_name: the remote service it leads to
        :param address: ``tcp://host:port`` of the broker hosting it, or ``LOCAL``
        :param broker_instance: only that broker (its :attr:`broker_instance`); a peer
            answering at the address with another id is not sent to
        :raises AlreadyExists: when a route has that name
        """
        with self._operation() as tx:
            return routes.create(tx.session, name, service_name, address, broker_instance)

    def alter_route(
        self,
        name: str,
        *,
        service_name: str | None = None,
        address: str | None = None,
        broker_instance: str | None = None,
    ) -> Route:
        """ALTER ROUTE: change what is given, keep the rest.

        :raises NotFound: for an unknown route
        """
        with self._operation() as tx:
            return routes.alter(tx.session, name, service_name, address, broker_instance)

    def drop_route(self, name: str) -> None:
        """DROP ROUTE. Messages waiting for it stay in the transmission queue; a running
        endpoint stops sending them (within a couple of seconds) until a route is found.

        :raises NotFound: for an unknown route
        """
        with self._operation() as tx:
            routes.drop(tx.session, name)

    def routes(self) -> list[Route]:
        """Every route (``sys.routes``)."""
        with self._operation() as tx:
            return routes.listed(tx.session)

    @property
    def broker_instance(self) -> str:
        """This broker's id (``service_broker_guid``), made when its schema was created."""
        with self._operation() as tx:
            return routes.broker_instance(tx.session)
