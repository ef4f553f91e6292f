"""The harness side of every system: databases, worker processes, producers and callers.

Each system gets, per measurement, a fresh PostgreSQL database cloned from a template
holding its schema (unique name, dropped afterwards even on failure); Celery gets an empty
Redis database (flushed afterwards). Worker sides run in their own processes
(``bench.peers.worker``, or Celery's own worker), started and stopped here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.broker_throughput import ADMIN_URL, db_url, log

REPO = Path(__file__).resolve().parent.parent.parent
BODY_BYTES = 100  # every message / job payload, all systems alike
CONVERSATIONS = 64  # ours, workload 1: the producer sends round robin over these
POLL = 0.01  # seconds: procrastinate callers poll job status this often (no other way)
DONE_POLL = 0.02  # seconds: the harness checks "all consumed" this often (workload 1)
PGQ_DEBOUNCE = timedelta(milliseconds=5)  # pgqueuer CompletionWatcher debounce (default 50)
READY_TIMEOUT = 90.0  # seconds a worker process may take to say READY
TEMPLATES: dict[str, str] = {}  # system -> template database name
OURS_HANDLES: list[str] = []


def body(tag: str) -> str:
    """A ``BODY_BYTES`` payload that starts with its tag."""
    return f"{tag}|".ljust(BODY_BYTES, "x")


# --- databases -------------------------------------------------------------------------


def admin(sql: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql)


def drop(name: str) -> None:
    admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def fresh_db(system: str) -> Iterator[str]:
    """A new database cloned from ``system``'s template; dropped afterwards."""
    name = f"bench_peers_{system}_{uuid.uuid4().hex[:10]}"
    admin(f'CREATE DATABASE "{name}" TEMPLATE "{template(system)}"')
    try:
        yield db_url(name)
    finally:
        drop(name)


def template(system: str) -> str:
    """The template database of ``system`` (its schema, created once per run)."""
    if system in TEMPLATES:
        return TEMPLATES[system]
    name = f"bench_peers_tmpl_{system}_{uuid.uuid4().hex[:8]}"
    admin(f'CREATE DATABASE "{name}"')
    TEMPLATES[system] = name
    url = db_url(name)
    if system == "ours":
        from bench.broker_throughput import setup_broker
        from scheduler_lib.broker import Broker
        from scheduler_lib.scheduler import Target, init

        OURS_HANDLES[:] = setup_broker(url, CONVERSATIONS)
        with Broker(url, migrate=False, timers=False) as broker:
            init(broker, targets=[Target(activation=False)])
    elif system == "raw":
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_raw (id bigserial PRIMARY KEY, body bytea NOT NULL)")
            # The ceiling is woken as every system is: one NOTIFY per inserting statement
            # (bench.peers.worker.raw_worker LISTENs while the table is empty).
            conn.execute(
                "CREATE FUNCTION bench_raw_notify() RETURNS trigger LANGUAGE plpgsql AS "
                "$$BEGIN PERFORM pg_notify('bench_raw', ''); RETURN NULL; END$$"
            )
            conn.execute(
                "CREATE TRIGGER bench_raw_notify AFTER INSERT ON bench_raw "
                "FOR EACH STATEMENT EXECUTE FUNCTION bench_raw_notify()"
            )
    elif system == "procrastinate":

        async def install() -> None:
            from bench.peers.worker import procrastinate_app

            app = procrastinate_app(url)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(install())
    elif system == "pgqueuer":

        async def install() -> None:
            import asyncpg
            from pgqueuer import AsyncpgDriver, Queries

            conn = await asyncpg.connect(url)
            await Queries(AsyncpgDriver(conn)).install()
            await conn.close()

        asyncio.run(install())
    with psycopg.connect(url, autocommit=True) as conn:  # nobody may stay connected
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    return name


def drop_templates() -> None:
    for name in TEMPLATES.values():
        drop(name)
    TEMPLATES.clear()


def scalar(url: str, sql: str, *args: Any) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql, args or None).fetchone()
    return row[0] if row else None


# --- Redis (Celery) ---------------------------------------------------------------------

REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


class Redis:
    """The local Redis, started if it is installed and down (and shut down again then)."""

    def __init__(self) -> None:
        import redis

        self.module = redis
        self.started = False
        self.client = redis.Redis(host="127.0.0.1", port=6379)
        try:
            self.client.ping()
        except redis.exceptions.ConnectionError:
            log("Redis is not running: starting it")
            subprocess.run(REDIS_START, check=True)
            deadline = time.monotonic() + 20
            while True:
                try:
                    self.client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            self.started = True
        self.version = self.client.info("server")["redis_version"]

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """An empty Redis database (the highest-numbered empty one); flushed afterwards."""
        for db in range(15, 0, -1):
            client = self.module.Redis(host="127.0.0.1", port=6379, db=db)
            if client.dbsize() == 0 and client.set("bench-peers-claim", "1", nx=True):
                break
        else:
            raise RuntimeError("no empty Redis database among 1..15")
        try:  # the claim key stays while it is in use (flush() sets it again)
            yield f"redis://127.0.0.1:6379/{db}"
        finally:
            client.flushdb()
            client.close()

    def flush(self, url: str) -> None:
        """Empty a database this run uses, keeping it claimed."""
        client = self.module.Redis.from_url(url)
        client.flushdb()
        client.set("bench-peers-claim", "1")
        client.close()

    def close(self) -> None:
        if self.started:
            with contextlib.suppress(Exception):
                self.client.shutdown(nosave=True)
        self.client.close()


