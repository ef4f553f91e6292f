"""The task scheduler on the broker (seed 002, DESIGN.md section 9): scheduler handles,
``exec_async``, ``synchronization``, waves, ``execution_log``, semaphores.

    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import Task, TaskScheduler, init

    broker = Broker("sqlite:///scheduler_lib.db")
    init(broker)  # the catalog, once (idempotent)
    report = TaskScheduler(broker).run_waves([[Task.sql("..."), Task.sql("...")], [...]])

Executors run as the target queue's activated readers (``scheduler-lib serve``).
"""

from scheduler_lib.scheduler.catalog import MIGRATIONS, Names, Target, init, prepare
from scheduler_lib.scheduler.client import (
    Completion,
    RunReport,
    SchedulerHandle,
    TaskScheduler,
    TaskState,
    WaveProgress,
    WaveReport,
)
from scheduler_lib.scheduler.errors import (
    InvalidTask,
    KindNotAllowed,
    PlanError,
    SchedulerEnded,
    SchedulerError,
    SynchronizationTimeout,
    UnknownKind,
    WaveFailed,
)
from scheduler_lib.scheduler.executor import Executor
from scheduler_lib.scheduler.kinds import Task, TaskContext, TaskKind, register_kind
from scheduler_lib.scheduler.semaphores import Permit, Semaphores, SemaphoreTimeout

__all__ = [
    "MIGRATIONS",
    "Completion",
    "Executor",
    "InvalidTask",
    "KindNotAllowed",
    "Names",
    "Permit",
    "PlanError",
    "RunReport",
    "SchedulerEnded",
    "SchedulerError",
    "SchedulerHandle",
    "SemaphoreTimeout",
    "Semaphores",
    "SynchronizationTimeout",
    "Target",
    "Task",
    "TaskContext",
    "TaskKind",
    "TaskScheduler",
    "TaskState",
    "UnknownKind",
    "WaveFailed",
    "WaveProgress",
    "WaveReport",
    "init",
    "prepare",
    "register_kind",
]
