"""The demo's Spark worker: ``scheduler-lib worker`` in a process of its own, as a user
would run it, with its output in a log file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

READY = "worker serving"  # the line the worker prints once its target queue is served
READY_TIMEOUT = 90.0  # seconds for the JVM, the session and the scheduler catalog
STOP_TIMEOUT = 60.0  # seconds for running tasks to finish and the session to stop
POLL = 0.1  # seconds between looks at the log while waiting for the worker
LOG_TAIL = 30  # lines of the log shown when the worker does not come up
ERROR_LINE = re.compile(r"\b(ERROR|Exception|Error)\b")


class WorkerFailed(Exception):
    """The Spark worker did not come up (or died); its log says why."""


class WorkerProcess:
    """A ``scheduler-lib worker`` process, started on entering the ``with`` block and
    stopped (SIGTERM, then SIGKILL after ``STOP_TIMEOUT``) on leaving it, however the
    block ends.

    :param db: the broker URL the worker serves
    :param log_path: where its standard output and error go
    :param master: Spark master
    :param readers: most tasks the worker runs at once
    :param conf: Spark settings (``key=value``)
    """

    def __init__(
        self, db: str, log_path: Path, *, master: str, readers: int, conf: Sequence[str] = ()
    ) -> None:
        self.log_path = log_path
        self.command = [sys.executable, "-m", "scheduler_lib.cli", "worker", "--db", db]
        self.command += ["--master", master, "--max-readers", str(readers)]
        for setting in conf:
            self.command += ["--conf", setting]
        self.process: subprocess.Popen[bytes] | None = None
        self.banner = ""  # the worker's READY line: its Spark application and UI

    def __enter__(self) -> WorkerProcess:
        with open(self.log_path, "wb") as log:
            # A session of its own: Ctrl-C reaches the demo only, which then stops the
            # worker in order (its running tasks were cancelled first).
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        idle = threading.Event()  # never set: a wait that a Ctrl-C can interrupt
        while True:
            banner = next((x for x in self._lines() if x.startswith(READY)), None)
            if banner is not None:
                self.banner = banner
                return
            code = self.process.poll()
            if code is not None:
                raise WorkerFailed(f"the Spark worker exited with code {code} before serving")
            if time.monotonic() >= deadline:
                raise WorkerFailed(f"the Spark worker did not serve within {timeout:.0f} s")
            idle.wait(POLL)

    def stop(self) -> int | None:
        """Stop the worker: SIGTERM, wait up to ``STOP_TIMEOUT``, then SIGKILL.

        :return: its exit code (``None`` when it was never started)
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except (subprocess.TimeoutExpired, KeyboardInterrupt) as why:
                # Its whole session: the Spark JVM is a child of the worker.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                if isinstance(why, KeyboardInterrupt):  # a second Ctrl-C: stop now
                    raise
        return self.process.returncode

    @property
    def returncode(self) -> int | None:
        """The worker's exit code; ``None`` while it runs (or before it started)."""
        return None if self.process is None else self.process.poll()

    def first_error(self) -> str | None:
        """The first line of the log that reports an error (the cause, where the tail
        often shows only the Python traceback that followed it)."""
        return next((x for x in self._lines() if ERROR_LINE.search(x)), None)

    def tail(self, lines: int = LOG_TAIL) -> str:
        """The last ``lines`` lines of the worker's log."""
        return "\n".join(self._lines()[-lines:])

    def _lines(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return text.splitlines()
