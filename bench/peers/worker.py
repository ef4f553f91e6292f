"""The worker side of the peer benchmark, one process per system and measurement.

    python -m bench.peers.worker '{"system": "ours", "role": "tasks", "url": ..., "out": ...}'

The harness starts it (``bench.peers.systems.WorkerProcess``), waits for ``READY`` on its
stdout, and stops it with SIGTERM; the worker then writes what its handlers recorded to
``out`` (JSON: ``{"records": [[tag, start, end], ...]}``, times from ``time.time()``) and
exits. Handlers stay trivial: they append to a list in memory, nothing else.

Roles: ``queue`` (workload 1: consume messages, ``top`` at a time, with ``concurrency``
consumers) and ``tasks`` (workloads 2 and 3: run trivial tasks with ``concurrency``
workers). Celery is not here: its worker is Celery's own (``bench.peers.celery_app``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

Record = list[Any]  # [tag, start, end]

TARGET_QUEUE = "BenchTargetQueue"  # the broker-level queue of workload 1 (bench.broker_throughput)
TASK_QUEUE = "QueueAsyncTarget"  # the scheduler's target queue
RAW_EMPTY_WAIT = 0.5  # seconds: a raw consumer's longest wait for a NOTIFY on an empty table
# The ceiling's dequeue: ``top`` rows, the oldest first, that no other consumer holds.
RAW_DELETE = (
    "DELETE FROM bench_raw WHERE id IN (SELECT id FROM bench_raw ORDER BY id LIMIT %s "
    "FOR UPDATE SKIP LOCKED) RETURNING body"
)


def tag_of(body: bytes | str) -> str:
    """The tag a producer put at the front of a 100-byte body (up to the first ``|``)."""
    text = body.decode() if isinstance(body, bytes) else body
    return text.split("|", 1)[0]


# --- ours ------------------------------------------------------------------------------


def ours_worker(
    url: str, readers: int, stop: threading.Event, *, role: str = "tasks", top: int = 1
) -> list[Record]:
    """Our worker side. This is the one place that decides how our workers are hosted.

    ``role="tasks"``: ``readers`` threads of ``Executor(broker, "QueueAsyncTarget",
    idle_timeout=3600).serve`` on one broker in this process, as bench/scheduler_loop.py
    and ``scheduler-lib serve`` do; the tasks they run (``bench.peers.handlers.noop``)
    record themselves, inside the handler, as the peers' do. ``role="queue"``: ``readers``
    consumer threads, each looping over ``with broker.transaction() as tx:
    tx.receive(queue, top=top, timeout=0.5)`` and recording every message's tag after the
    commit.

    Returns when ``stop`` is set and the threads have finished.
    """
    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import Executor

    records: list[Record] = []
    lock = threading.Lock()
    with Broker(url, migrate=False, timers=True) as broker:

        def consume() -> None:
            while not stop.is_set():
                with broker.transaction() as tx:
                    got = tx.receive(TARGET_QUEUE, top=top, timeout=0.5)
                    tags = [tag_of(m.body) for m in got]
                done = time.time()
                if tags:
                    with lock:
                        records.extend([t, done, done] for t in tags)

        if role == "tasks":
            targets = [
                Executor(broker, TASK_QUEUE, idle_timeout=3600).serve for _ in range(readers)
            ]
            args: tuple[Any, ...] = (stop,)
        else:
            targets = [consume] * readers
            args = ()
        threads = [
            threading.Thread(target=t, args=args, name=f"reader-{i}", daemon=True)
            for i, t in enumerate(targets)
        ]
        for thread in threads:
            thread.start()
        ready()
        stop.wait()
        for thread in threads:
            thread.join(30)
    if role == "tasks":
        from bench.peers import handlers

        return list(handlers.RECORDS)
    return records


# --- raw -------------------------------------------------------------------------------


def raw_worker(url: str, consumers: int, stop: threading.Event, top: int) -> list[Record]:
    """The ceiling: ``consumers`` threads, each on its own autocommit connection, looping
    over one ``DELETE ... FOR UPDATE SKIP LOCKED LIMIT top`` per transaction; on an empty
    table each waits for the NOTIFY of the next insert on its own connection (LISTENed
    before its first DELETE, so none is missed: the server queues it for the session),
    the best wake-up a PostgreSQL consumer has, as every system here gets one. (It polled
    with a 1-20 ms back-off before issue 24: at batch 100 the whole run lasts ~64 ms, and
    the back-off was a large share of it.)"""
    import psycopg

    records: list[Record] = []
    lock = threading.Lock()

    def consume() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("LISTEN bench_raw")
            while not stop.is_set():
                rows = conn.execute(RAW_DELETE, (top,)).fetchall()
                done = time.time()
                if not rows:
                    for _ in conn.notifies(timeout=RAW_EMPTY_WAIT, stop_after=1):
                        pass
                    continue
                with lock:
                    records.extend([tag_of(bytes(r[0])), done, done] for r in rows)

    consumed_by(consume, consumers, stop)
    return records


def consumed_by(consume: Any, consumers: int, stop: threading.Event) -> None:
    """``consumers`` threads of ``consume``, READY once started; returns when ``stop`` is
    set and they have finished."""
    threads = [threading.Thread(target=consume, daemon=True) for _ in range(consumers)]
    for thread in threads:
        thread.start()
    ready()
    stop.wait()
    for thread in threads:
        thread.join(30)


RAW_REDIS_LIST = "bench-raw"  # the list raw_redis producers LPUSH to


def raw_redis_worker(url: str, consumers: int, stop: threading.Event) -> list[Record]:
    """The floor of a Redis queue (workload 3): ``consumers`` threads, each on its own
    connection, blocked in ``BRPOP`` on one list (Celery's Redis transport without
    Celery); a task's start is the instant its ``BRPOP`` returns."""
    import redis

    records: list[Record] = []
    lock = threading.Lock()

    def consume() -> None:
        client = redis.Redis.from_url(url)
        while not stop.is_set():
            got = client.brpop([RAW_REDIS_LIST], timeout=RAW_EMPTY_WAIT)
            done = time.time()
            if got is not None:
                with lock:
                    records.append([tag_of(got[1]), done, done])
        client.close()

    consumed_by(consume, consumers, stop)
    return records


