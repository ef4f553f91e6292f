"""Activation (seed 000, DESIGN.md section 6), on SQLite and on PostgreSQL.

Where time matters, the runtime and the broker share a fake clock (``FakeClock``): rules
are applied by calling ``ActivationRuntime.check`` directly after moving the clock, so a
decision never depends on how fast the machine is. Where a trigger is under test, the
runtime is started with a check interval far longer than the test's deadline, so a
prompt reaction can only come from the trigger. Readers are the procedures of
``activation_procedures.py``. Nothing waits by sleeping: every wait is a condition
polled up to a deadline, and every runtime and child process is stopped in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import activation_procedures as procs
import pytest

from scheduler_lib.broker import Broker, counters
from scheduler_lib.broker.activation import ActivationRuntime, Decision
from scheduler_lib.broker.launcher import Launcher

T = TypeVar("T")

JOB = "Job"
CONTRACT = "JobContract"
CLIENT_QUEUE = "Client"
CLIENT_SERVICE = "ClientService"
WORK = "Work"
WORK_SERVICE = "WorkService"
EVENTS_QUEUE = "ActivationEvents"
EVENTS_SERVICE = "ActivationEventsService"
PROCEDURE = "activation_procedures.reader"
EXECUTE_AS = "activation_tester"

GRACE = 1.0  # fake seconds: empty_grace of the runtimes under test
LONG = 60.0  # real seconds: a check interval no test waits for
DEADLINE = 10.0  # real seconds for anything that should happen promptly
POLL = 0.01  # real seconds between looks at a condition
INTEGRATION_DIR = Path(__file__).resolve().parent
SCHEDULER_LIB = Path(sys.executable).with_name("scheduler-lib")


# --- helpers -------------------------------------------------------------------------


class FakeClock:
    """Seconds since the epoch that move only when a test moves them."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def eventually(predicate: Callable[[], T], timeout: float = DEADLINE) -> T | None:
    """The predicate's first truthy value within ``timeout``, else ``None``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL)


def wait_for(predicate: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    value = eventually(predicate, timeout)
    if not value:
        pytest.fail(f"timed out after {timeout}s waiting for {what}")
    return value


def make_catalog(
    broker: Broker,
    *,
    activation: bool = True,
    max_readers: int = 1,
    procedure: str | None = PROCEDURE,
) -> None:
    """Jobs go from ``ClientService`` to ``WorkService`` on the activating queue ``Work``."""
    broker.create_message_type(JOB, "JSON")
    broker.create_contract(CONTRACT, {JOB: "INITIATOR"})
    broker.create_queue(CLIENT_QUEUE)
    broker.create_queue(
        WORK,
        activation_status=activation,
        activation_procedure=procedure,
        max_queue_readers=max_readers,
        execute_as=EXECUTE_AS,
    )
    broker.create_service(CLIENT_SERVICE, CLIENT_QUEUE)
    broker.create_service(WORK_SERVICE, WORK, [CONTRACT])


def send_jobs(
    broker: Broker, specs: list[dict[str, Any]], *, one_conversation: bool = False
) -> None:
    """One message per spec, each on a conversation of its own (or all on one)."""
    with broker.transaction() as tx:
        handle = None
        for spec in specs:
            if handle is None or not one_conversation:
                handle = tx.begin_dialog(CLIENT_SERVICE, WORK_SERVICE, CONTRACT)
            tx.send(handle, JOB, json.dumps(spec))


def activations(decision: str) -> float:
    """This process's count of activation decisions on ``Work`` (``/metrics``)."""
    labels = {"queue": WORK, "decision": decision}
    return counters.REGISTRY.get_sample_value("scheduler_lib_activations_total", labels) or 0.0


def monitor_row(broker: Broker, queue: str = WORK) -> dict[str, Any]:
    rows = [dict(m) for m in broker.queue_monitors() if m["queue_name"] == queue]
    assert rows, f"no queue monitor for {queue}"
    return rows[0]


def has_monitor(broker: Broker, queue: str = WORK) -> bool:
    return any(m["queue_name"] == queue for m in broker.queue_monitors())


def tasks(broker: Broker, queue: str = WORK) -> list[dict[str, Any]]:
    return [dict(t) for t in broker.activated_tasks() if t["queue_name"] == queue]


def numbers(kind: str) -> list[Any]:
    return [e["n"] for e in procs.events(kind)]


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def event_count(kind: str, count: int) -> Callable[[], bool]:
    """A predicate: at least ``count`` events of this kind were recorded."""
    return lambda: len(procs.events(kind)) >= count


def started_count(count: int) -> Callable[[], bool]:
    """A predicate: exactly ``count`` messages were taken by readers (their RECEIVEs
    committed)."""
    return lambda: len(procs.events("taken")) == count


def ensure_monitor(broker: Broker, queue: str = WORK) -> None:
    """Create the queue's monitor row the way runtimes do (their supervisor), so that a
    runtime that is never started can apply the rules with ``check``. Call it while the
    queue is empty: the helper runtime must not start readers."""
    helper = ActivationRuntime(broker, check_interval=LONG).start()
    try:
        wait_for(lambda: has_monitor(broker, queue), "monitor")
    finally:
        helper.stop(timeout=10)


