"""The broker's operations as plain functions over one :class:`~scheduler_lib.broker.
session.Session`: ``op(session, ...)``. They run named statements through the session and
declare what they did on it (``session.mark_written()``, ``session.touched(queue)``, ...);
they import only the session and store layer, the models, the exceptions and the
validation — never a front (``Broker``, ``Transaction``) or a mixin.

- :mod:`~scheduler_lib.broker.ops.endpoints`: the rows operations stand on, found or
  refused with the right NotFound (queues, services, endpoints, the far side), a target
  endpoint made with the first message, an endpoint closed
- :mod:`~scheduler_lib.broker.ops.sending`: SEND — the one-statement paths, the checked
  path, to another broker, and putting a message on its queue
- :mod:`~scheduler_lib.broker.ops.receiving`: RECEIVE and GET CONVERSATION GROUP — one
  look, the one-statement look, and the wait of ``WAITFOR``
- :mod:`~scheduler_lib.broker.ops.timers`: conversation timers and lifetimes that fall due
"""
