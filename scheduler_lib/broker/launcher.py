"""External activation's other half: a launcher that consumes ``QUEUE_ACTIVATION`` events
and starts a configurable command for each, up to a cap (the Spark issue uses it to start
more Spark applications)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker.ops import catalog

if TYPE_CHECKING:
    from scheduler_lib.broker import broker as brokers

log = logging.getLogger(__name__)

ACTIVATED_QUEUE_ENV = "SCHEDULER_LIB_ACTIVATED_QUEUE"  # tells the command which queue to read
RECEIVE_TIMEOUT = 1.0  # seconds a launcher waits for events per round
# Seconds between checks that the subscription is whole, when a ``resubscribe`` is given:
# a notification dropped alone leaves the queue there but silent, which RECEIVE can't tell.
RESUBSCRIBE_INTERVAL = 30.0


class Launcher:
    """Start ``command`` once per ``QUEUE_ACTIVATION`` event received on ``queue``, while
    fewer than ``max_processes`` of the processes it started are still running.

    Events that arrive while the cap is reached are consumed and dropped: the queue
    monitor posts again if activation is still needed once a RECEIVE happened on the
    activated queue or its notification timeout passed.

    :param broker: the broker the subscriber queue lives on
    :param queue: the subscriber's queue (the event notification's ``to_service``'s queue)
    :param command: argv of the program to start; it gets ``SCHEDULER_LIB_ACTIVATED_QUEUE``
    :param max_processes: most started processes running at once
    :param should_launch: asked before each start; ``False`` drops the event (e.g. a
        Spark worker that can still add readers of its own)
    :param resubscribe: makes the subscription again (whatever part of it is missing) and
        returns the queue to receive from. Subscribers that share a subscription drop it
        when they leave, so :meth:`run` calls it when RECEIVE finds the queue gone, each
        round until it succeeds, and every ``RESUBSCRIBE_INTERVAL`` seconds. Without it, a
        queue that is gone ends :meth:`run` with ``QueueNotFound``
    """

    def __init__(
        self,
        broker: brokers.Broker,
        queue: str,
        command: Sequence[str],
        *,
        max_processes: int = 1,
        env: Mapping[str, str] | None = None,
        should_launch: Callable[[], bool] | None = None,
        resubscribe: Callable[[], str] | None = None,
    ) -> None:
        if not command:
            raise exceptions.InvalidArgument("the launcher needs a command to start")
        if (
            isinstance(max_processes, bool)
            or not isinstance(max_processes, int)
            or max_processes < 1
        ):
            raise exceptions.InvalidArgument(
                f"max_processes must be an integer >= 1, got {max_processes!r}"
            )
        self.broker = broker
        self.queue = queue
        self.command = list(command)
        self.max_processes = max_processes
        self.env = dict(env or {})
        self.should_launch = should_launch
        self.resubscribe = resubscribe
        self.processes: list[subprocess.Popen[bytes]] = []
        self.events_seen = 0

    @property
    def running(self) -> int:
        """Started processes still running."""
        self.processes = [p for p in self.processes if p.poll() is None]
        return len(self.processes)

    def run_once(self, timeout: float = RECEIVE_TIMEOUT) -> int:
        """Receive the events that are there (waiting up to ``timeout``) and act on them.

        :return: how many processes were started
        """
        started = 0
        with self.broker.transaction() as tx:
            for message in tx.receive(self.queue, top=100, timeout=timeout):
                if message.message_type_name in (models.END_DIALOG, models.ERROR):
                    tx.end_conversation(message.conversation_handle)
                    continue
                if message.message_type_name != catalog.EVENT_MESSAGE_TYPE:
                    log.warning(
                        "launcher on %s: ignoring %s", self.queue, message.message_type_name
                    )
                    continue
                event = json.loads(message.body or b"{}")
                if event.get("EventType") != "QUEUE_ACTIVATION":
                    continue
                self.events_seen += 1
                if self.running >= self.max_processes:
                    log.info("launcher on %s: %d running, cap reached", self.queue, self.running)
                    continue
                if self.should_launch is not None and not self.should_launch():
                    continue
                env = {**os.environ, **self.env, ACTIVATED_QUEUE_ENV: str(event.get("ObjectName"))}
                self.processes.append(subprocess.Popen(self.command, env=env))
                started += 1
        return started

    def run(self, stop: threading.Event) -> None:
        """Act on events until ``stop`` is set (making the subscription again when it is
        gone, with ``resubscribe``)."""
        lost = False
        checked = time.monotonic()
        while not stop.is_set():
            if self.resubscribe is not None and (
                lost or time.monotonic() - checked >= RESUBSCRIBE_INTERVAL
            ):
                checked = time.monotonic()
                lost = not self._subscribe_again()
                if lost:
                    stop.wait(RECEIVE_TIMEOUT)  # the next round tries again
                    continue
            try:
                self.run_once()
            except exceptions.QueueNotFound:
                if self.resubscribe is None:
                    raise
                log.info("launcher: queue %s is gone, subscribing again", self.queue)
                lost = True

    def _subscribe_again(self) -> bool:
        """Call ``resubscribe`` and receive from the queue it returns.

        :return: whether it succeeded (it races with subscribers dropping the subscription,
            and with the database)
        """
        assert self.resubscribe is not None
        try:
            self.queue = self.resubscribe()
        except exceptions.BrokerError as error:
            log.warning(
                "launcher on %s: could not subscribe again, retrying: %s", self.queue, error
            )
            return False
        return True
