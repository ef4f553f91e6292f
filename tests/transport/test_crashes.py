"""Either broker's process killed with SIGKILL mid-run and restarted: nothing lost, nothing
duplicated. The endpoints run as real ``scheduler-lib serve --listen`` processes behind
a faulty proxy; the test process sends into broker A's database while they run."""

from __future__ import annotations

import collections
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultproxy import FaultProxy, Faults
from multiproc import poll
from transport_catalog import CONTRACT, INITIATOR, KEY, REQUEST, TARGET, free_port
from transport_catalog import TARGET_QUEUE as B_QUEUE

from bench.processes import Processes
from scheduler_lib.broker import Broker

CONVERSATIONS = 100
PER_CONVERSATION = 100  # 10,000 messages, sent while the processes are killed
FAULTS = Faults(drop=0.01, duplicate=0.01, reorder=0.01, corrupt=0.005, delay=0.01)


class Serve:
    """``scheduler-lib serve --listen`` in a process of its own, restartable; stopped with
    the ``processes`` it is started in."""

    def __init__(self, processes: Processes, url: str, port: int, advertise: str) -> None:
        self.processes, self.name = processes, f"serve-{port}"
        self.args = ["serve", "--db", url, "--listen", f"127.0.0.1:{port}"]
        self.args += ["--advertise", advertise, "--retry-initial", "0.3", "--retry-max", "2"]
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.process = self.processes.start(f"{self.name}-{self.starts}", *self.args)
        self.processes.wait_said(self.process, "listening at", 60)

    def kill(self) -> None:
        assert self.process is not None
        self.processes.kill(self.process)


@pytest.fixture
def serving(
    pair: tuple[Broker, Broker], pair_urls: tuple[str, str], tmp_path: Path
) -> Iterator[tuple[Serve, Serve]]:
    a, b = pair
    port_a, port_b = free_port(), free_port()
    with (
        FaultProxy(("127.0.0.1", port_b), FAULTS, seed=3) as to_b,
        FaultProxy(("127.0.0.1", port_a), FAULTS, seed=4) as to_a,
        Processes(tmp_path, {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": KEY}) as processes,
    ):
        a.create_route("to target", TARGET, to_b.address)
        b.create_route("to initiator", INITIATOR, to_a.address)
        serve_a = Serve(processes, pair_urls[0], port_a, to_a.address)
        serve_b = Serve(processes, pair_urls[1], port_b, to_b.address)
        serve_a.start()
        serve_b.start()
        yield serve_a, serve_b


@pytest.mark.slow
def test_killing_either_broker_mid_run_loses_and_duplicates_nothing(
    pair: tuple[Broker, Broker], serving: tuple[Serve, Serve]
) -> None:
    a, b = pair
    serve_a, serve_b = serving
    total = CONVERSATIONS * PER_CONVERSATION
    handles = [a.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(CONVERSATIONS)]
    failures: list[BaseException] = []
    b_killed = threading.Event()

    def send() -> None:  # ten messages per conversation at a time, round after round
        try:
            for start in range(0, PER_CONVERSATION, 10):
                if start >= PER_CONVERSATION * 6 // 10:
                    # The last rounds wait for B's kill, so that both kills fall mid-run
                    # however fast the first rounds went through (a loaded machine's
                    # polls of B's queue could otherwise see the last of them arrive).
                    b_killed.wait(180)
                for n, handle in enumerate(handles):
                    a.send_many(handle, REQUEST, [f"{n}:{i}" for i in range(start, start + 10)])
        except BaseException as exc:
            failures.append(exc)

    def arrived() -> int:
        return len(b.peek(B_QUEUE))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    # Given messages flowing, when A's process is killed and restarted
    poll(lambda: arrived() >= total // 4, 120, "a quarter arrived")
    serve_a.kill()
    assert arrived() < total  # killed mid-run, not after it
    serve_a.start()
    # ... and then B's
    poll(lambda: arrived() >= total // 2, 120, "half arrived")
    serve_b.kill()
    assert arrived() < total
    b_killed.set()
    serve_b.start()
    sender.join(timeout=120)
    assert not failures, failures
    # Then every message arrives exactly once, in order per conversation
    poll(lambda: arrived() >= total, 180, f"all {total} arrived")
    poll(lambda: not a.transmission_queue(), 60, "A's transmission queue empties")
    messages = b.peek(B_QUEUE)
    assert len(messages) == total
    by_conversation: dict[str, list[str]] = collections.defaultdict(list)
    for m in messages:  # peek lists each conversation in sequence order
        by_conversation[str(m.conversation_handle)].append((m.body or b"").decode())
    assert len(by_conversation) == CONVERSATIONS
    for bodies in by_conversation.values():
        n = bodies[0].split(":")[0]
        assert bodies == [f"{n}:{i}" for i in range(PER_CONVERSATION)]
