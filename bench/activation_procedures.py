"""Activation procedures for the benchmarks (importable as ``bench.activation_procedures``).

``record_receives`` is what ``bench.activation_latency`` activates: it receives one message
at a time with a short timeout and, for every message, appends one JSON line to the file
named by :data:`OUT_PATH` (or the ``BENCH_ACTIVATION_OUT`` environment variable) with the
instant the receive returned (``time.monotonic()``, system-wide CLOCK_MONOTONIC on Linux),
the message body and whatever the hosting process put in :data:`STAMPS`. It returns, and
so the reader exits, after a receive came back empty.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

RECEIVE_TIMEOUT = 0.2  # seconds a reader waits for another message before it exits
OUT_PATH: str | None = None  # set by the hosting process; else BENCH_ACTIVATION_OUT
STAMPS: dict[str, Any] = {}  # instants the hosting runtime recorded for the current reader
_write_lock = threading.Lock()


def record_receives(broker: Any, queue: str) -> None:
    """Receive until the queue stays empty for :data:`RECEIVE_TIMEOUT`; record each one."""
    entered = time.monotonic()
    path = OUT_PATH or os.environ.get("BENCH_ACTIVATION_OUT")
    if not path:
        raise RuntimeError("record_receives: set OUT_PATH or BENCH_ACTIVATION_OUT")
    first = True
    while True:
        called = time.monotonic()
        messages = broker.receive(queue, top=1, timeout=RECEIVE_TIMEOUT)
        received = time.monotonic()
        if not messages:
            return
        record = {
            "body": (messages[0].body or b"").decode(),
            "received": received,
            "receive_called": called,
            "procedure_entered": entered if first else None,
            "pid": os.getpid(),
            "stamps": dict(STAMPS) if first else {},
        }
        first = False
        with _write_lock, open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
