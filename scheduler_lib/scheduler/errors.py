"""The scheduler's errors: every one a :class:`~scheduler_lib.broker.BrokerError`, so a
caller (and the CLI) catches the whole library with one ``except``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler_lib.broker.exceptions import BrokerError, InvalidArgument

if TYPE_CHECKING:
    from scheduler_lib.scheduler.client import Completion, RunReport


class InvalidTask(InvalidArgument):
    """A task is malformed: the message names the task and the field."""


class UnknownKind(InvalidTask):
    """No executor knows this task kind."""


class KindNotAllowed(InvalidTask):
    """The target service does not run this task kind."""


class SchedulerError(BrokerError):
    """The scheduler cannot go on (its conversation ended, or it timed out)."""


class SchedulerEnded(SchedulerError):
    """The scheduler's conversation was ended by the other side (or an operator), so no
    completion will come; the message says how (``EndDialog`` or the ``Error``)."""


class SynchronizationTimeout(SchedulerError):
    """``synchronization`` waited ``timeout`` seconds and no task completed."""


class WaveFailed(SchedulerError):
    """A wave had failed tasks and the policy is ``fail_fast``: nothing more was sent, and
    tasks sent but not started were cancelled.

    :ivar failures: the failed (and cancelled) completions
    :ivar completions: every completion received, in arrival order
    """

    def __init__(
        self,
        message: str,
        failures: Sequence[Completion],
        completions: Sequence[Completion],
        report: RunReport | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = list(failures)
        self.completions = list(completions)
        self.report = report  # wave by wave, with what was not sent


class PlanError(InvalidArgument):
    """A plan file is invalid; the message names the file, the line and the field."""
