"""Worker functions for the poison-message tests (``test_poison.py``), importable by
name so ``multiprocessing`` can start them with ``spawn``.

Each reports once on its ``results`` queue, as in ``process_workers``: ``("ok", pid,
payload)`` or ``("error", pid, traceback)``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from scheduler_lib.broker import Broker


def take_and_hang(url: str, queue: str, lease: float, results: Any) -> None:
    """Take one message under a lease, keep the lease alive and work "forever": the test
    kills this process with SIGKILL in the middle of the work."""
    try:
        with Broker(url, migrate=False, timers=False) as broker:
            leases = broker.take(queue, timeout=30, lease=lease)
            if not leases:
                raise AssertionError(f"nothing to take from {queue} within 30 s")
            with broker.keep_alive(leases):
                results.put(("ok", os.getpid(), leases[0].lease_id))
                time.sleep(300)  # the long task, killed halfway
    except BaseException:
        results.put(("error", os.getpid(), traceback.format_exc()))
