"""The documented ``scheduler-lib serve --db URL`` run as a user runs it: in its own
process, with default settings, its output read as a terminal shows it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from multiproc import poll

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Task, TaskScheduler

SCHEDULER_LIB = Path(sys.executable).with_name("scheduler-lib")


class Serving:
    """The documented ``scheduler-lib serve --db URL`` in its own process, with default
    settings, and the lines it prints (stdout and stderr, as a terminal shows them)."""

    def __init__(self, url: str) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [str(SCHEDULER_LIB), "serve", "--db", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reading = threading.Thread(target=self._read, daemon=True)
        self._reading.start()
        try:
            poll(self.said("serving"), 60, "serve to start", explain=self.tail)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, *words: str, since: int = 0) -> Callable[[], bool]:
        return lambda: any(all(w in line for w in words) for line in self.lines[since:])

    def says_little(self) -> None:
        """It says nothing more while its loops keep failing (the timer thread's each
        second, the activation supervisor's, the heartbeat's): a few lines, no traceback
        — not a traceback per loop per turn (before: some 2,000 lines in 10 s)."""
        said = len(self.lines)
        time.sleep(3)  # a window to count lines in, three turns of the timer thread
        assert self.process.poll() is None, self.tail(20)
        assert not self.tracebacks(), self.tail(len(self.lines))
        assert len(self.lines) - said <= 5, "\n".join(self.lines[said:])

    def tail(self, count: int = 60) -> str:
        return "\n".join(self.lines[-count:])

    def tracebacks(self) -> list[str]:
        return [line for line in self.lines if "Traceback" in line]

    def stops_cleanly(self) -> None:
        """SIGTERM stops it as usual: exit 0, and no traceback said on the way."""
        assert self.stop() == 0, self.tail()
        assert not self.tracebacks(), self.tail(len(self.lines))

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(30)
        self._reading.join(10)
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._reading.join(10)


def runs_a_task(url: str) -> None:
    """A task sent to ``url``'s scheduler runs (a ``serve`` of it serves it) within 60 s."""
    broker = Broker(url, timers=False)
    try:
        report = TaskScheduler(broker).run_waves([[Task.sql("SELECT 1")]], timeout=60)
        assert report.ok, report.completions
    finally:
        broker.close()


def init_by_hand(url: str) -> None:
    """``scheduler-lib init --db URL`` as a user runs it, in a process of its own."""
    made = subprocess.run(
        [str(SCHEDULER_LIB), "init", "--db", url], capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stdout + made.stderr
