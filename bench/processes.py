"""The documented long-running commands (``scheduler-lib serve``, ``scheduler-lib worker``)
in processes of their own, for the tests and the benchmarks that drive them::

    init(url)                                            # scheduler-lib init --db URL
    with Processes(workdir) as processes:                # all stopped when the block ends
        serve = processes.start("serve", "serve", "--db", url)
        processes.wait_monitored(serve, url, timeout=60)  # its queue monitor exists
        worker = processes.start("worker", "worker", "--db", url, "--master", "local[2]")
        processes.wait_said(worker, "worker serving", timeout=180)

Each process writes its output to ``<name>.out`` and ``<name>.err`` in the folder. A stop
is what the documentation says, SIGTERM, then SIGKILL after ``STOP_GRACE``; whatever a
stopped or killed process had started and left running (a Spark driver's JVM) is killed
by pid. Every wait polls a condition with a deadline (:func:`wait_for`) and fails fast,
with the process's output, when the process exited. Failures raise :class:`HarnessError`.
Only the standard library, and the broker to see a queue monitor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from scheduler_lib.broker import Broker

T = TypeVar("T")

CLI = str(Path(sys.executable).parent / "scheduler-lib")  # installed next to python
TARGET_QUEUE = "QueueAsyncTarget"  # the default target's queue (``scheduler-lib init``)
POLL = 0.05  # seconds between two looks of wait_for
STOP_GRACE = 60.0  # seconds a process has to exit after SIGTERM before SIGKILL
KILL_WAIT = 30.0  # seconds for a SIGKILLed process to be reaped
OUTPUT_TAIL = 3000  # characters of each of a process's files shown in a failure


class HarnessError(RuntimeError):
    """The harness failed: a process died, a deadline passed, or a call failed."""


def wait_for(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    *,
    check: Callable[[], None] | None = None,
    explain: Callable[[], object] | None = None,
    interval: float = POLL,
) -> T:
    """Re-evaluate ``condition`` until it is truthy and return its value; ``check`` raises
    when something it depends on died; :class:`HarnessError` after ``timeout`` seconds.

    :param condition: evaluated every ``interval`` seconds
    :param timeout: seconds before giving up
    :param what: what is awaited, for the error message
    :param check: called before each look (e.g. :meth:`Processes.check_alive`)
    :param explain: called on a timeout: what things look like then, for the message
    :param interval: seconds between looks
    """
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = "" if explain is None else f"; {explain()}"
            raise HarnessError(f"{what}: not within {timeout} s{seen}")
        time.sleep(interval)


def init(url: str, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> None:
    """``scheduler-lib init --db URL``: the broker, the scheduler, the default target.

    :raises HarnessError: with its error output, when it fails
    """
    result = subprocess.run(
        [CLI, "init", "--db", url],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )
    if result.returncode != 0:
        raise HarnessError(f"scheduler-lib init exited with {result.returncode}:\n{result.stderr}")


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Processes:
    """The ``scheduler-lib`` commands a test or a benchmark starts, each with its output
    in files of ``directory``; all stopped on :meth:`close` or when the ``with`` block
    ends (SIGTERM, then SIGKILL), with whatever they started.

    :param directory: the folder of the output files (``<name>.out``, ``<name>.err``)
    :param env: the processes' whole environment (default: this process's)
    """

    def __init__(self, directory: Path, env: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self.env = None if env is None else dict(env)
        self.names: dict[subprocess.Popen[bytes], str] = {}  # every process started
        self.strays: set[int] = set()  # descendants of stopped or killed processes

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, name: str, *args: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """``scheduler-lib ARGS...``, its output to ``<name>.out`` and ``<name>.err``.

        :param name: the process's name in messages and its files'
        :param cwd: its working directory (default: this process's)
        """
        if name in self.names.values():
            raise HarnessError(f"a process named {name!r} was started already")
        out, err = self._files(name)
        with out.open("wb") as stdout, err.open("wb") as stderr:  # the child has its own
            process = subprocess.Popen(
                [CLI, *args], stdout=stdout, stderr=stderr, env=self.env, cwd=cwd
            )
        self.names[process] = name
        return process

    def stdout(self, process: subprocess.Popen[bytes]) -> str:
        """Everything ``process`` wrote to its standard output so far."""
        return self._files(self.names[process])[0].read_text(errors="replace")

    def output(self, process: subprocess.Popen[bytes]) -> str:
        """The tails of its output and errors, for a message."""
        out, err = (path.read_text(errors="replace") for path in self._files(self.names[process]))
        return f"stdout:\n{out[-OUTPUT_TAIL:]}\nstderr:\n{err[-OUTPUT_TAIL:]}"

    def check_alive(self, process: subprocess.Popen[bytes]) -> None:
        """Raise :class:`HarnessError` with its output if ``process`` has exited."""
        if process.poll() is not None:
            name = self.names[process]
            raise HarnessError(f"{name} exited with {process.returncode}:\n{self.output(process)}")

    def wait_said(self, process: subprocess.Popen[bytes], text: str, timeout: float) -> None:
        """Until ``process`` has written ``text`` (its "serving ..." line, say)."""
        files = self._files(self.names[process])
        wait_for(
            lambda: any(text in path.read_text(errors="replace") for path in files),
            timeout,
            f"{self.names[process]} to say {text!r}",
            check=lambda: self.check_alive(process),
        )

    def wait_monitored(
        self,
        process: subprocess.Popen[bytes],
        url: str,
        timeout: float,
        *,
        queue: str = TARGET_QUEUE,
        since: float | None = None,
    ) -> None:
        """Until ``process`` serves ``queue`` of the broker at ``url``: a queue monitor of
        it exists (updated at ``since`` or later, when given: epoch seconds)."""

        def monitored() -> bool:
            return any(
                m["queue_name"] == queue and (since is None or float(m["updated_at"]) >= since)
                for m in broker.queue_monitors()
            )

        with Broker(url, timers=False) as broker:
            wait_for(
                monitored,
                timeout,
                f"{self.names[process]} to monitor {queue}",
                check=lambda: self.check_alive(process),
            )

    def kill(self, process: subprocess.Popen[bytes]) -> list[int]:
        """SIGKILL, as ``kill -9`` or the OOM killer would; reaped at once. Returns the
        descendants it had (a Spark driver's JVM), killed at :meth:`close` if they linger."""
        found = descendants(process.pid)
        self.strays.update(found)
        process.kill()
        process.wait(KILL_WAIT)
        return found

    def close(self) -> None:
        """SIGTERM to every process still running, SIGKILL to those still running after
        ``STOP_GRACE``, then to whatever they had started that is still alive."""
        for process in self.names:
            if process.poll() is None:
                self.strays.update(descendants(process.pid))
                process.send_signal(signal.SIGTERM)
        for process in self.names:
            try:
                process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(KILL_WAIT)
        for pid in self.strays:  # only pids our own processes started
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.strays.clear()

    def _files(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"{name}.out", self.directory / f"{name}.err"
