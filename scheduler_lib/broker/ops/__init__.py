"""The broker's operations as plain functions over one
:class:`~scheduler_lib.broker.db.session.Session`: ``op(session, ...)``. They run named
statements through the session and declare what they did on it
(``session.mark_written()``, ``session.touched(queue)``, ...); they import only the
session and store layer (:mod:`scheduler_lib.broker.db`), the models, the exceptions and
the validation — never a front (``Broker``, ``Transaction``) or a mixin (import-linter
holds this, type-only imports included).

- :mod:`.endpoints`: the rows operations stand on, found or refused with the right
  NotFound (queues, services, endpoints, the far side); a target endpoint made with the
  first message; an endpoint closed
- :mod:`.sending`: SEND — the one-statement paths, the checked path, to another broker,
  and putting a message on its queue
- :mod:`.receiving`: RECEIVE and GET CONVERSATION GROUP — one look, the one-statement
  look, and the wait of ``WAITFOR``
- :mod:`.conversations`: BEGIN DIALOG, SEND of several, MOVE, END CONVERSATION, timers
- :mod:`.catalog`: message types, contracts, queues, services, event notifications,
  priorities
- :mod:`.leases`: the checked take, renew, complete, abandon, release, expiry
- :mod:`.poison`: the poison policies, failure records, built-in detection, routing
- :mod:`.arrival`, :mod:`.events`, :mod:`.timers`, :mod:`.routes`: held messages
  released, event notifications, timers and lifetimes that fall due, routes
"""
