"""The accounting test: a 10-wave plan run with the documented commands (`scheduler-lib
serve` and `scheduler-lib run PLAN --json`, separate processes, default settings) while
the PostgreSQL server restarts 20 times at seeded random instants. Every task runs
exactly once, ``execution_log`` agrees with the marks the tasks left outside the database,
no row is left RUNNING, ``run`` exits 0, and it takes no longer than the plan's own
makespan plus the outages plus 5 s per restart.

A failure prints its seed; ``RESILIENCE_SEED=N`` replays it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from marking_tasks import marks
from private_postgres import PrivatePostgres

from bench import processes
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Target, init

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

HERE = Path(__file__).parent
WAVES, TASKS, TASK_SECONDS = 10, 6, 0.3
RESTARTS = 20
SERVED = 60.0  # seconds for `serve` to monitor the target queue


def _plan(path: Path, marks_file: Path) -> Path:
    lines = ["policy: fail_fast", "waves:"]
    for w in range(WAVES):
        for t in range(TASKS):
            lead = "  - - " if t == 0 else "    - "
            lines.append(
                f'{lead}{{kind: python, callable: "marking_tasks:mark", name: w{w}t{t}, '
                f'args: ["{marks_file}", "w{w}t{t}", {TASK_SECONDS}]}}'
            )
    path.write_text("\n".join(lines) + "\n")
    return path


class Restarter(threading.Thread):
    """Restarts (or stops for a while) the server at seeded random instants until told
    to stop or ``RESTARTS`` are done; adds up how long it was away."""

    def __init__(self, server: PrivatePostgres, seed: int) -> None:
        super().__init__(daemon=True)
        self.server, self.random = server, random.Random(seed)
        self.done = threading.Event()
        self.restarts, self.away = 0, 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.restarts < RESTARTS:
                # The up time between outages is the random instant: this wait is the
                # schedule, not a hope that something happened.
                if self.done.wait(self.random.uniform(0.2, 1.2)):
                    return
                started = time.monotonic()
                if self.random.random() < 0.5:
                    self.server.restart(mode=self.random.choice(["fast", "immediate"]))
                else:
                    self.server.stop_for(self.random.uniform(0.3, 2.0))
                self.away += time.monotonic() - started
                self.restarts += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()])}


@pytest.fixture
def serve(
    private_db_url: str, env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[subprocess.Popen[bytes]]:
    """`scheduler-lib init` and `scheduler-lib serve`, as the README gives them, once serve
    monitors the target queue; the test's ``retries`` parameter (default 0) is set on the
    target before serve starts."""
    processes.init(private_db_url, env)
    retries = getattr(request, "param", 0)
    if retries:
        with Broker(private_db_url, timers=False) as broker:
            init(broker, targets=[Target(retries=retries)])
    with processes.Processes(tmp_path, env) as started:
        process = started.start("serve", "serve", "--db", private_db_url)
        started.wait_monitored(process, private_db_url, SERVED)
        yield process


def _account(
    url: str,
    server: PrivatePostgres,
    serve: subprocess.Popen[bytes],
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("RESILIENCE_SEED", random.randrange(1_000_000)))
    print(f"RESILIENCE_SEED={seed}")
    marks_file = tmp_path / "marks"
    plan = _plan(tmp_path / "plan.yaml", marks_file)
    # Given the plan running, When the server restarts 20 times under it
    restarter = Restarter(server, seed)
    started = time.monotonic()
    run = subprocess.Popen(
        [processes.CLI, "run", str(plan), "--db", url, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    restarter.start()
    try:
        out, err = run.communicate(timeout=600)
    finally:
        restarter.done.set()
        restarter.join(60)
        if run.poll() is None:
            run.kill()
    took = time.monotonic() - started
    context = f"seed {seed}, {restarter.restarts} restarts; stderr:\n{err[-3000:]}"
    assert restarter.error is None, f"{restarter.error!r} ({context})"
    if not server.is_accepting():
        server.start()
    assert serve.poll() is None, f"serve died ({context})"
    # Then `run` exits 0 with a full report
    assert run.returncode == 0, f"run exited {run.returncode}; {context}\nstdout:\n{out[-3000:]}"
    report = json.loads(out)
    assert report["ok"] is True, context
    # And it said so while it waited: a progress line, not an error
    assert "database unavailable, retrying for 120 s" in err, context
    assert "database back: continuing" in err and "Traceback" not in err, context
    names = {f"w{w}t{t}" for w in range(WAVES) for t in range(TASKS)}
    # And every task ran exactly once, by the marks it left outside the database
    starts, ends = marks(marks_file)
    assert set(starts) == names and set(ends) == names, context
    assert [n for n in names if starts[n] != 1 or ends[n] != 1] == [], (starts, ends, context)
    # And execution_log agrees, row for row: no RUNNING row, one attempt each
    with Broker(url, timers=False) as broker:
        broker.use_queries("scheduler_lib.scheduler")
        rows = broker.fetch("log_recent", limit=1000)
    assert sorted(r["task_name"] for r in rows) == sorted(names), context
    bad = [
        (r["task_name"], r["status"], r["attempts"], r["end_time"])
        for r in rows
        if r["status"] != "SUCCEEDED" or r["attempts"] != 1 or r["end_time"] is None
    ]
    assert bad == [], context
    # And it took no longer than the plan's own makespan (one reader doing everything)
    # plus the outages plus 5 s per restart
    makespan = WAVES * TASKS * TASK_SECONDS
    bound = makespan + restarter.away + 5 * restarter.restarts
    assert took <= bound, f"{took:.1f} s > {bound:.1f} s ({context})"
    assert restarter.restarts >= 5, context  # the run lasted long enough to be tested


@pytest.mark.parametrize("serve", [0, 1], indirect=True, ids=["retries=0", "retries=1"])
def test_every_task_runs_once_through_twenty_restarts(
    private_db_url: str,
    private_postgres: PrivatePostgres,
    serve: subprocess.Popen[bytes],
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    # (with retries=1, a task that completed must not run again either)
    _account(private_db_url, private_postgres, serve, env, tmp_path)
