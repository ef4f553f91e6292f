"""Activation procedures for the activation tests (``test_activation.py``).

They live in an importable module because queues name them by dotted path
(``activation_procedures.reader``), and reader processes (``reader_mode="process"``,
``scheduler-lib serve``) import them in a fresh interpreter.

:func:`reader` is what an activated stored procedure usually is: it loops
``WAITFOR (RECEIVE TOP (1) ...), TIMEOUT t`` in a transaction and returns when a receive
times out. Each message's body is JSON and says how to handle it:

- ``n``: an id the reader records;
- ``hold``: ``"tx"`` works while the transaction (and so the conversation group lock) is
  held, ``"after"`` works after the commit;
- ``work``: the work takes this many seconds at most; it ends early once :data:`GATE` is
  set (threads) or ``gate_file`` exists (processes); without ``work`` it waits for those
  (capped at :data:`MAX_HOLD`);
- ``out_file``: append ``"<pid> <n>"`` to this file when done (readers in other processes);
- ``pid_file``: write the reader's pid to this file when it takes the message;
- ``raise``: raise after the commit (a procedure that fails).

Readers in this process record what they do in :data:`EVENTS`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

RECEIVE_TIMEOUT_ENV = "ACTIVATION_TEST_RECEIVE_TIMEOUT"
DEFAULT_RECEIVE_TIMEOUT = 0.3  # seconds a reader waits for a message before it exits
MAX_HOLD = 20.0  # seconds; a held message never blocks a reader longer than this
GATE_POLL = 0.01  # seconds between looks for a gate file

GATE = threading.Event()  # set: held work ends at once
RECEIVE_TIMEOUT: float | None = None  # overrides the environment for thread readers
EVENTS: list[dict[str, Any]] = []  # what readers in this process did, in order
_lock = threading.Lock()


class ProcedureFailed(RuntimeError):
    """What a procedure raises when a message asks it to."""


def reset() -> None:
    """Forget what earlier tests did (called before and after each test)."""
    global RECEIVE_TIMEOUT
    GATE.clear()
    RECEIVE_TIMEOUT = None
    with _lock:
        EVENTS.clear()


def record(event: str, **fields: Any) -> None:
    with _lock:
        EVENTS.append(
            {
                "event": event,
                "thread": threading.get_ident(),
                "pid": os.getpid(),
                "at": time.monotonic(),
                **fields,
            }
        )


def events(kind: str | None = None) -> list[dict[str, Any]]:
    """A copy of the recorded events, all or of one kind."""
    with _lock:
        return [e for e in EVENTS if kind is None or e["event"] == kind]


def _receive_timeout() -> float:
    if RECEIVE_TIMEOUT is not None:
        return RECEIVE_TIMEOUT
    return float(os.environ.get(RECEIVE_TIMEOUT_ENV, DEFAULT_RECEIVE_TIMEOUT))


def _hold(spec: dict[str, Any]) -> None:
    limit = min(float(spec.get("work", MAX_HOLD)), MAX_HOLD)
    gate_file = spec.get("gate_file")
    if gate_file is None:
        GATE.wait(limit)
        return
    deadline = time.monotonic() + limit
    while not os.path.exists(gate_file) and time.monotonic() < deadline:
        time.sleep(GATE_POLL)


def _handle(spec: dict[str, Any], when: str) -> None:
    if spec.get("hold") == when:
        _hold(spec)


def reader(broker: Any, queue: str) -> None:
    """Receive one message at a time until a receive times out."""
    record("enter", queue=queue)
    timeout = _receive_timeout()
    while True:
        with broker.transaction() as tx:
            messages = tx.receive(queue, top=1, timeout=timeout)
            if not messages:
                break
            message = messages[0]
            spec = json.loads(message.body or b"{}")
            record("start", n=spec.get("n"), conversation=str(message.conversation_handle))
            if spec.get("pid_file") is not None:
                with open(spec["pid_file"], "w", encoding="utf-8") as pid_file:
                    pid_file.write(str(os.getpid()))
            _handle(spec, "tx")
        # "start" is recorded before the RECEIVE commits; what others see of the queue
        # (messages ready, the monitor) changes only with "taken".
        record("taken", n=spec.get("n"))
        _handle(spec, "after")
        out_file = spec.get("out_file")
        if out_file is not None:
            with open(out_file, "a", encoding="utf-8") as out:
                out.write(f"{os.getpid()} {spec.get('n')}\n")
        record("done", n=spec.get("n"))
        if spec.get("raise"):
            record("raise", n=spec.get("n"))
            raise ProcedureFailed(f"message {spec.get('n')} asked the procedure to fail")
    record("exit", queue=queue)