def decide(runtime: ActivationRuntime, queue: str = WORK) -> Decision:
    """Apply the rules once; the queue must still activate."""
    decision = runtime.check(queue)
    assert decision is not None, f"{queue} has no queue monitor"
    return decision


def stop(runtime: ActivationRuntime) -> None:
    """Release held readers, then stop the runtime and wait for them."""
    procs.GATE.set()
    runtime.stop(timeout=20)


@contextlib.contextmanager
def started(runtime: ActivationRuntime) -> Iterator[ActivationRuntime]:
    runtime.start()
    try:
        yield runtime
    finally:
        stop(runtime)


def all_readers_gone(broker: Broker, runtime: ActivationRuntime) -> bool:
    return runtime.readers == 0 and not tasks(broker)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for CLI subprocesses: they can import ``activation_procedures``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(INTEGRATION_DIR), env.get("PYTHONPATH")) if p
    )
    env[procs.RECEIVE_TIMEOUT_ENV] = "0.3"
    env["PYTHONFAULTHANDLER"] = "1"  # a hung child shows its threads on SIGABRT
    env.update(extra)
    return env


@contextlib.contextmanager
def serving(db_url: str, readers: str = "thread") -> Iterator[subprocess.Popen[str]]:
    """``scheduler-lib serve`` as a child process; killed on the way out if still alive."""
    process = subprocess.Popen(
        [str(SCHEDULER_LIB), "serve", "--db", db_url, "--readers", readers],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for pipe in (process.stdout, process.stderr):  # reader processes may hold them
            if pipe is not None:
                pipe.close()


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_procedures() -> Iterator[None]:
    procs.reset()
    yield
    procs.GATE.set()  # never leave a reader of a failed test held
    procs.reset()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clocked(db_url: str, clock: FakeClock) -> Iterator[Broker]:
    """A broker that stamps empty RECEIVEs with the fake clock."""
    b = Broker(db_url, clock=clock, timers=False)
    try:
        yield b
    finally:
        b.close()


# --- rule (a): a message arrives and no reader runs ----------------------------------


def test_idle_queue_starts_nothing_and_a_first_message_starts_one_reader(
    clocked: Broker, clock: FakeClock
) -> None:
    make_catalog(clocked, max_readers=3)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    started = activations("started")
    try:
        assert runtime.check(WORK) == Decision(WORK, False, 0, 0, 0)
        clock.advance(100 * GRACE)
        assert runtime.check(WORK) == Decision(WORK, False, 0, 0, 0)
        assert monitor_row(clocked)["state"] == "INACTIVE"

        assert activations("started") == started  # an idle queue decides nothing
        send_jobs(clocked, [{"n": 1, "hold": "after"}])
        assert runtime.check(WORK) == Decision(WORK, True, 0, 1, 0)
        assert activations("started") == started + 1  # /metrics counts the reader started
        wait_for(lambda: numbers("taken") == [1], "the reader to take message 1")
        # A reader runs: another arrival alone starts nobody (rule (b) needs the grace).
        send_jobs(clocked, [{"n": 2}])
        assert runtime.check(WORK) == Decision(WORK, True, 1, 0, 0)

        procs.GATE.set()
        wait_for(lambda: all_readers_gone(clocked, runtime), "the reader to exit")
        assert numbers("done") == [1, 2]
        assert len(procs.events("enter")) == 1
    finally:
        stop(runtime)


def test_no_reader_while_max_queue_readers_is_zero_or_the_queue_is_disabled(
    clocked: Broker, clock: FakeClock
) -> None:
    make_catalog(clocked, max_readers=0)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    at_max = activations("at_max_readers")
    try:
        send_jobs(clocked, [{"n": 1}])
        assert runtime.check(WORK) == Decision(WORK, True, 0, 0, 0)
        # /metrics counts a message waiting for a reader the limit does not allow
        assert activations("at_max_readers") == at_max + 1
        clocked.alter_queue(WORK, status=False, max_queue_readers=1)
        clock.advance(10 * GRACE)
        assert runtime.check(WORK) == Decision(WORK, True, 0, 0, 0)
        clocked.alter_queue(WORK, status=True)
        assert runtime.check(WORK) == Decision(WORK, True, 0, 1, 0)
        wait_for(lambda: all_readers_gone(clocked, runtime), "the reader to exit")
        assert numbers("done") == [1]
    finally:
        stop(runtime)


# --- rule (b): messages pile up, nobody waits in RECEIVE ----------------------------


def test_burst_on_50_conversations_ramps_readers_to_max_queue_readers_and_no_further(
    clocked: Broker, clock: FakeClock
) -> None:
    maximum = 4
    make_catalog(clocked, max_readers=maximum)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    try:
        # Each reader takes a message and stays busy with it (outside its transaction).
        send_jobs(clocked, [{"n": i, "hold": "after"} for i in range(50)])
        for running in range(maximum):
            if running:
                # Within the grace after the last start nobody more is started ...
                assert runtime.check(WORK) == Decision(WORK, True, running, 0, 0)
                clock.advance(GRACE)
            # ... after it, with nobody waiting in RECEIVE, one more.
            assert runtime.check(WORK) == Decision(WORK, True, running, 1, 0)
            wait_for(started_count(running + 1), f"reader {running + 1}")
        for _ in range(3):
            clock.advance(10 * GRACE)
            assert runtime.check(WORK) == Decision(WORK, True, maximum, 0, 0)
        assert len(tasks(clocked)) == maximum
        row = monitor_row(clocked)
        assert (row["tasks_running"], row["messages_ready"]) == (maximum, 50 - maximum)

        procs.GATE.set()
        wait_for(lambda: all_readers_gone(clocked, runtime), "the readers to drain and exit")
        assert sorted(numbers("done")) == list(range(50))
        assert len({e["thread"] for e in procs.events("start")}) == maximum
    finally:
        stop(runtime)


def test_backlog_on_one_conversation_never_runs_more_than_two_readers(
    clocked: Broker, clock: FakeClock
) -> None:
    """Seed: one reader works on the conversation, a second waits in RECEIVE (the group
    is locked); while it waits the monitor starts no third reader."""
    make_catalog(clocked, max_readers=5)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    backlog = 40  # more than the steps below can drain; the rest goes fast at the end
    procs.RECEIVE_TIMEOUT = 1.0  # the waiting reader outwaits a message's work (0.25 s)
    try:
        # Each message takes 0.25 s of work inside the transaction (the group lock held).
        send_jobs(
            clocked,
            [{"n": i, "hold": "tx", "work": 0.25} for i in range(backlog)],
            one_conversation=True,
        )
        assert runtime.check(WORK) == Decision(WORK, True, 0, 1, 0)
        wait_for(lambda: numbers("start"), "the first reader to take a message")
        clock.advance(GRACE)
        # Nobody waited in RECEIVE during the grace: the seed's second reader starts
        # (on SQLite a reader queued for the write lock may already count as waiting).
        second = decide(runtime)
        assert (second.readers_running, second.readers_started) in ((1, 1), (1, 0))

        steps = 0
        unstamped = 0
        while len(numbers("done")) < backlog - 2 and steps < 6:
            steps += 1
            clock.advance(GRACE / 2)

            # The waiting reader re-stamps its empty RECEIVE with the new time (poke wakes
            # it; stamps are rate-limited to one per 0.25 s). With the default 3 s grace a
            # half-grace step is 1.5 s, in which a waiting reader stamps at least once.
            def restamped() -> bool:
                runtime.poke(WORK)
                stamps = (
                    monitor_row(clocked)["last_empty_rowset_at"],
                    # SQLite: receivers queued for the write lock, noted in memory
                    clocked.waiting.last_waiting_receiver(WORK),
                )
                return max((t for t in stamps if t is not None), default=0) >= clock.now

            unstamped += not eventually(restamped, timeout=2.0)
            decision = decide(runtime)
            assert decision.readers_running + decision.readers_started <= 2, (
                f"a third reader started for a one-conversation backlog at step {steps} "
                f"({decision}); steps without a fresh empty-RECEIVE stamp: {unstamped}"
            )
        assert steps >= 4, "the backlog drained too fast to observe two graces"

        procs.GATE.set()
        wait_for(lambda: all_readers_gone(clocked, runtime), "the readers to exit")
        # One conversation: taken in order (a reader records "start" under the group lock).
        assert numbers("start") == list(range(backlog))
        assert sorted(numbers("done")) == list(range(backlog))
        assert max_concurrent_readers() <= 2
        if clocked.dialect == "postgresql":  # one working, one waiting, as in the seed
            assert max_concurrent_readers() == 2, procs.events()
    finally:
        stop(runtime)


def max_concurrent_readers() -> int:
    """The most readers of this process that ran at once (from their enter/exit events)."""
    timeline = sorted(
        [(e["at"], 1) for e in procs.events("enter")]
        + [(e["at"], -1) for e in procs.events("exit")]
    )
    running = most = 0
    for _, step in timeline:
        running += step
        most = max(most, running)
    return most


def test_only_unfiltered_empty_receives_count_as_a_waiting_reader(
    clocked: Broker, clock: FakeClock
) -> None:
    make_catalog(clocked, max_readers=0)
    ensure_monitor(clocked)
    send_jobs(clocked, [{"n": 1}])
    [message] = clocked.receive(WORK, timeout=0)
    assert monitor_row(clocked)["last_empty_rowset_at"] is None  # it found a message

    assert clocked.receive(WORK, timeout=0, conversation=message.conversation_handle) == []
    assert clocked.receive(WORK, timeout=0, group=message.conversation_group_id) == []
    assert monitor_row(clocked)["last_empty_rowset_at"] is None  # filtered: not waiting

    assert clocked.receive(WORK, timeout=0) == []
    assert monitor_row(clocked)["last_empty_rowset_at"] == clock.now
    assert monitor_row(clocked)["state"] == "RECEIVES_OCCURRING"

    clock.advance(5 * GRACE)  # GET CONVERSATION GROUP without WHERE counts too
    wait_for(
        lambda: (
            clocked.get_conversation_group(WORK, timeout=0) is None
            and monitor_row(clocked)["last_empty_rowset_at"] == clock.now
        ),
        "an empty GET CONVERSATION GROUP to stamp the monitor",
    )


# --- triggers ------------------------------------------------------------------------


def test_monitor_rechecks_at_once_on_each_trigger(
    db_url: str, clocked: Broker, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrival (this process and another broker), RECEIVE, rollback of a RECEIVE, ALTER,
    and all readers exited each make the monitor check again well before its interval."""
    make_catalog(clocked, max_readers=0)  # no reader can start: only checks happen
    runtime = ActivationRuntime(clocked, clock=clock, check_interval=LONG)
    checks: list[tuple[float, Decision | None]] = []
    original = runtime.check

    def counting(queue: str) -> Decision | None:
        began = time.monotonic()
        decision = original(queue)
        checks.append((began, decision))
        return decision

    monkeypatch.setattr(runtime, "check", counting)

    def rechecked_after(action: Callable[[], object], what: str) -> Decision | None:
        mark = time.monotonic()
        action()
        found = wait_for(lambda: [d for began, d in checks if began > mark], f"check on {what}")
        return found[0]

    def rolled_back_receive() -> None:
        with contextlib.suppress(RuntimeError), clocked.transaction() as tx:
            assert tx.receive(WORK, timeout=0)
            raise RuntimeError("roll back")

    other = Broker(db_url, migrate=False, timers=False)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(other.close)
        cleanup.enter_context(started(runtime))
        wait_for(lambda: checks, "the first check as the monitor starts")
        rechecked_after(lambda: send_jobs(clocked, [{"n": 1}, {"n": 2}]), "arrival")
        rechecked_after(lambda: send_jobs(other, [{"n": 3}]), "arrival from another broker")
        rechecked_after(lambda: clocked.receive(WORK, timeout=0), "RECEIVE")
        rechecked_after(rolled_back_receive, "rollback of a RECEIVE")
        rechecked_after(lambda: clocked.alter_queue(WORK, execute_as="other"), "ALTER QUEUE")

        # All readers exited: the check after the last reader's exit sees none running.
        rechecked_after(lambda: clocked.alter_queue(WORK, max_queue_readers=1), "ALTER")
        exit_event = wait_for(lambda: procs.events("exit"), "the reader to exit")[0]
        wait_for(
            lambda: [
                d
                for began, d in checks
                if began > exit_event["at"] and d is not None and d.readers_running == 0
            ],
            "a check after the last reader exited",
        )
        assert sorted(numbers("done")) == [2, 3]  # 1 went to the RECEIVE above


def test_monitor_rechecks_every_check_interval_unprompted(clocked: Broker) -> None:
    make_catalog(clocked, max_readers=0)
    runtime = ActivationRuntime(clocked, check_interval=0.1)
    checks: list[float] = []
    original = runtime.check

    def counting(queue: str) -> Decision | None:
        checks.append(time.monotonic())
        return original(queue)

    runtime.check = counting  # type: ignore[method-assign]
    with started(runtime):
        wait_for(lambda: len(checks) >= 5, "five unprompted checks", timeout=5)


def test_readers_exit_after_receive_timeout_and_new_ones_start_when_messages_arrive(
    db_url: str, clocked: Broker
) -> None:
    make_catalog(clocked, max_readers=2)
    runtime = ActivationRuntime(clocked, check_interval=LONG)
    sender = Broker(db_url, migrate=False, timers=False)  # arrivals from elsewhere
    try:
        with started(runtime):
            wait_for(lambda: has_monitor(clocked), "the monitor")
            for n in (1, 2):
                send_jobs(sender, [{"n": n}])
                wait_for(event_count("exit", n), f"reader {n} to exit")
                wait_for(lambda: all_readers_gone(clocked, runtime), f"reader {n}'s row to go")
            enters, dones, exits = (procs.events(k) for k in ("enter", "done", "exit"))
            assert [e["n"] for e in dones] == [1, 2]
            assert len(enters) == 2 and len(exits) == 2
            for done, exited in zip(dones, exits, strict=True):
                # the reader waited its receive timeout, then left
                assert exited["at"] - done["at"] >= procs.DEFAULT_RECEIVE_TIMEOUT - 0.05
            assert exits[0]["at"] < enters[1]["at"]  # the second is a new reader
    finally:
        sender.close()


# --- ALTER QUEUE ---------------------------------------------------------------------


def test_alter_max_queue_readers_takes_effect(clocked: Broker, clock: FakeClock) -> None:
    make_catalog(clocked, max_readers=1)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE, check_interval=LONG)
    send_jobs(clocked, [{"n": i, "hold": "after"} for i in range(20)])
    with started(runtime):
        wait_for(lambda: len(numbers("taken")) == 1, "the first reader (rule a)")
        clock.advance(GRACE)
        assert runtime.check(WORK) == Decision(WORK, True, 1, 0, 0)  # at the maximum

        clocked.alter_queue(WORK, max_queue_readers=3)  # the ALTER wakes the monitor
        wait_for(lambda: len(numbers("taken")) == 2, "a second reader after ALTER")
        clock.advance(GRACE)
        runtime.poke(WORK)
        wait_for(lambda: len(numbers("taken")) == 3, "a third reader")
        clock.advance(GRACE)
        assert runtime.check(WORK) == Decision(WORK, True, 3, 0, 0)

        clocked.alter_queue(WORK, max_queue_readers=1)  # lowering stops no reader
        clock.advance(GRACE)
        assert runtime.check(WORK) == Decision(WORK, True, 3, 0, 0)
        assert runtime.readers == 3 and len(tasks(clocked)) == 3

        procs.GATE.set()
        wait_for(lambda: all_readers_gone(clocked, runtime), "the readers to drain and exit")
        assert sorted(numbers("done")) == list(range(20))
        assert len(procs.events("enter")) == 3


def test_alter_queue_activation_on_starts_a_reader_promptly(clocked: Broker) -> None:
    """ALTER QUEUE is a trigger; turning activation on must not wait for the next
    unprompted check."""
    make_catalog(clocked, activation=False, max_readers=1)
    # A second activating queue: its monitor shows that the supervisor has looked once.
    clocked.create_queue(
        "Probe", activation_status=True, activation_procedure=PROCEDURE, max_queue_readers=0
    )
    runtime = ActivationRuntime(clocked, check_interval=LONG)
    send_jobs(clocked, [{"n": 1}])
    with started(runtime):
        wait_for(lambda: has_monitor(clocked, "Probe"), "the supervisor's first look")
        clocked.alter_queue(WORK, activation_status=True)
        wait_for(lambda: numbers("done") == [1], "a reader after ALTER ... STATUS = ON", timeout=5)


# --- external activation -------------------------------------------------------------


def make_event_subscription(broker: Broker) -> None:
    broker.create_queue(EVENTS_QUEUE)
    broker.create_service(EVENTS_SERVICE, EVENTS_QUEUE, ["PostEventNotification"])
    broker.create_event_notification("WorkActivation", WORK, EVENTS_SERVICE)


def test_external_activation_posts_once_per_need_again_after_timeout_or_receive_never_idle(
    clocked: Broker, clock: FakeClock
) -> None:
    timeout = 10 * GRACE
    make_catalog(clocked, activation=False, procedure=None)
    make_event_subscription(clocked)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(
        clocked, clock=clock, empty_grace=GRACE, notification_timeout=timeout
    )
    try:
        # Idle: no event, however long.
        assert runtime.check(WORK) == Decision(WORK, False, 0, 0, 0)
        clock.advance(3 * timeout)
        assert runtime.check(WORK) == Decision(WORK, False, 0, 0, 0)
        assert clocked.peek(EVENTS_QUEUE) == []

        send_jobs(clocked, [{"n": i} for i in range(3)])
        assert runtime.check(WORK) == Decision(WORK, True, 0, 0, 1)
        assert monitor_row(clocked)["state"] == "NOTIFIED"
        # Still needed, but the activator has until the timeout: no second event.
        assert decide(runtime).events_posted == 0
        send_jobs(clocked, [{"n": 3}])
        clock.advance(timeout - GRACE)
        assert decide(runtime).events_posted == 0
        clock.advance(GRACE)  # the timeout passed without a RECEIVE
        assert decide(runtime).events_posted == 1
        assert decide(runtime).events_posted == 0

        assert len(clocked.receive(WORK, timeout=0)) == 1  # the activator RECEIVEs
        assert decide(runtime).events_posted == 1  # messages remain: needed again
        assert decide(runtime).events_posted == 0

        while clocked.receive(WORK, timeout=0):  # drained (the last one comes back empty)
            pass
        assert runtime.check(WORK) == Decision(WORK, False, 0, 0, 0)
        assert monitor_row(clocked)["state"] == "INACTIVE"
        clock.advance(3 * timeout)
        assert decide(runtime).events_posted == 0

        events = clocked.receive(EVENTS_QUEUE, top=100, timeout=0)
        assert [m.message_type_name for m in events] == ["EventNotification"] * 3
        assert len({m.conversation_handle for m in events}) == 1  # one dialog per subscriber
        bodies = [json.loads(m.body or b"") for m in events]
        assert {(b["EventType"], b["ObjectName"]) for b in bodies} == {("QUEUE_ACTIVATION", WORK)}
    finally:
        stop(runtime)


def test_launcher_starts_its_command_once_per_event_up_to_its_cap(
    clocked: Broker, clock: FakeClock, tmp_path: Path
) -> None:
    make_catalog(clocked, activation=False, procedure=None)
    make_event_subscription(clocked)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE, notification_timeout=5)
    out, gate = tmp_path / "launched.txt", tmp_path / "gate"
    script = (
        "import os, sys, time\n"
        "open(sys.argv[1], 'a').write(os.environ['SCHEDULER_LIB_ACTIVATED_QUEUE'] + '\\n')\n"
        "deadline = time.monotonic() + 20\n"
        "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    launcher = Launcher(clocked, EVENTS_QUEUE, [sys.executable, "-c", script, str(out), str(gate)])
    try:
        send_jobs(clocked, [{"n": 1}])
        assert decide(runtime).events_posted == 1
        clock.advance(5)
        assert decide(runtime).events_posted == 1
        assert launcher.run_once(timeout=0) == 1  # the second event finds the cap reached
        assert launcher.events_seen == 2
        gate.touch()
        wait_for(lambda: launcher.running == 0, "the launched command to finish")
        assert out.read_text() == f"{WORK}\n"
        assert launcher.run_once(timeout=0) == 0  # nothing more was posted
    finally:
        gate.touch()
        for process in launcher.processes:
            process.kill()
            process.wait(timeout=10)
        stop(runtime)


# --- what the runtime shows ----------------------------------------------------------


def test_activated_tasks_and_queue_monitors_show_the_readers(
    clocked: Broker, clock: FakeClock
) -> None:
    make_catalog(clocked, max_readers=2)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    try:
        send_jobs(clocked, [{"n": 1, "hold": "after"}, {"n": 2}])
        started_at = clock.now
        assert decide(runtime).readers_started == 1
        wait_for(lambda: numbers("taken"), "the reader to take a message")
        [task] = tasks(clocked)
        assert task["procedure_name"] == PROCEDURE
        assert task["execute_as"] == EXECUTE_AS
        assert task["runtime_id"] == runtime.runtime_id
        assert task["host_name"] == socket.gethostname()
        assert task["process_id"] == os.getpid()
        assert task["reader_name"].startswith("thread-")
        assert task["started_at"] == task["heartbeat_at"] == started_at

        row = monitor_row(clocked)
        assert row["state"] == "RECEIVES_OCCURRING"
        assert (row["tasks_running"], row["messages_ready"]) == (1, 1)
        assert row["last_activated_at"] == started_at

        clock.advance(100)  # far past the expiry: a live runtime vouches, then expires
        assert runtime.heartbeat() == 0
        [task] = tasks(clocked)
        assert task["heartbeat_at"] == clock.now

        procs.GATE.set()
        wait_for(lambda: all_readers_gone(clocked, runtime), "the reader to exit")
        assert monitor_row(clocked)["tasks_running"] == 0
    finally:
        stop(runtime)


@pytest.mark.slow
def test_cli_queues_prints_the_queue_and_its_readers(
    db_url: str, clocked: Broker, clock: FakeClock
) -> None:
    make_catalog(clocked, max_readers=2)
    ensure_monitor(clocked)
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE)
    try:
        send_jobs(clocked, [{"n": 1, "hold": "after"}])
        assert decide(runtime).readers_started == 1
        wait_for(lambda: numbers("taken"), "the reader to take a message")
        result = subprocess.run(
            [str(SCHEDULER_LIB), "queues", "--db", db_url],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        [line] = [x for x in result.stdout.splitlines() if x.startswith(f"{WORK} ")]
        assert line.split()[:5] == [WORK, "ON", PROCEDURE, "1", "2"]
        # The readers themselves (sys.dm_broker_activated_tasks): who runs where.
        for detail in (runtime.runtime_id, str(os.getpid()), socket.gethostname(), EXECUTE_AS):
            assert detail in result.stdout, f"{detail!r} not in:\n{result.stdout}"
    finally:
        stop(runtime)


# --- failures ------------------------------------------------------------------------


def test_a_procedure_that_raises_does_not_kill_the_runtime(
    clocked: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    make_catalog(clocked, max_readers=1)
    runtime = ActivationRuntime(clocked, check_interval=LONG)
    with (
        caplog.at_level(logging.ERROR, logger="scheduler_lib.broker.activation"),
        started(runtime),
    ):
        send_jobs(clocked, [{"n": 1, "raise": True}])
        wait_for(lambda: procs.events("raise"), "the procedure to raise")
        wait_for(lambda: all_readers_gone(clocked, runtime), "the failed reader's row to go")
        send_jobs(clocked, [{"n": 2}])
        wait_for(lambda: procs.events("exit"), "a new reader to serve the new message")
        wait_for(lambda: all_readers_gone(clocked, runtime), "the new reader to exit")
    assert numbers("done") == [1, 2]
    assert len(procs.events("enter")) == 2
    assert any(
        "activation procedure" in r.getMessage() and r.exc_info is not None for r in caplog.records
    )


def test_a_procedure_that_cannot_run_is_not_restarted_in_a_hot_loop(
    clocked: Broker, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A misnamed procedure fails before it RECEIVEs; the message stays. The monitor may
    try again, but not as fast as threads start (while the clock stands still, a few
    attempts at most)."""
    make_catalog(clocked, max_readers=1, procedure="activation_procedures.no_such_reader")
    runtime = ActivationRuntime(clocked, clock=clock, empty_grace=GRACE, check_interval=LONG)
    starts: list[float] = []
    original = runtime.check

    def counting(queue: str) -> Decision | None:
        decision = original(queue)
        if decision is not None and decision.readers_started:
            starts.append(time.monotonic())
        return decision

    runtime.check = counting  # type: ignore[method-assign]
    send_jobs(clocked, [{"n": 1}])
    with caplog.at_level(logging.CRITICAL), started(runtime):
        wait_for(lambda: starts, "the first attempt")
        window = 0.5  # real seconds of watching the retries
        eventually(lambda: len(starts) > 5, timeout=window)
    rate = (len(starts) - 1) / max(starts[-1] - starts[0], 1e-3)
    assert len(starts) <= 5, (
        f"{len(starts)} starts of a procedure that cannot run, {rate:.0f} per second"
    )


def check_at_once(
    runtime: ActivationRuntime, barrier: threading.Barrier, decisions: list[Decision]
) -> None:
    barrier.wait(timeout=DEADLINE)
    decisions.append(decide(runtime))


def test_two_runtimes_checking_at_once_never_exceed_max_queue_readers(
    db_url: str, clocked: Broker, clock: FakeClock
) -> None:
    maximum = 3
    make_catalog(clocked, max_readers=maximum)
    ensure_monitor(clocked)
    other = Broker(db_url, clock=clock, migrate=False, timers=False)
    runtimes = [ActivationRuntime(b, clock=clock, empty_grace=GRACE) for b in (clocked, other)]
    try:
        send_jobs(clocked, [{"n": i, "hold": "after"} for i in range(20)])
        for step in range(maximum + 2):
            barrier = threading.Barrier(len(runtimes))
            decisions: list[Decision] = []

            threads = [
                threading.Thread(target=check_at_once, args=(r, barrier, decisions))
                for r in runtimes
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=DEADLINE)
            started_now = sum(d.readers_started for d in decisions)
            assert started_now == (1 if step < maximum else 0), decisions
            wait_for(started_count(min(step + 1, maximum)), f"reader {step + 1} to take work")
            clock.advance(GRACE)
        assert len(tasks(clocked)) == maximum
        assert {t["runtime_id"] for t in tasks(clocked)} <= {r.runtime_id for r in runtimes}
        procs.GATE.set()
        wait_for(lambda: not tasks(clocked), "the readers to drain and exit")
        assert sorted(numbers("done")) == list(range(20))
    finally:
        for runtime in runtimes:
            stop(runtime)
        other.close()


# --- processes -----------------------------------------------------------------------


@pytest.mark.slow
def test_reader_mode_process(
    clocked: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(procs.RECEIVE_TIMEOUT_ENV, "0.3")  # spawned readers inherit it
    out, gate = tmp_path / "out.txt", tmp_path / "gate"
    make_catalog(clocked, max_readers=1)
    runtime = ActivationRuntime(clocked, check_interval=LONG, reader_mode="process")
    with started(runtime):
        send_jobs(
            clocked,
            [
                {"n": i, "hold": "after", "gate_file": str(gate), "out_file": str(out)}
                for i in range(3)
            ],
        )
        [task] = wait_for(lambda: tasks(clocked), "a reader row")
        assert task["reader_name"].startswith("process-")
        assert task["process_id"] == os.getpid()  # the runtime that vouches for it
        gate.touch()
        wait_for(lambda: len(lines_of(out)) == 3, "the reader process's three messages", 60)
        lines = lines_of(out)
        pids = {line.split()[0] for line in lines}
        assert len(pids) == 1 and str(os.getpid()) not in pids
        assert sorted(int(line.split()[1]) for line in lines) == [0, 1, 2]
        wait_for(lambda: all_readers_gone(clocked, runtime), "the reader process to exit")


@pytest.mark.slow
def test_serve_starts_readers_and_stops_cleanly_on_sigterm(
    db_url: str, clocked: Broker, tmp_path: Path
) -> None:
    out, gate = tmp_path / "out.txt", tmp_path / "gate"
    make_catalog(clocked, max_readers=2)
    with serving(db_url) as server:
        wait_for(lambda: clocked.queue_monitors(), "serve to start its monitor", timeout=60)
        send_jobs(
            clocked, [{"n": 1, "hold": "after", "gate_file": str(gate), "out_file": str(out)}]
        )
        [task] = wait_for(lambda: tasks(clocked), "serve to start a reader")
        assert task["process_id"] == server.pid
        server.send_signal(signal.SIGTERM)
        gate.touch()  # the reader finishes its message, times out and leaves
        try:
            stdout, stderr = server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            masks = signal_masks(server.pid)
            server.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            stdout, stderr = server.communicate(timeout=10)
            pytest.fail(
                f"serve did not stop within 20 s of SIGTERM; signal state per thread:\n"
                f"{masks}\nits threads:\n{stderr}"
            )
        assert server.returncode == 0, stderr
        assert "stopped" in stdout
        assert tasks(clocked) == []
        assert out.read_text() == f"{server.pid} 1\n"


@pytest.mark.slow
def test_runtime_killed_with_sigkill_leaves_no_phantom_readers_after_heartbeat_expiry(
    db_url: str, tmp_path: Path
) -> None:
    expiry = 30.0
    clock = FakeClock(time.time())
    broker = Broker(db_url, clock=clock, timers=False)
    runtime = ActivationRuntime(broker, clock=clock, empty_grace=GRACE, heartbeat_expiry=expiry)
    try:
        make_catalog(broker, max_readers=1)
        with serving(db_url) as server:
            wait_for(lambda: broker.queue_monitors(), "serve to start its monitor", timeout=60)
            send_jobs(broker, [{"n": 1, "hold": "after", "gate_file": str(tmp_path / "never")}])
            [task] = wait_for(lambda: tasks(broker), "serve to start a reader")
            assert task["process_id"] == server.pid
            wait_for(lambda: monitor_row(broker)["messages_ready"] == 0, "the reader to receive")
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=10)
        clock.now = time.time()  # after the dead runtime's last heartbeat

        # The dead runtime's reader is a phantom: it still counts against the maximum.
        send_jobs(broker, [{"n": 2}])
        assert [t["process_id"] for t in tasks(broker)] == [server.pid]
        assert decide(runtime).readers_started == 0
        assert runtime.heartbeat() == 0  # not expired yet
        clock.advance(expiry + 1)
        assert runtime.heartbeat() == 1
        assert tasks(broker) == []
        # And the monitor starts a real reader for the waiting message at once.
        assert runtime.check(WORK) == Decision(WORK, True, 0, 1, 0)
        wait_for(lambda: all_readers_gone(broker, runtime), "the new reader to finish")
        assert numbers("done") == [2]
    finally:
        stop(runtime)
        broker.close()


def signal_masks(pid: int) -> str:
    """Each thread's name and pending / blocked / caught signal masks (Linux)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
            fields = ("Name", "State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt")
            lines.append(" ".join(f"{k}={status[k].strip()}" for k in fields))
    return "\n".join(lines)


def process_alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_reader_processes_do_not_outlive_a_runtime_killed_with_sigkill(
    db_url: str, clocked: Broker, tmp_path: Path
) -> None:
    """A reader process whose runtime died is nobody's reader: its row expires, so it
    must not go on receiving uncounted (another runtime would exceed the maximum)."""
    out, gate, pid_file = tmp_path / "out.txt", tmp_path / "gate", tmp_path / "pid"
    make_catalog(clocked, max_readers=1)
    reader_pid = None
    try:
        with serving(db_url, readers="process") as server:
            wait_for(lambda: clocked.queue_monitors(), "serve to start its monitor", timeout=60)
            common = {"out_file": str(out)}
            send_jobs(
                clocked,
                [
                    {"n": 1, "hold": "after", "gate_file": str(gate), "pid_file": str(pid_file)},
                    {"n": 2, **common},
                    {"n": 3, **common},
                ],
            )
            reader_pid = int(
                wait_for(lambda: pid_file.exists() and pid_file.read_text(), "a reader", 60)
            )
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=10)
        gone = eventually(lambda: not process_alive(reader_pid))
        gate.touch()  # were it still alive, the reader would go on with messages 2 and 3
        if not gone:
            eventually(lambda: monitor_row(clocked)["messages_ready"] < 2)
        left = monitor_row(clocked)["messages_ready"]
        assert gone and left == 2, (
            f"reader process {reader_pid} of the killed runtime "
            f"{'is still running' if not gone else 'exited'}; it went on to receive "
            f"{2 - left} of the 2 later messages"
        )
    finally:
        gate.touch()
        if reader_pid is not None and process_alive(reader_pid):
            os.kill(reader_pid, signal.SIGKILL)


def test_one_conversation_backlog_on_sqlite_gets_two_readers_at_most_in_real_time(
    sqlite_url: str,
) -> None:
    """As `scheduler-lib serve` runs it (real clock, default grace): on SQLite the second
    reader queues for the write lock and then takes the group the first just let go of —
    it was waiting for that group, as PostgreSQL's second reader waits on the locked
    group, so no third reader starts for a one-conversation backlog."""
    with Broker(sqlite_url) as broker:
        make_catalog(broker, max_readers=4)
        procs.RECEIVE_TIMEOUT = 1.0
        # 40 messages of 0.25 s of work inside the transaction: three graces of 3 s
        send_jobs(
            broker, [{"n": i, "hold": "tx", "work": 0.25} for i in range(40)], one_conversation=True
        )
        runtime = ActivationRuntime(broker).start()
        try:
            wait_for(lambda: len(numbers("done")) == 40, "the backlog to drain", timeout=60)
        finally:
            procs.GATE.set()
            runtime.stop()
        assert numbers("start") == list(range(40))
        assert max_concurrent_readers() <= 2, procs.events("enter")
