"""The four workloads, one function per (workload, system); each returns one measurement's
raw figures after checking the work was done (a broken run raises, no figure).

Timestamps are ``time.time()`` on this machine, taken inside the handlers (ours too:
``bench.peers.handlers``, not ``execution_log``'s stamps, which come before the start's
durable commit), or by the database's ``now()`` of the transaction that marked a job
complete (procrastinate's ``succeeded`` event, pgqueuer's ``successful`` log row).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from bench.broker_throughput import MESSAGE_TYPE, log, percentile
from bench.peers import handlers, systems
from bench.peers.systems import (
    OURS_HANDLES,
    POLL,
    WorkerProcess,
    body,
    check_exactly_once,
    fresh_db,
    jitter,
    scalar,
    wait_until,
)
from bench.peers.worker import TARGET_QUEUE, TASK_QUEUE

DRAIN_TIMEOUT = 300.0  # seconds a workload-1 run may take to drain
# seconds between a Celery caller's looks at results it has not been told of: get()'s
# default 0.5 s re-poll, not the work, dominated every wave (about 0.5 s each)
CELERY_POLL = 0.005


def no_op() -> Any:
    """Our trivial task where nothing times it (workload 4's cycles, the preload)."""
    from scheduler_lib.scheduler import Task

    return Task.python("builtins:abs", 1, name="no-op")


# --- workload 1: queue throughput -------------------------------------------------------


def queue_run(
    system: str, n: int, batch: int, concurrency: int, shape: str = "concurrent"
) -> dict[str, Any]:
    """Enqueue ``n`` messages (``batch`` per enqueue call) while ``concurrency`` consumers
    dequeue ``batch`` at a time and complete them; msgs/s from the first enqueue to the
    last completion. Every message checked handled exactly once.

    ``shape="drain"``: the ``n`` messages are enqueued first, with no consumer; then the
    consumers start and drain them: msgs/s from the first completion to the last, as the
    handlers recorded them (so no system's start-up is counted, and no producer bounds the
    figure)."""
    if shape == "drain":
        return drain_run(system, n, batch, concurrency)
    name, processes = deployment(system)
    tags = [str(i) for i in range(n)]
    with fresh_db(name) as url:
        worker = WorkerProcess.peers(
            name, url, "queue", top=batch, concurrency=concurrency, processes=processes
        )
        try:
            first, produced = PRODUCERS[name](url, tags, batch)
            wait_until(lambda: REMAINING[name](url) == 0, DRAIN_TIMEOUT, f"{system} drain")
        finally:
            records = worker.stop()
        check_exactly_once([r[0] for r in records], set(tags), f"{system} queue batch {batch}")
        last = LAST_COMPLETION.get(name, lambda url, records: max(r[2] for r in records))(
            url, records
        )
    seconds = last - first
    return {
        "messages": n,
        "seconds": round(seconds, 3),
        "messages_per_s": round(n / seconds, 1),
        "enqueue_seconds": round(produced - first, 3),
        "verified": f"{n} enqueued, {n} handled exactly once",
    }


# Celery at each prefetch multiplier its docs discuss: 1 (a child holds one task: fair for
# long tasks, the harness's choice before issue 24) and 4 (Celery's default, which its docs
# recommend for many short tasks). Both are reported; the better is the peer to beat.
CELERY_PREFETCH = {"celery": 1, "celery_p4": 4}
# Systems whose consumers take one job per fetch, whatever the batch (no batch dequeue).
ONE_PER_FETCH = frozenset({"procrastinate", "procrastinate_4p", *CELERY_PREFETCH})


def celery_ctx(system: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """``ctx`` for the Celery system ``system`` (its prefetch multiplier)."""
    return {**ctx, "celery_prefetch": CELERY_PREFETCH[system]}


# PostgreSQL peers deployed as several worker processes too (issue 24: each at its best
# documented deployment): the system's name here -> (the peer, its worker processes), the
# concurrency shared between them.
DEPLOYMENTS = {"procrastinate_4p": ("procrastinate", 4), "pgqueuer_4p": ("pgqueuer", 4)}


def deployment(system: str) -> tuple[str, int]:
    """(the peer, its worker processes) of a system of this benchmark."""
    return DEPLOYMENTS.get(system, (system, 1))


def task_workers(name: str, url: str, ctx: dict[str, Any]) -> systems.WorkerGroup:
    """The task workers of the peer ``name`` (workloads 2 and 3): ``ctx["workers"]``
    concurrency over ``ctx["processes"]`` processes (1 unless a deployment says)."""
    return WorkerProcess.peers(
        name, url, "tasks", concurrency=ctx["workers"], processes=ctx.get("processes", 1)
    )


def drain_rate(records: list[Any], n: int) -> tuple[float, float]:
    """(seconds, msgs/s) of a drain from its handlers' records: the messages of the first
    completion (a whole batch for a consumer that commits one) are not counted, the clock
    starts when they were done."""
    ends = sorted(r[2] for r in records)
    seconds = ends[-1] - ends[0]
    return seconds, (n - ends.count(ends[0])) / seconds


def queue_celery(
    n: int, batch: int, concurrency: int, shape: str, ctx: dict[str, Any]
) -> dict[str, Any]:
    """Workload 1 for Celery, both shapes: ``noop`` tasks published one per call (batch 1)
    or as a ``group`` of ``batch`` (Celery has no batched dequeue: its prefetch is the
    nearest thing, set by ``ctx["celery_prefetch"]``); the handlers' records are the results it
    stored in Redis, read back once all are there."""
    from celery import group

    module = ctx["celery"]
    tags = [str(i) for i in range(n)]

    def produce() -> tuple[float, float]:
        first = time.time()
        for start in range(0, n, batch):
            chunk = tags[start : start + batch]
            if batch == 1:
                module.noop.apply_async(args=chunk)
            else:
                group(module.noop.s(t) for t in chunk).apply_async()
        return first, time.time()

    client = ctx["redis"].module.Redis.from_url(ctx["redis_url"])
    worker = None
    try:
        if shape == "concurrent":
            worker = systems.celery_worker(ctx["redis_url"], concurrency, ctx["celery_prefetch"])
            systems.celery_ready(module, worker)
            for key in client.keys("celery-task-meta-*"):  # the readiness probe's
                client.delete(key)
            first, produced = produce()
        else:
            produce()
            worker = systems.celery_worker(ctx["redis_url"], concurrency, ctx["celery_prefetch"])
        wait_until(
            lambda: len(client.keys("celery-task-meta-*")) >= n, DRAIN_TIMEOUT, "celery drain"
        )
        metas = [json.loads(v) for v in client.mget(client.keys("celery-task-meta-*"))]
    finally:
        if worker is not None:
            worker.stop()
        client.close()
        ctx["redis_flush"]()
    records = [m["result"] for m in metas if m["status"] == "SUCCESS"]
    check_exactly_once([r[0] for r in records], set(tags), f"celery queue {shape} batch {batch}")
    extra = {}
    if shape == "concurrent":
        seconds = max(r[2] for r in records) - first
        rate = n / seconds
        extra = {"enqueue_seconds": round(produced - first, 3)}
    else:
        seconds, rate = drain_rate(records, n)
    return {
        "messages": n,
        "seconds": round(seconds, 3),
        "messages_per_s": round(rate, 1),
        **extra,
        "verified": f"{n} enqueued, {n} handled exactly once",
    }


def drain_run(system: str, n: int, batch: int, concurrency: int) -> dict[str, Any]:
    """:func:`queue_run`'s drain shape: ``n`` messages enqueued, then drained."""
    name, processes = deployment(system)
    tags = [str(i) for i in range(n)]
    with fresh_db(name) as url:
        PRODUCERS[name](url, tags, batch)
        worker = WorkerProcess.peers(
            name, url, "queue", top=batch, concurrency=concurrency, processes=processes
        )
        try:
            wait_until(lambda: REMAINING[name](url) == 0, DRAIN_TIMEOUT, f"{system} drain")
        finally:
            records = worker.stop()
    check_exactly_once([r[0] for r in records], set(tags), f"{system} drain batch {batch}")
    seconds, rate = drain_rate(records, n)
    return {
        "messages": n,
        "seconds": round(seconds, 3),
        "messages_per_s": round(rate, 1),
        "verified": f"{n} enqueued first, {n} handled exactly once",
    }


def produce_ours(url: str, tags: list[str], batch: int) -> tuple[float, float]:
    from scheduler_lib.broker import Broker

    handles = OURS_HANDLES
    with Broker(url, migrate=False, timers=False) as broker:
        first = time.time()
        if batch == 1:
            for i, tag in enumerate(tags):
                broker.send(handles[i % len(handles)], MESSAGE_TYPE, body(tag).encode())
        else:
            for j, start in enumerate(range(0, len(tags), batch)):
                bodies = [body(t).encode() for t in tags[start : start + batch]]
                broker.send_many(handles[j % len(handles)], MESSAGE_TYPE, bodies)
        return first, time.time()


def produce_raw(url: str, tags: list[str], batch: int) -> tuple[float, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        first = time.time()
        if batch == 1:
            for tag in tags:
                conn.execute("INSERT INTO bench_raw (body) VALUES (%s)", (body(tag).encode(),))
        else:
            for start in range(0, len(tags), batch):
                bodies = [body(t).encode() for t in tags[start : start + batch]]
                conn.execute("INSERT INTO bench_raw (body) SELECT unnest(%s::bytea[])", (bodies,))
        return first, time.time()


def produce_procrastinate(url: str, tags: list[str], batch: int) -> tuple[float, float]:
    from bench.peers.worker import procrastinate_app

    async def go() -> tuple[float, float]:
        app = procrastinate_app(url)
        async with app.open_async():
            deferrer = app.configure_task("noop")
            first = time.time()
            if batch == 1:
                for tag in tags:
                    await deferrer.defer_async(body=body(tag))
            else:
                for start in range(0, len(tags), batch):
                    await deferrer.batch_defer_async(
                        *({"body": body(t)} for t in tags[start : start + batch])
                    )
            return first, time.time()

    return asyncio.run(go())


def produce_pgqueuer(url: str, tags: list[str], batch: int) -> tuple[float, float]:
    async def go() -> tuple[float, float]:
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        conn = await asyncpg.connect(url)
        queries = Queries(AsyncpgDriver(conn))
        first = time.time()
        if batch == 1:
            for tag in tags:
                await queries.enqueue("noop", body(tag).encode())
        else:
            for start in range(0, len(tags), batch):
                chunk = tags[start : start + batch]
                await queries.enqueue(
                    ["noop"] * len(chunk), [body(t).encode() for t in chunk], [0] * len(chunk)
                )
        produced = time.time()
        await conn.close()
        return first, produced

    return asyncio.run(go())


PRODUCERS = {
    "ours": produce_ours,
    "raw": produce_raw,
    "procrastinate": produce_procrastinate,
    "pgqueuer": produce_pgqueuer,
}
REMAINING = {
    "ours": lambda url: scalar(
        url, "SELECT count(*) FROM queue_messages WHERE queue_name = %s", TARGET_QUEUE
    ),
    "raw": lambda url: scalar(url, "SELECT count(*) FROM bench_raw"),
    "procrastinate": lambda url: scalar(
        url, "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    ),
    # completed jobs leave the table when the worker's status buffer flushes
    "pgqueuer": lambda url: scalar(url, "SELECT count(*) FROM pgqueuer"),
}


def last_procrastinate(url: str, records: list[Any]) -> float:
    done, last = (
        psycopg.connect(url, autocommit=True)
        .execute(
            "SELECT count(*), extract(epoch FROM max(at)) FROM procrastinate_events "
            "WHERE type = 'succeeded'"
        )
        .fetchone()
    )
    if done != len(records):
        raise RuntimeError(f"procrastinate: {done} succeeded events for {len(records)} jobs")
    return float(last)


def last_pgqueuer(url: str, records: list[Any]) -> float:
    done, last = (
        psycopg.connect(url, autocommit=True)
        .execute(
            "SELECT count(*), extract(epoch FROM max(created)) FROM pgqueuer_log "
            "WHERE status = 'successful'"
        )
        .fetchone()
    )
    if done != len(records):
        raise RuntimeError(f"pgqueuer: {done} successful log rows for {len(records)} jobs")
    return float(last)


LAST_COMPLETION = {"procrastinate": last_procrastinate, "pgqueuer": last_pgqueuer}


# --- workload 2: waves ------------------------------------------------------------------


def waves_run(
    system: str, waves: int, size: int, repeats: int, ctx: dict[str, Any]
) -> list[dict[str, Any]]:
    """``repeats`` runs of ``waves`` waves of ``size`` no-op tasks on 4 workers, the next
    wave sent once the caller saw the previous complete. Per run: makespan (the caller's
    wall time) and the timestamps of every task, checked: each task ran exactly once, no
    task of wave k+1 started before the last of wave k ended."""
    runs = WAVES[system](waves, size, repeats, ctx)
    out = []
    for makespan, tasks in runs:
        by_wave: dict[int, list[tuple[float, float]]] = {}
        for wave, start, end in tasks:
            by_wave.setdefault(wave, []).append((start, end))
        if sorted(by_wave) != list(range(waves)) or any(len(v) != size for v in by_wave.values()):
            raise RuntimeError(
                f"{system} waves: tasks per wave {[len(by_wave.get(k, [])) for k in range(waves)]}"
            )
        gaps = []
        for k in range(1, waves):
            last_end = max(e for _, e in by_wave[k - 1])
            first_start = min(s for s, _ in by_wave[k])
            if first_start < last_end:
                raise RuntimeError(
                    f"{system} waves: wave {k + 1} started {1000 * (last_end - first_start):.1f}"
                    f" ms before wave {k} ended"
                )
            gaps.append(first_start - last_end)
        out.append(
            {
                "makespan_s": round(makespan, 4),
                # last task of wave k ended -> first task of wave k+1 started, mean over
                # the wave boundaries: completion seen by the caller, next wave sent, taken
                "sync_overhead_ms": round(1000 * statistics.mean(gaps), 2),
                "sync_overhead_ms_each": [round(1000 * g, 2) for g in gaps],
            }
        )
    return out


def lazy_start(url: str) -> None:
    """Our target as one whose tasks' effects are idempotent: ``durable_start=False``
    with a retry, as docs/scheduler.md ("Durable or lazy start") says to deploy it (a
    task whose end a database crash lost runs again rather than failing as lost; it
    costs nothing until a lease expires); ``ours_lazy`` in the tables."""
    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import Target, init

    with Broker(url, migrate=False, timers=False) as broker:
        init(broker, targets=[Target(activation=False, durable_start=False, retries=1)])


def waves_ours(
    waves: int, size: int, repeats: int, ctx: dict[str, Any], durable: bool = True
) -> list[Any]:
    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import TaskScheduler

    makespans = []
    with fresh_db("ours") as url:
        if not durable:
            lazy_start(url)
        worker = WorkerProcess.peer("ours", url, "tasks", concurrency=ctx["workers"])
        try:
            with Broker(url, migrate=False) as broker:
                scheduler = TaskScheduler(broker)
                scheduler.run_waves([[handlers.task(f"warm:{i}") for i in range(20)]])
                for r in range(repeats):
                    plan = [
                        [handlers.task(f"{r}:{k}:{i}") for i in range(size)] for k in range(waves)
                    ]
                    started = time.monotonic()
                    report = scheduler.run_waves(plan)
                    makespan = time.monotonic() - started
                    if not report.ok:
                        raise RuntimeError(f"ours waves: failures {report.failures}")
                    with psycopg.connect(url, autocommit=True) as conn:
                        rows = conn.execute(
                            "SELECT status, attempts FROM execution_log "
                            "WHERE scheduler_handle = %s",
                            (str(report.scheduler_handle),),
                        ).fetchall()
                    bad = [r for r in rows if r != ("SUCCEEDED", 1)]
                    if bad or len(rows) != waves * size:
                        raise RuntimeError(f"ours waves: {len(rows)} rows, {len(bad)} not once")
                    makespans.append(makespan)
        finally:
            records = worker.stop()
    # timed inside the handler, as the peers are (bench.peers.handlers)
    return tasks_by_run(records, waves, size, makespans, "ours")


def waves_celery(waves: int, size: int, repeats: int, ctx: dict[str, Any]) -> list[Any]:
    from celery import group

    module = ctx["celery"]
    worker = systems.celery_worker(ctx["redis_url"], ctx["workers"], ctx["celery_prefetch"])
    runs = []
    try:
        systems.celery_ready(module, worker)
        group(module.noop.s(f"warm:{i}") for i in range(20)).apply_async().get(timeout=60)
        for r in range(repeats):
            tasks = []
            started = time.monotonic()
            for k in range(waves):
                results = (
                    group(module.noop.s(f"{r}:{k}:{i}") for i in range(size))
                    .apply_async()
                    .get(timeout=60, interval=CELERY_POLL)
                )
                check_exactly_once(
                    [x[0] for x in results], {f"{r}:{k}:{i}" for i in range(size)}, "celery wave"
                )
                tasks.extend((k, x[1], x[2]) for x in results)
            runs.append((time.monotonic() - started, tasks))
    finally:
        worker.stop()
        ctx["redis_flush"]()
    return runs


def waves_procrastinate(waves: int, size: int, repeats: int, ctx: dict[str, Any]) -> list[Any]:
    from bench.peers.worker import procrastinate_app

    with fresh_db("procrastinate") as url:
        worker = task_workers("procrastinate", url, ctx)
        makespans: list[float] = []
        try:

            async def wave(app: Any, queue: str, tags: list[str]) -> None:
                deferrer = app.configure_task("noop", queue=queue)
                await deferrer.batch_defer_async(*({"body": body(t)} for t in tags))
                while True:  # poll the jobs' status: procrastinate has no completion wait
                    jobs = list(await app.job_manager.list_jobs_async(queue=queue))
                    statuses = {j.status for j in jobs}
                    if statuses == {"succeeded"} and len(jobs) == len(tags):
                        return
                    if statuses - {"todo", "doing", "succeeded"}:
                        raise RuntimeError(f"procrastinate wave: statuses {statuses}")
                    await asyncio.sleep(POLL)

            async def go() -> None:
                app = procrastinate_app(url)
                async with app.open_async():
                    await wave(app, "warm", [f"warm:{i}" for i in range(20)])
                    for r in range(repeats):
                        started = time.monotonic()
                        for k in range(waves):
                            await wave(app, f"w{r}_{k}", [f"{r}:{k}:{i}" for i in range(size)])
                        makespans.append(time.monotonic() - started)

            asyncio.run(go())
        finally:
            records = worker.stop()
    return tasks_by_run(records, waves, size, makespans, "procrastinate")


def waves_pgqueuer(waves: int, size: int, repeats: int, ctx: dict[str, Any]) -> list[Any]:
    with fresh_db("pgqueuer") as url:
        worker = task_workers("pgqueuer", url, ctx)
        makespans: list[float] = []
        try:

            async def go() -> None:
                import asyncpg
                from pgqueuer import AsyncpgDriver, Queries
                from pgqueuer.core.completion import CompletionWatcher

                conn = await asyncpg.connect(url)
                driver = AsyncpgDriver(conn)
                queries = Queries(driver)
                async with CompletionWatcher(
                    driver, queries=queries, debounce=systems.PGQ_DEBOUNCE
                ) as watcher:

                    async def wave(tags: list[str]) -> None:
                        ids = await queries.enqueue(
                            ["noop"] * len(tags), [body(t).encode() for t in tags], [0] * len(tags)
                        )
                        statuses = await asyncio.gather(*(watcher.wait_for(j) for j in ids))
                        if set(statuses) != {"successful"}:
                            raise RuntimeError(f"pgqueuer wave: statuses {set(statuses)}")

                    await wave([f"warm:{i}" for i in range(20)])
                    for r in range(repeats):
                        started = time.monotonic()
                        for k in range(waves):
                            await wave([f"{r}:{k}:{i}" for i in range(size)])
                        makespans.append(time.monotonic() - started)
                await conn.close()

            asyncio.run(go())
        finally:
            records = worker.stop()
    return tasks_by_run(records, waves, size, makespans, "pgqueuer")


def tasks_by_run(
    records: list[Any], waves: int, size: int, makespans: list[float], system: str
) -> list[Any]:
    """The handler records of a peer's waves, checked exactly once, grouped by run."""
    expected = {f"warm:{i}" for i in range(20)} | {
        f"{r}:{k}:{i}" for r in range(len(makespans)) for k in range(waves) for i in range(size)
    }
    check_exactly_once([r[0] for r in records], expected, f"{system} waves")
    runs: list[list[tuple[int, float, float]]] = [[] for _ in makespans]
    for tag, start, end in records:
        if not tag.startswith("warm"):
            r, k, _ = tag.split(":")
            runs[int(r)].append((int(k), start, end))
    return list(zip(makespans, runs, strict=True))


WAVES = {
    "ours": waves_ours,
    "ours_lazy": lambda w, s, r, ctx: waves_ours(w, s, r, ctx, durable=False),
    "celery": lambda w, s, r, ctx: waves_celery(w, s, r, celery_ctx("celery", ctx)),
    "celery_p4": lambda w, s, r, ctx: waves_celery(w, s, r, celery_ctx("celery_p4", ctx)),
    "procrastinate": waves_procrastinate,
    "procrastinate_4p": lambda w, s, r, ctx: waves_procrastinate(w, s, r, {**ctx, "processes": 4}),
    "pgqueuer": waves_pgqueuer,
    "pgqueuer_4p": lambda w, s, r, ctx: waves_pgqueuer(w, s, r, {**ctx, "processes": 4}),
}


# --- workload 3: dispatch latency -------------------------------------------------------


def dispatch_run(system: str, samples: int, ctx: dict[str, Any]) -> list[float]:
    """With idle workers, one task at a time: ms from the enqueue call to the handler's
    start, ``samples`` of them after 10 warm-up tasks; each waited for before the next."""
    return DISPATCH[system](samples, ctx)


WARM_DISPATCH = 10


def dispatch_ours(samples: int, ctx: dict[str, Any], durable: bool = True) -> list[float]:
    with fresh_db("ours") as url:
        if not durable:
            lazy_start(url)
        worker = WorkerProcess.peer("ours", url, "tasks", concurrency=ctx["workers"])
        try:
            sent = ours_dispatch_calls(url, samples)
            with psycopg.connect(url, autocommit=True) as conn:
                once = conn.execute(
                    "SELECT count(*) FROM execution_log WHERE status = 'SUCCEEDED' AND attempts = 1"
                ).fetchone()
        finally:
            records = worker.stop()
    if once is None or once[0] != WARM_DISPATCH + samples:
        raise RuntimeError(f"ours dispatch: {once} tasks ran once")
    # timed inside the handler, as the peers are (bench.peers.handlers)
    return latencies(records, {tag: called for tag, _, called, _ in sent}, "ours")


def ours_dispatch_calls(url: str, samples: int) -> list[tuple[str, int, float, float]]:
    """Our caller's side of workload 3 against a running worker: one task at a time after
    an idle pause, each waited for. (tag, log id, ``time.time()`` before the ``exec_async``
    call, after it returned) of every task, the warm-up ones (tags below
    ``WARM_DISPATCH``) first; each task is ``bench.peers.handlers.noop(tag)``."""
    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import TaskScheduler

    sent: list[tuple[str, int, float, float]] = []
    with Broker(url, migrate=False) as broker:
        scheduler = TaskScheduler(broker)
        with scheduler.scheduler() as handle:
            for i in range(WARM_DISPATCH + samples):
                task = handlers.task(str(i))
                jitter()
                called = time.time()
                log_id = scheduler.exec_async(handle, task)
                returned = time.time()
                done = scheduler.synchronization(handle, timeout=30)
                if not done.ok or done.log_id != log_id:
                    raise RuntimeError(f"ours dispatch: {done}")
                sent.append((str(i), log_id, called, returned))
    return sent


def dispatch_celery(samples: int, ctx: dict[str, Any]) -> list[float]:
    module = ctx["celery"]
    worker = systems.celery_worker(ctx["redis_url"], ctx["workers"], ctx["celery_prefetch"])
    out = []
    try:
        systems.celery_ready(module, worker)
        for i in range(WARM_DISPATCH + samples):
            jitter()
            called = time.time()
            tag, start, _ = module.noop.apply_async(args=[str(i)]).get(timeout=30)
            if tag != str(i):
                raise RuntimeError(f"celery dispatch: got {tag} for {i}")
            if i >= WARM_DISPATCH:
                out.append(1000 * (start - called))
    finally:
        worker.stop()
        ctx["redis_flush"]()
    return out


def dispatch_procrastinate(samples: int, ctx: dict[str, Any]) -> list[float]:
    from bench.peers.worker import procrastinate_app

    called: dict[str, float] = {}
    with fresh_db("procrastinate") as url:
        worker = task_workers("procrastinate", url, ctx)
        try:

            async def go() -> None:
                app = procrastinate_app(url)
                async with app.open_async():
                    deferrer = app.configure_task("noop")
                    for i in range(WARM_DISPATCH + samples):
                        await asyncio.sleep(jitter_s())
                        called[str(i)] = time.time()
                        job_id = await deferrer.defer_async(body=body(str(i)))
                        while True:
                            status = await app.job_manager.get_job_status_async(job_id)
                            if status.value == "succeeded":
                                break
                            if status.value not in ("todo", "doing"):
                                raise RuntimeError(f"procrastinate dispatch: {status}")
                            await asyncio.sleep(POLL)

            asyncio.run(go())
        finally:
            records = worker.stop()
    return latencies(records, called, "procrastinate")


def dispatch_pgqueuer(samples: int, ctx: dict[str, Any]) -> list[float]:
    called: dict[str, float] = {}
    with fresh_db("pgqueuer") as url:
        worker = task_workers("pgqueuer", url, ctx)
        try:

            async def go() -> None:
                import asyncpg
                from pgqueuer import AsyncpgDriver, Queries
                from pgqueuer.core.completion import CompletionWatcher

                conn = await asyncpg.connect(url)
                driver = AsyncpgDriver(conn)
                queries = Queries(driver)
                async with CompletionWatcher(
                    driver, queries=queries, debounce=systems.PGQ_DEBOUNCE
                ) as watcher:
                    for i in range(WARM_DISPATCH + samples):
                        await asyncio.sleep(jitter_s())
                        called[str(i)] = time.time()
                        [job_id] = await queries.enqueue("noop", body(str(i)).encode())
                        status = await watcher.wait_for(job_id)
                        if status != "successful":
                            raise RuntimeError(f"pgqueuer dispatch: {status}")
                await conn.close()

            asyncio.run(go())
        finally:
            records = worker.stop()
    return latencies(records, called, "pgqueuer")


# The floors: no system, the least a dispatch does on each server. One consumer (the
# least: four LISTENing connections would all be woken by each NOTIFY), waited for by
# polling (``systems.wait_until``).
FLOOR_CONSUMERS = 1


def dispatch_raw(samples: int, ctx: dict[str, Any]) -> list[float]:
    """PostgreSQL's floor: one autocommit INSERT (its durable commit fires the table's
    NOTIFY trigger), one consumer's LISTEN woken, its ``DELETE ... SKIP LOCKED`` (a
    durable commit: the start of a task recorded as ours records it by default)."""
    called: dict[str, float] = {}
    with fresh_db("raw") as url:
        worker = WorkerProcess.peer("raw", url, "tasks", concurrency=FLOOR_CONSUMERS)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                for i in range(WARM_DISPATCH + samples):
                    jitter()
                    called[str(i)] = time.time()
                    conn.execute(
                        "INSERT INTO bench_raw (body) VALUES (%s)", (body(str(i)).encode(),)
                    )
                    time.sleep(POLL)  # no look of ours while the consumer takes it
                    wait_until(
                        lambda: scalar_on(conn, "SELECT count(*) FROM bench_raw") == 0,
                        30,
                        "raw dispatch: the task taken",
                    )
        finally:
            records = worker.stop()
    return latencies(records, called, "raw")


def dispatch_raw_redis(samples: int, ctx: dict[str, Any]) -> list[float]:
    """Redis's floor: one ``LPUSH`` to a consumer blocked in ``BRPOP`` (Celery's
    transport without Celery)."""
    import redis

    from bench.peers.worker import RAW_REDIS_LIST

    called: dict[str, float] = {}
    url = ctx["redis_url"]
    worker = WorkerProcess.peer("raw_redis", url, "tasks", concurrency=FLOOR_CONSUMERS)
    try:
        client = redis.Redis.from_url(url)
        for i in range(WARM_DISPATCH + samples):
            jitter()
            called[str(i)] = time.time()
            client.lpush(RAW_REDIS_LIST, body(str(i)))
            time.sleep(POLL)  # no look of ours while the consumer takes it
            wait_until(
                lambda: client.llen(RAW_REDIS_LIST) == 0, 30, "raw_redis dispatch: the task taken"
            )
        client.close()
    finally:
        records = worker.stop()
        ctx["redis_flush"]()
    return latencies(records, called, "raw_redis")


def scalar_on(conn: psycopg.Connection[Any], sql: str) -> Any:
    row = conn.execute(sql).fetchone()
    return row[0] if row else None


def jitter_s() -> float:
    import random

    return random.uniform(0.02, 0.04)


def latencies(records: list[Any], called: dict[str, float], system: str) -> list[float]:
    check_exactly_once([r[0] for r in records], set(called), f"{system} dispatch")
    starts = {r[0]: r[1] for r in records}
    return [1000 * (starts[tag] - t0) for tag, t0 in called.items() if int(tag) >= WARM_DISPATCH]


DISPATCH = {
    "ours": dispatch_ours,
    "ours_lazy": lambda n, ctx: dispatch_ours(n, ctx, durable=False),
    "celery": lambda n, ctx: dispatch_celery(n, celery_ctx("celery", ctx)),
    "celery_p4": lambda n, ctx: dispatch_celery(n, celery_ctx("celery_p4", ctx)),
    "procrastinate": dispatch_procrastinate,
    "procrastinate_4p": lambda n, ctx: dispatch_procrastinate(n, {**ctx, "processes": 4}),
    "pgqueuer": dispatch_pgqueuer,
    "pgqueuer_4p": lambda n, ctx: dispatch_pgqueuer(n, {**ctx, "processes": 4}),
    "raw": dispatch_raw,
    "raw_redis": dispatch_raw_redis,
}


# --- workload 4: scale ------------------------------------------------------------------

PRELOAD_SQL = {
    # ours: a finished task leaves its execution_log row; its conversation's endpoints,
    # groups, messages and leases are deleted once both sides ended (nothing else stays)
    "ours": [
        """INSERT INTO execution_log (caller_id, scheduler_handle, target_service, wave,
            task_name, task_kind, task_body, worker_id, sent_at, start_time, end_time,
            status, result, attempts)
        SELECT 'bench-host:1:MainThread', md5((g / 250)::text)::uuid::text,
            'ServiceAsyncTarget', (g / 50) %% 5 + 1, 'no-op', 'python', %(task)s,
            'bench-host:2:reader-' || (g %% 4), t, t + 0.002, t + 0.003, 'SUCCEEDED', '1', 1
        FROM generate_series(1, %(n)s) g,
            LATERAL (SELECT extract(epoch FROM now()) - 86400 + g * 0.01 AS t) x""",
    ],
    # procrastinate keeps succeeded jobs (delete_jobs="never", its default) and their
    # deferred/started/succeeded events
    "procrastinate": [
        """INSERT INTO procrastinate_jobs (queue_name, task_name, priority, args, status,
            attempts)
        SELECT 'default', 'noop', 0, jsonb_build_object('body', g || '|' || repeat('x', 93)),
            'succeeded', 1
        FROM generate_series(1, %(n)s) g""",
        """INSERT INTO procrastinate_events (job_id, type, at)
        SELECT j.id, e.type::procrastinate_job_event_type, now() - interval '1 day'
        FROM procrastinate_jobs j,
            unnest(ARRAY['deferred', 'started', 'succeeded']) e(type)""",
    ],
    # pgqueuer deletes a finished job from its queue table and keeps its log rows
    # (queued, picked, successful), folded into per-second statistics (aggregated = true)
    "pgqueuer": [
        """INSERT INTO pgqueuer_log (created, job_id, status, priority, entrypoint,
            aggregated)
        SELECT now() - interval '1 day' + g * interval '1 ms', g, s::pgqueuer_status, 0,
            'noop', true
        FROM generate_series(1, %(n)s) g,
            unnest(ARRAY['queued', 'picked', 'successful']) s""",
        """INSERT INTO pgqueuer_statistics (created, count, priority, status, entrypoint)
        SELECT date_trunc('sec', now() - interval '1 day') + b * interval '1 sec', 1000, 0,
            s::pgqueuer_status, 'noop'
        FROM generate_series(0, %(n)s / 1000) b,
            unnest(ARRAY['queued', 'picked', 'successful']) s""",
        "SELECT setval('pgqueuer_id_seq', %(n)s)",
    ],
}
CELERY_PRELOAD = """
for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  redis.call('SET', 'celery-task-meta-' .. string.format('%08d', i) .. ARGV[3],
    string.format(ARGV[4], i), 'EX', 86400)
end
return 1
"""
CELERY_RESULT = (
    '{"status": "SUCCESS", "result": ["%d", 1.0, 1.0], "traceback": null, "children": [], '
    '"date_done": "2026-11-24T00:00:00.000000+00:00", "task_id": "x"}'
)


def preload(system: str, url: str, n: int) -> dict[str, Any]:
    """``n`` completed items in ``system``'s real completed form, set-based; VACUUM
    ANALYZE. Returns the row counts (checked)."""
    import json

    task_json = json.dumps(no_op().to_dict())
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        for sql in PRELOAD_SQL[system]:
            conn.execute(sql, {"n": n, "task": task_json})
        counts = {
            "ours": {
                "execution_log_succeeded": "SELECT count(*) FROM execution_log "
                "WHERE status = 'SUCCEEDED'"
            },
            "procrastinate": {
                "jobs_succeeded": "SELECT count(*) FROM procrastinate_jobs "
                "WHERE status = 'succeeded'",
                "events": "SELECT count(*) FROM procrastinate_events",
            },
            "pgqueuer": {
                "log_successful": "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'",
                "log_rows": "SELECT count(*) FROM pgqueuer_log",
            },
        }[system]
        rows = {k: conn.execute(q).fetchone()[0] for k, q in counts.items()}
        conn.execute("VACUUM ANALYZE")
    first = next(iter(rows.values()))
    if first != n:
        raise RuntimeError(f"{system} preload: {rows}, expected {n}")
    return {"rows": rows, "seconds": round(time.monotonic() - started, 1)}


class Cycle:
    """One system's enqueue (untimed) + dequeue-and-complete (timed) on one database."""

    def __init__(self, system: str, url: str) -> None:
        self.system, self.url = system, url

    def __enter__(self) -> Cycle:
        getattr(self, f"open_{self.system}")()
        return self

    def __exit__(self, *exc: object) -> None:
        getattr(self, f"close_{self.system}")()

    def timed(self) -> float:
        """ms for the dequeue + complete of one ready item."""
        return getattr(self, f"cycle_{self.system}")()

    # ours: exec_async, then time Executor.run_one (take + start + run + AsyncDone +
    # log end); synchronization after it (untimed)
    def open_ours(self) -> None:
        from scheduler_lib.broker import Broker
        from scheduler_lib.scheduler import Executor, TaskScheduler

        self.broker = Broker(self.url, migrate=False)
        self.scheduler = TaskScheduler(self.broker)
        self.executor = Executor(self.broker, TASK_QUEUE, idle_timeout=3600)
        self.handle = self.scheduler.get_scheduler()
        self.task = no_op()

    def cycle_ours(self) -> float:
        self.scheduler.exec_async(self.handle, self.task)
        t0 = time.perf_counter()
        if not self.executor.run_one(timeout=0):
            raise RuntimeError("ours scale: run_one found no task")
        elapsed = 1000 * (time.perf_counter() - t0)
        if not self.scheduler.synchronization(self.handle, timeout=10).ok:
            raise RuntimeError("ours scale: task failed")
        return elapsed

    def close_ours(self) -> None:
        self.scheduler.release_scheduler(self.handle)
        self.broker.close()

    # procrastinate: defer, then time fetch_job + finish_job(succeeded) (what its worker
    # does around a job)
    def open_procrastinate(self) -> None:
        from bench.peers.worker import procrastinate_app

        self.loop = asyncio.new_event_loop()
        self.app = procrastinate_app(self.url)
        self.loop.run_until_complete(self.app.open_async().__aenter__())
        self.deferrer = self.app.configure_task("noop")
        self.worker_id = self.loop.run_until_complete(self.app.job_manager.register_worker())

    def cycle_procrastinate(self) -> float:
        from procrastinate.jobs import Status

        async def go() -> float:
            await self.deferrer.defer_async(body=body("x"))
            t0 = time.perf_counter()
            job = await self.app.job_manager.fetch_job(queues=None, worker_id=self.worker_id)
            if job is None:
                raise RuntimeError("procrastinate scale: fetch_job found no job")
            await self.app.job_manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
            return 1000 * (time.perf_counter() - t0)

        return self.loop.run_until_complete(go())

    def close_procrastinate(self) -> None:
        self.loop.run_until_complete(self.app.close_async())
        self.loop.close()

    # pgqueuer: enqueue, then time dequeue(batch_size=1) + log_jobs(successful)
    def open_pgqueuer(self) -> None:
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(self.url))
        self.queries = Queries(AsyncpgDriver(self.conn))
        self.qm_id = uuid.uuid4()

    def cycle_pgqueuer(self) -> float:
        from pgqueuer.ports.repository import EntrypointExecutionParameter

        async def go() -> float:
            await self.queries.enqueue("noop", body("x").encode())
            t0 = time.perf_counter()
            jobs = await self.queries.dequeue(
                batch_size=1,
                entrypoints={"noop": EntrypointExecutionParameter(concurrency_limit=0)},
                queue_manager_id=self.qm_id,
                global_concurrency_limit=None,
                heartbeat_timeout=timedelta(seconds=30),
            )
            if len(jobs) != 1:
                raise RuntimeError(f"pgqueuer scale: dequeue returned {len(jobs)} jobs")
            await self.queries.log_jobs([(jobs[0], "successful", None)])
            return 1000 * (time.perf_counter() - t0)

        return self.loop.run_until_complete(go())

    def close_pgqueuer(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()

    # celery: publish, then time the worker's part: get the message from the Redis list
    # (kombu basic_get), ack it, store the result in the backend
    def open_celery(self) -> None:
        from celery import Celery

        self.app = Celery("bench_scale", broker=self.url, backend=self.url)
        self.app.conf.update(task_default_queue="bench")
        self.conn = self.app.connection_for_read()
        self.channel = self.conn.default_channel

    def cycle_celery(self) -> float:
        result = self.app.send_task("noop", args=["x"])
        t0 = time.perf_counter()
        message = self.channel.basic_get("bench", no_ack=False)
        if message is None:
            raise RuntimeError("celery scale: no message")
        message.ack()
        self.app.backend.store_result(message.headers["id"], ["x", 0, 0], "SUCCESS")
        elapsed = 1000 * (time.perf_counter() - t0)
        if message.headers["id"] != result.id:
            raise RuntimeError("celery scale: got another task")
        return elapsed

    def close_celery(self) -> None:
        self.conn.release()


def scale_run(system: str, retained: int, samples: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """The dequeue-and-complete cost with ``retained`` completed items kept vs none: two
    stores set up alike, one preloaded; timed cycles alternate between them pair by pair
    (A B B A ...) so that drift hits both alike."""
    with contextlib_two(system, ctx) as (url_none, url_with):
        build = preload_any(system, url_with, retained, ctx)
        if system != "celery":
            with psycopg.connect(url_none, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
            with psycopg.connect(systems.ADMIN_URL, autocommit=True) as conn:
                conn.execute("CHECKPOINT")
        none_ms: list[float] = []
        with_ms: list[float] = []
        with Cycle(system, url_none) as a, Cycle(system, url_with) as b:
            sides = [(a, none_ms), (b, with_ms)]
            for _ in range(30):  # warm-up
                a.timed()
                b.timed()
            for i in range(samples):
                for cycle, times in sides if i % 2 == 0 else reversed(sides):
                    times.append(cycle.timed())
    med_none, med_with = statistics.median(none_ms), statistics.median(with_ms)
    return {
        "retained": retained,
        "samples_each": samples,
        "build": build,
        "ms_none": round(med_none, 3),
        "ms_retained": round(med_with, 3),
        "p90_ms_none": round(percentile(none_ms, 90), 3),
        "p90_ms_retained": round(percentile(with_ms, 90), 3),
        "ratio": round(med_with / med_none, 3),
    }


class contextlib_two:
    """Two fresh stores of ``system``: PostgreSQL databases, or Redis databases."""

    def __init__(self, system: str, ctx: dict[str, Any]) -> None:
        self.system, self.ctx = system, ctx
        import contextlib

        self.stack = contextlib.ExitStack()

    def __enter__(self) -> tuple[str, str]:
        if self.system == "celery":
            redis = self.ctx["redis"]
            return (
                self.stack.enter_context(redis.database()),
                self.stack.enter_context(redis.database()),
            )
        return (
            self.stack.enter_context(fresh_db(self.system)),
            self.stack.enter_context(fresh_db(self.system)),
        )

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def preload_any(system: str, url: str, n: int, ctx: dict[str, Any]) -> dict[str, Any]:
    if system != "celery":
        return preload(system, url, n)
    import redis

    started = time.monotonic()
    client = redis.Redis.from_url(url)
    script = client.register_script(CELERY_PRELOAD)
    chunk = 100_000
    for start in range(1, n + 1, chunk):
        script(args=[start, min(n, start + chunk - 1), "-" + uuid.uuid4().hex, CELERY_RESULT])
    keys = client.dbsize() - 1  # the claim key of systems.Redis.database
    client.close()
    if keys != n:
        raise RuntimeError(f"celery preload: {keys} keys, expected {n}")
    log(f"celery: {n} result keys preloaded")
    return {"rows": {"result_keys": keys}, "seconds": round(time.monotonic() - started, 1)}