# --- worker processes ------------------------------------------------------------------


class WorkerProcess:
    """A worker side in its own process: started, waited for, stopped, its records read."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        *,
        ready: bool = True,
        out: str | None = None,
    ) -> None:
        self.out = out
        # kept open for the process's life, closed by stop()
        self.err = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="bench-peers-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        if ready:
            self._wait_ready()

    @classmethod
    def peer(
        cls, system: str, url: str, role: str, top: int = 1, concurrency: int = 4
    ) -> WorkerProcess:
        """``bench.peers.worker`` for ``system`` in a process of its own, once READY."""
        fd, out = tempfile.mkstemp(prefix="bench-peers-", suffix=".json")
        os.close(fd)
        config = {
            "system": system,
            "url": url,
            "role": role,
            "top": top,
            "concurrency": concurrency,
            "out": out,
        }
        return cls([sys.executable, "-m", "bench.peers.worker", json.dumps(config)], out=out)

    @classmethod
    def peers(
        cls,
        system: str,
        url: str,
        role: str,
        top: int = 1,
        concurrency: int = 4,
        processes: int = 1,
    ) -> WorkerGroup:
        """``processes`` of :meth:`peer`, sharing ``concurrency`` between them (a
        deployment of several worker processes), all READY."""
        each = max(1, concurrency // processes)
        group = WorkerGroup([])
        try:
            for _ in range(processes):
                group.workers.append(cls.peer(system, url, role, top=top, concurrency=each))
        except BaseException:
            group.stop()
            raise
        return group

    def _wait_ready(self) -> None:
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self.proc.stdout.readline() if self.proc.stdout else ""),
            daemon=True,
        )
        reader.start()
        reader.join(READY_TIMEOUT)
        if not line or line[0].strip() != "READY":
            self.stop()
            raise RuntimeError(f"worker did not start: {self.stderr_tail()}")

    def stderr_tail(self, chars: int = 3000) -> str:
        self.err.flush()
        return Path(self.err.name).read_text(errors="replace")[-chars:]

    def children(self) -> list[int]:
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as fh:
                return [int(x) for x in fh.read().split()]
        except OSError:
            return []

    def stop(self, timeout: float = 30.0) -> list[list[Any]]:
        """SIGTERM, wait, and (if it hangs) SIGKILL it and its children; its records."""
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"worker {self.proc.pid} did not stop in {timeout} s: killing it")
            for pid in [*self.children(), *kids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(10)
        for pid in kids:  # Celery's prefork children end with their parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                time.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
        records: list[list[Any]] = []
        if self.out is not None:
            try:
                text = Path(self.out).read_text()
                if text:
                    records = json.loads(text)["records"]
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(self.out)
        if self.proc.returncode not in (0, -signal.SIGTERM):
            raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.stderr_tail()}")
        with contextlib.suppress(OSError):
            os.unlink(self.err.name)
        return records


def celery_worker(redis_url: str, concurrency: int, prefetch: int) -> WorkerProcess:
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.peers.celery_app",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        str(concurrency),
        "--prefetch-multiplier",
        str(prefetch),
        "--queues",
        "bench",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel",
        "WARNING",
    ]
    env = {"BENCH_CELERY_REDIS": redis_url, "BENCH_CELERY_PREFETCH": str(prefetch)}
    return WorkerProcess(cmd, env, ready=False)


class WorkerGroup:
    """Several worker processes of one system: stopped together, their records merged."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers

    def stop(self) -> list[list[Any]]:
        records: list[list[Any]] = []
        for worker in self.workers:
            records.extend(worker.stop())
        return records


def celery_module(redis_url: str, prefetch: int) -> Any:
    """``bench.peers.celery_app`` configured for this run's Redis database (one per run;
    the module reads it from the environment when first imported)."""
    os.environ["BENCH_CELERY_REDIS"] = redis_url
    os.environ["BENCH_CELERY_PREFETCH"] = str(prefetch)
    from bench.peers import celery_app as module

    if redis_url != module.REDIS_URL:
        raise RuntimeError("bench.peers.celery_app was imported for another Redis database")
    return module


def celery_ready(module: Any, worker: WorkerProcess) -> None:
    """Celery is ready when a task round trip works (this also warms it up)."""
    deadline = time.monotonic() + READY_TIMEOUT
    result = module.noop.apply_async(args=["ready"])
    while True:
        try:
            result.get(timeout=2)
            return
        except Exception as exc:  # celery.exceptions.TimeoutError
            if worker.proc.poll() is not None or time.monotonic() > deadline:
                worker.stop()
                raise RuntimeError(f"Celery worker did not start: {worker.stderr_tail()}") from exc


# --- checks ----------------------------------------------------------------------------


def check_exactly_once(tags: list[str], expected: set[str], what: str) -> None:
    """Every expected tag exactly once, nothing else: or a loud failure."""
    counts = collections.Counter(tags)
    missing = expected - counts.keys()
    extra = counts.keys() - expected
    twice = [t for t, c in counts.items() if c > 1]
    if missing or extra or twice:
        raise RuntimeError(
            f"{what}: {len(missing)} missing, {len(extra)} unexpected, {len(twice)} handled "
            f"more than once (e.g. {sorted(missing)[:3]} {sorted(extra)[:3]} {twice[:3]})"
        )


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {timeout} s")
        time.sleep(DONE_POLL)


def jitter() -> None:
    """The idle pause between dispatch samples (workers back in their wait)."""
    time.sleep(random.uniform(0.02, 0.04))
