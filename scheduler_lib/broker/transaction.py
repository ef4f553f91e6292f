"""A broker transaction: every operation inside it commits or rolls back together.

:class:`Transaction` lives in :mod:`scheduler_lib.broker.broker` beside :class:`Broker`
(each names the other: one module, no import cycle between the fronts); this module keeps
its import path.
"""

from scheduler_lib.broker.broker import Transaction

__all__ = ["Transaction"]