# --- procrastinate ---------------------------------------------------------------------


def procrastinate_app(url: str) -> Any:
    """The procrastinate app both sides use: psycopg connector, one no-op async task."""
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=10)
    )
    return app


async def procrastinate_worker(url: str, concurrency: int) -> list[Record]:
    """One procrastinate worker with ``concurrency`` (its own async concurrency), every
    queue, LISTEN/NOTIFY on, jobs kept after they succeed (its default)."""
    app = procrastinate_app(url)
    records: list[Record] = []

    @app.task(name="noop", pass_context=False)
    async def noop(body: str) -> None:
        start = time.time()
        records.append([tag_of(body), start, time.time()])

    async with app.open_async():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(
            app.run_worker_async(concurrency=concurrency, install_signal_handlers=False)
        )
        stopping = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        await asyncio.sleep(0.2)  # let it register and LISTEN before saying ready
        ready()
        await stopping.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return records


# --- pgqueuer --------------------------------------------------------------------------


async def pgqueuer_worker(url: str, concurrency: int, top: int) -> list[Record]:
    """One pgqueuer ``QueueManager`` (asyncpg driver): dequeue batch ``top``, at most
    ``concurrency * top`` jobs picked at once (the entrypoint's ``concurrency_limit``)."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager

    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    records: list[Record] = []

    @qm.entrypoint("noop", concurrency_limit=concurrency * top)
    async def noop(job: Any) -> None:
        start = time.time()
        records.append([tag_of(job.payload), start, time.time()])

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    run = asyncio.ensure_future(qm.run(batch_size=top, dequeue_timeout=timedelta(seconds=5)))
    await asyncio.sleep(0.3)  # LISTEN is set up at the start of run()
    if run.done():
        run.result()
    ready()
    await run
    await conn.close()
    return records


# --- entry -----------------------------------------------------------------------------


def ready() -> None:
    print("READY", flush=True)


def main() -> int:
    config = json.loads(sys.argv[1])
    system, url = config["system"], config["url"]
    concurrency, top = config.get("concurrency", 4), config.get("top", 1)
    stop = threading.Event()
    if system in ("ours", "raw", "raw_redis"):
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if system == "ours":
        records = ours_worker(url, concurrency, stop, role=config["role"], top=top)
    elif system == "raw":
        records = raw_worker(url, concurrency, stop, top)
    elif system == "raw_redis":
        records = raw_redis_worker(url, concurrency, stop)
    elif system == "procrastinate":
        records = asyncio.run(procrastinate_worker(url, concurrency))
    elif system == "pgqueuer":
        records = asyncio.run(pgqueuer_worker(url, concurrency, top))
    else:
        raise SystemExit(f"unknown system {system!r}")
    with open(config["out"], "w") as fh:
        json.dump({"records": records}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
