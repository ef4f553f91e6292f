"""The Celery app of the peer benchmark: Redis broker and result backend, one no-op task.

The worker is Celery's own, started by the harness as
``python -m celery -A bench.peers.celery_app worker --pool prefork --concurrency 4 ...``;
the broker and backend URL come from ``BENCH_CELERY_REDIS`` (a Redis database the harness
picked empty and flushes afterwards). The settings, and why, are in ``CONFIG``.
"""

from __future__ import annotations

import os
import time

from celery import Celery

REDIS_URL = os.environ.get("BENCH_CELERY_REDIS", "redis://127.0.0.1:6379/15")
QUEUE = "bench"

# Chosen for speed with correctness (every task runs once, every result is stored):
# acks early (Celery's default; acks_late adds one more Redis round trip per task and
# only matters when a worker dies mid-task, which no workload here does); prefetch
# multiplier from BENCH_CELERY_PREFETCH (default 1: with waves of 50 tasks on 4 children a
# child that prefetches holds tasks others could run; the harness runs Celery at 1 and, as
# the system celery_p4, at 4); results in Redis, expiring after a day (Celery's default).
CONFIG = {
    "broker_url": REDIS_URL,
    "result_backend": REDIS_URL,
    "task_default_queue": QUEUE,
    "task_acks_late": False,
    "worker_prefetch_multiplier": int(os.environ.get("BENCH_CELERY_PREFETCH", "1")),
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_expires": 86400,
    "worker_hijack_root_logger": False,
    "broker_connection_retry_on_startup": True,
}

app = Celery("bench_peers")
app.conf.update(CONFIG)


@app.task(name="noop")
def noop(tag: str) -> list[object]:
    """The trivial task: its tag and when it started and ended (``time.time()``)."""
    start = time.time()
    return [tag, start, time.time()]
