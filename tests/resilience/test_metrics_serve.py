"""`scheduler-lib serve --metrics-port` as an operator scrapes it: a separate process with
default settings on a private PostgreSQL server, tasks waiting and running, Prometheus's
text format parsed by prometheus_client's own parser; then the database stopped and
started again under it: /healthz says which check failed (503) and recovers (200), the
scrape says ``database_up 0`` instead of failing, and serve lives on."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from multiproc import poll
from private_postgres import PrivatePostgres

from bench.processes import Processes
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Target, Task, TaskScheduler, init
from tests.scrape import Series, samples

READERS = 2  # the target's max_queue_readers: tasks beyond it wait, ready
TASKS = 5
SLEEP = 120.0  # seconds each task runs: longer than the test, which cancels them


def scrape(port: int) -> dict[Series, float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    return samples(f"http://127.0.0.1:{port}/metrics")


def health(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def broker(private_db_url: str) -> Iterator[Broker]:
    with Broker(private_db_url) as broker:
        init(broker, targets=[Target(max_readers=READERS)])
        yield broker


@pytest.mark.postgres
@pytest.mark.timeout(300)
@pytest.mark.parametrize("readers", ["thread", "process"])
def test_serve_shows_its_queues_and_tasks_and_says_when_the_database_is_gone(
    broker: Broker,
    private_db_url: str,
    private_postgres: PrivatePostgres,
    tmp_path: Path,
    readers: str,
) -> None:
    queue = Target.queue
    with Processes(tmp_path) as processes:
        # Given `scheduler-lib serve` with its metrics port (0: a free one, which it says),
        # its readers threads (the default) or processes (whose counts it adds to its own)
        serve = processes.start(
            "serve",
            *("serve", "--db", private_db_url, "--metrics-port", "0", "--readers", readers),
        )
        processes.wait_said(serve, "health on /healthz", 60)
        said = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", processes.stdout(serve))
        assert said is not None, processes.output(serve)
        port = int(said.group(1))
        assert health(port) == (
            200,
            {
                "healthy": True,
                "checks": {
                    "database": {"ok": True, "detail": "answers"},
                    "readers": {"ok": True, "detail": "looping, 0 reader(s) running"},
                },
            },
        )
        # When a wave of two runs, one failing
        scheduler = TaskScheduler(broker)
        wave = [Task.python("math:sqrt", 4.0), Task.python("math:sqrt", -1.0)]
        report = scheduler.run_waves([wave], policy="continue")
        assert sorted(c.ok for c in report.completions) == [False, True]
        # Then serve's own counters say how they ended, and how long they waited and ran
        # (counted once the answer committed: the caller may see it first)
        labels = (("kind", "python"), ("queue", Target.queue))
        durations = ("scheduler_lib_task_duration_seconds_count", labels)
        ran = poll(
            lambda: (lambda seen: seen if seen.get(durations) == 2 else None)(scrape(port)),
            30,
            "both tasks counted",
        )
        for status in ("SUCCEEDED", "FAILED"):
            sample = ("scheduler_lib_tasks_finished_total", (*labels, ("status", status)))
            assert ran[sample] == 1, sorted(k for k in ran if "finished" in k[0])
        assert ran[("scheduler_lib_task_duration_seconds_count", labels)] == 2
        assert ran[("scheduler_lib_task_dispatch_latency_seconds_count", labels)] == 2
        assert 0 < ran[("scheduler_lib_task_dispatch_latency_seconds_sum", labels)] < 60
        # And its broker's: it received the two tasks (the caller sent them, in this
        # process; the scheduler's EndDialog may follow) and sent their answers
        assert ran[("scheduler_lib_messages_received_total", (("queue", queue),))] >= 2
        answers = [v for (name, _), v in ran.items() if name == "scheduler_lib_messages_sent_total"]
        assert sum(answers) >= 2, sorted(k for k in ran if "messages" in k[0])
        # When more tasks are sent than the target runs at once
        handle = scheduler.get_scheduler()
        scheduler.exec_many(
            handle, [Task.python("time:sleep", SLEEP, name=f"sleep {i}") for i in range(TASKS)]
        )
        # Then the scrape shows the running ones leased and the rest ready, waiting
        target = Target.service

        def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            seen = scrape(port)
            running = seen.get(
                (
                    "scheduler_lib_tasks",
                    (("kind", "python"), ("status", "RUNNING"), ("target", target)),
                )
            )
            leased = seen.get(
                ("scheduler_lib_queue_messages", (("queue", queue), ("state", "leased")))
            )
            return seen if running == leased == READERS else None

        first = poll(settled, 60, f"{READERS} tasks running", explain=lambda: scrape(port))
        q = (("queue", queue),)
        assert first[("scheduler_lib_database_up", ())] == 1
        assert first[("scheduler_lib_queue_messages", (*q, ("state", "ready")))] == TASKS - READERS
        assert first[("scheduler_lib_queue_messages", (*q, ("state", "leased")))] == READERS
        assert first[("scheduler_lib_queue_messages", (*q, ("state", "held")))] == 0
        assert first[("scheduler_lib_queue_readers", q)] == READERS
        assert first[("scheduler_lib_queue_max_readers", q)] == READERS
        assert first[("scheduler_lib_queue_enabled", q)] == 1
        assert first[("scheduler_lib_queue_leases_expired", q)] == 0
        queued = (
            "scheduler_lib_tasks",
            (("kind", "python"), ("status", "QUEUED"), ("target", target)),
        )
        assert first[queued] == TASKS - READERS
        age = ("scheduler_lib_queue_oldest_message_age_seconds", q)
        assert first[age] > 0
        # and the oldest waiting message ages from one scrape to the next
        poll(lambda: scrape(port)[age] >= first[age] + 0.5, 30, "the oldest message's age grows")
        assert first[("process_resident_memory_bytes", ())] > 0  # the process collector

        # When the database stops under it
        private_postgres.stop()
        try:
            # Then /healthz says the database check failed, and the scrape says so too
            _, said = poll(
                lambda: (lambda h: h if h[0] == 503 else None)(health(port)),
                60,
                "/healthz 503",
            )
            checks = said["checks"]
            assert isinstance(checks, dict)
            assert checks["database"]["ok"] is False, said
            assert checks["readers"]["ok"] is True, said  # the runtime still loops
            down = scrape(port)
            assert down[("scheduler_lib_database_up", ())] == 0
            assert not any(name == "scheduler_lib_queue_messages" for name, _ in down)
        finally:
            private_postgres.start()
        # And once it is back, healthy again, with the same tasks where they were
        poll(lambda: health(port)[0] == 200, 60, "/healthz 200 after the restart")
        back = poll(settled, 60, f"{READERS} tasks running after the restart")
        assert back[("scheduler_lib_queue_messages", (*q, ("state", "ready")))] == TASKS - READERS
        assert serve.poll() is None, processes.output(serve)
        scheduler.cancel(handle, "test over")


def test_a_taken_metrics_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with Processes(tmp_path) as processes:
            db = f"sqlite:///{tmp_path / 'b.db'}"
            serve = processes.start("serve", "serve", "--db", db, "--metrics-port", str(port))
            assert serve.wait(60) != 0
            err = (tmp_path / "serve.err").read_text()
    assert len(err.strip().splitlines()) == 1, err
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "--metrics-port" in err, err
    assert "Traceback" not in err
