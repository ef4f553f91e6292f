"""``make demo``: the blog's scheduler test as Spark SQL, end to end — a
``scheduler-lib worker`` process, waves of 4, 2, 1, 2, 1 tasks sent with
:meth:`~scheduler_lib.scheduler.TaskScheduler.run_waves`, live progress, the run's
``execution_log`` and a timeline picture. Run it with ``python -m demo``."""

from demo.cli import main

__all__ = ["main"]
