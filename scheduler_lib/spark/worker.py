"""The Spark worker: a Spark driver process serving a target queue.

Readers are threads of the driver, started by internal activation (at most
``max_readers`` in this driver), sharing one SparkSession. When the queue needs more
readers than one driver allows, the queue monitor's ``QUEUE_ACTIVATION`` events make the
worker start another worker application with a configurable command (``spark-submit …``)
— external activation — up to ``max_launched`` of them; launched workers leave when their
queue has been idle for a while. A launching worker drops its subscription to those events
when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import Broker, activation
from scheduler_lib.broker.exceptions import (
    AlreadyExists,
    BrokerError,
    InvalidArgument,
    NotFound,
)
from scheduler_lib.broker.launcher import ACTIVATED_QUEUE_ENV, Launcher
from scheduler_lib.scheduler import catalog
from scheduler_lib.scheduler.executor import Executor
from scheduler_lib.spark import kinds, session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

PROCEDURE = "scheduler_lib.spark.worker:serve"  # the Spark target queue's activation procedure
KINDS = (*kinds.NAMES, "sql", "python")  # what a Spark target runs by default
MAX_READERS = 4
LAUNCHED_IDLE_EXIT = 30.0  # seconds a launched worker stays with nothing to do
# Seconds between activation checks, and the "readers are all busy" grace. Shorter than
# a plain runtime's: a reader here is a thread on a session that is already up, so a
# wave of tasks gets its readers within about a second instead of one every few seconds.
ACTIVATION_INTERVAL = 0.25


def serve(broker: Broker, queue: str) -> None:
    """The activation procedure of a Spark target queue: an executor whose tasks run on
    this driver's SparkSession, and whose ``worker_id`` names the Spark application.

    :raises NoSparkSession: in a process that is not a Spark worker
    """
    spark = session.current()
    application, ui_url = session.identity(spark)
    host, pid = socket.gethostname(), os.getpid()

    def worker() -> str:  # host:process:reader:application — the blog's SPID, for Spark
        return f"{host}:{pid}:{threading.current_thread().name}:{application}"

    Executor(broker, queue, worker=worker, spark_application=(application, ui_url)).serve()


class Worker:
    """A Spark driver serving one target queue.

    :param broker: the broker the target queue lives on
    :param service: the target service (made a Spark target by :meth:`start` with
        ``init``; its allowed kinds become ``kinds``)
    :param queue: the target queue
    :param master: Spark master (default: what ``spark-submit`` set, else ``local[*]``)
    :param conf: Spark settings on top of the worker's (FAIR pools per priority)
    :param max_readers: most readers (tasks at once) in this driver
    :param queue_readers: most readers of the queue in all its workers together (the
        queue's ``max_queue_readers``, written with ``init``); default ``max_readers``
        times the workers this one may launch, plus one. Several workers on one queue need
        it: each would otherwise cap the whole queue at its own ``max_readers``
    :param spark: an existing session to use instead of building one (tests, notebooks)
    :param init: make the target (catalog, activation, allowed kinds) on start; launched
        workers skip it
    :param launch_command: argv that starts one more worker application when this driver
        is full and the queue still needs readers (external activation)
    :param max_launched: most launched workers running at once
    :param idle_exit: leave after this many seconds without a running reader (launched
        workers); ``None`` runs until stopped
    """

    def __init__(
        self,
        broker: Broker,
        *,
        service: str = catalog.Target.service,
        queue: str = catalog.Target.queue,
        master: str | None = None,
        conf: Mapping[str, str] | None = None,
        max_readers: int = MAX_READERS,
        queue_readers: int | None = None,
        kinds: Sequence[str] = KINDS,
        spark: SparkSession | None = None,
        init: bool = True,
        launch_command: Sequence[str] | None = None,
        max_launched: int = 1,
        idle_exit: float | None = None,
        app_name: str = session.APP_NAME,
    ) -> None:
        for value, what in (
            (max_readers, "max_readers"),
            (max_launched, "max_launched"),
            (1 if queue_readers is None else queue_readers, "queue_readers"),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{what} must be an integer >= 1, got {value!r}")
        if idle_exit is not None and idle_exit <= 0:
            raise InvalidArgument(f"idle_exit must be > 0 seconds, got {idle_exit!r}")
        if launch_command is not None and (isinstance(launch_command, str) or not launch_command):
            raise InvalidArgument(
                f"launch_command must be a non-empty argv list, got {launch_command!r}"
            )
        self.broker = broker
        self.service = service
        self.queue = queue
        self.master = master
        self.conf = dict(conf or {})
        self.max_readers = max_readers
        self.queue_readers = queue_readers
        self.kinds = tuple(kinds)
        self.init = init
        self.launch_command = list(launch_command) if launch_command else None
        self.max_launched = max_launched
        self.idle_exit = idle_exit
        self.app_name = app_name
        self.spark = spark
        self._own_session = spark is None
        self.runtime: activation.ActivationRuntime | None = None
        self.launcher: Launcher | None = None
        self._subscribed = False  # this worker made (or joined) the launch set-up
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> Worker:
        """Build the session, make the target, start activation (and the launcher)."""
        kinds.register()
        if self.spark is None:
            self.spark = session.build(self.master, self.conf, self.app_name)
            _warm_up(self.spark, self.max_readers)
        else:
            session.use(self.spark)
        catalog.prepare(self.broker)
        if self.init:
            readers = self.queue_readers or self.max_readers * (
                1 + (self.max_launched if self.launch_command else 0)
            )
            catalog.init(
                self.broker,
                targets=[
                    catalog.Target(
                        service=self.service,
                        queue=self.queue,
                        kinds=self.kinds,
                        max_readers=readers,
                        procedure=PROCEDURE,
                    )
                ],
            )
        self.runtime = activation.ActivationRuntime(
            self.broker,
            queues={self.queue},
            reader_cap=self.max_readers,
            check_interval=ACTIVATION_INTERVAL,
            empty_grace=ACTIVATION_INTERVAL,
            idle_check_interval=activation.CHECK_INTERVAL,
        ).start()
        if self.launch_command:
            self.launcher = Launcher(
                self.broker,
                self._subscribe(),
                self.launch_command,
                max_processes=self.max_launched,
                should_launch=self._full,
                # another launching worker of this queue drops the shared set-up when it
                # stops: this one makes it again
                resubscribe=self._subscribe,
            )
            self._subscribed = True
            thread = threading.Thread(
                target=self.launcher.run, args=(self._stop,), name="worker-launcher", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        log.info(
            "Spark worker serving %s: application %s, master %s, %d reader(s)",
            self.queue,
            self.application_id,
            self.spark.sparkContext.master,
            self.max_readers,
        )
        return self

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set, or until idle for ``idle_exit`` seconds."""
        if self.runtime is None:
            self.start()
        idle_since = time.monotonic()
        while not self._stop.is_set() and not (stop is not None and stop.is_set()):
            if self.spark is not None and session.stopped(self.spark):
                log.warning("the SparkContext stopped (or its JVM died): the worker leaves")
                break
            if self.runtime is not None and self.runtime.readers_of(self.queue):
                idle_since = time.monotonic()
            elif self.idle_exit is not None and time.monotonic() - idle_since >= self.idle_exit:
                log.info("Spark worker on %s idle for %s s: leaving", self.queue, self.idle_exit)
                break
            (stop or self._stop).wait(0.5)
        self.stop()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop activating, let running tasks finish (up to ``timeout``), drop the launch
        set-up, stop launched workers and, when this worker built it, the session."""
        self._stop.set()
        if self.runtime is not None:
            self.runtime.stop(timeout)
            self.runtime = None
        for thread in self._threads:
            thread.join(timeout=5)
        if self._subscribed:
            # After the launcher thread: it would make the set-up again. Once only: a
            # second stop() would drop the set-up another worker has made since.
            self._subscribed = False
            self._unsubscribe()
        if self.launcher is not None:
            for process in self.launcher.processes:
                if process.poll() is None:
                    process.terminate()
            for process in self.launcher.processes:
                with contextlib.suppress(Exception):
                    process.wait(timeout=30)
        if self.spark is not None and self._own_session:
            with contextlib.suppress(Exception):  # its JVM may be gone already
                self.spark.stop()
            session.use(None)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- facts -----------------------------------------------------------------------

    @property
    def application_id(self) -> str | None:
        return None if self.spark is None else self.spark.sparkContext.applicationId

    @property
    def ui_url(self) -> str | None:
        return None if self.spark is None else self.spark.sparkContext.uiWebUrl

    # --- external activation ---------------------------------------------------------

    def _full(self) -> bool:
        """Whether this driver runs all the readers it may (only then launch another)."""
        runtime = self.runtime
        return runtime is not None and runtime.readers_of(self.queue) >= self.max_readers

    def _launch_setup(self) -> tuple[str, str, str]:
        """The names of the launch set-up: the queue and service that receive the target
        queue's ``QUEUE_ACTIVATION`` events, and the event notification that sends them."""
        return f"{self.queue}Launcher", f"{self.service}Launcher", f"{self.queue}Workers"

    def _subscribe(self) -> str:
        """Make what is missing of the launch set-up (shared by the launching workers of
        this queue); also the launcher's ``resubscribe``.

        :return: the queue the events arrive on
        """
        events_queue, events_service, notification = self._launch_setup()
        queues = {q.name for q in self.broker.queues()}
        services = {s["service_name"] for s in self.broker.services()}
        with contextlib.suppress(AlreadyExists):
            if events_queue not in queues:
                self.broker.create_queue(events_queue)
        with contextlib.suppress(AlreadyExists):
            if events_service not in services:
                self.broker.create_service(events_service, events_queue, ["PostEventNotification"])
        notifications = {n["notification_name"] for n in self.broker.event_notifications()}
        with contextlib.suppress(AlreadyExists):
            if notification not in notifications:
                self.broker.create_event_notification(notification, self.queue, events_service)
        return events_queue

    def _unsubscribe(self) -> None:
        """Drop the launch set-up: the event notification, the service, then the queue.
        Left behind, the queue monitor would post events that nobody reads, and they
        would pile up. Other launching workers of this queue make it again (their
        launcher's ``resubscribe``).

        One transaction: nobody sees half of it gone. What is gone already (another
        worker dropped it) is skipped; an error leaves it all, with a warning, and does
        not stop the rest of :meth:`stop`.
        """
        events_queue, events_service, notification = self._launch_setup()
        try:
            with self.broker.transaction() as tx:
                with contextlib.suppress(NotFound):
                    tx.drop_event_notification(notification)
                # Dropping the notification leaves its event dialog, and a service with
                # conversations can't be dropped. End both endpoints with cleanup (nobody
                # is left to answer an EndDialog); the unread events go with them, so the
                # queue is empty when it is dropped.
                for endpoint in tx.conversation_endpoints():
                    if events_service in (endpoint.service_name, endpoint.far_service_name):
                        with contextlib.suppress(NotFound):
                            tx.end_conversation(endpoint.conversation_handle, cleanup=True)
                with contextlib.suppress(NotFound):
                    tx.drop_service(events_service)
                with contextlib.suppress(NotFound):
                    tx.drop_queue(events_queue)
        except BrokerError as error:
            log.warning("could not drop the launch set-up of %s: %s", self.queue, error)


def launch_command(
    db: str,
    *,
    service: str,
    queue: str,
    master: str | None,
    max_readers: int,
    conf: Mapping[str, str],
    idle_exit: float = LAUNCHED_IDLE_EXIT,
) -> list[str]:
    """The default command for launched workers: this Python, ``scheduler-lib worker``
    with the same settings, no ``init``, leaving when idle."""
    argv = [sys.executable, "-m", "scheduler_lib.cli", "worker", "--db", db]
    argv += ["--service", service, "--queue", queue, "--max-readers", str(max_readers)]
    argv += ["--no-init", "--idle-exit", str(idle_exit)]
    if master:
        argv += ["--master", master]
    for key, value in conf.items():
        argv += ["--conf", f"{key}={value}"]
    return argv


def launched_by_activation() -> bool:
    """Whether this process was started by a worker's launcher (external activation)."""
    return bool(os.environ.get(ACTIVATED_QUEUE_ENV))


def split_command(command: str) -> list[str]:
    """A launch command given as one string (``--launch-command``), split as a shell
    would, without running one."""
    argv = shlex.split(command)
    if not argv:
        raise InvalidArgument("--launch-command is empty")
    return argv


def _warm_up(spark: Any, readers: int) -> None:
    """Run a few small jobs before serving, ``readers`` at once: a new JVM's first Spark
    SQL statements spend seconds loading classes and generating code, which would
    otherwise land on the first wave's tasks (the blog's first wave took 3.3 s for 0.5 s
    tasks on a cold worker)."""
    started = time.monotonic()

    def statement() -> None:
        spark.sql("SELECT count(*), max(id) FROM range(0, 1000, 1, 2) WHERE id % 7 = 3").collect()
        spark.sql("SELECT java_method('java.lang.Math', 'abs', CAST(-1 AS INT))").collect()

    statement()
    threads = [threading.Thread(target=statement) for _ in range(max(1, readers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.info("Spark session warmed up in %.1f s", time.monotonic() - started)
