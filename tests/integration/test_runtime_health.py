"""What /healthz's ``readers`` check reads: an activation runtime whose supervisor is
stuck in a call (a database call that never returns) is reported, by name, once its turn
has lasted past the grace; one that turns is not, whatever its calls fail with."""

from __future__ import annotations

import threading

from multiproc import poll

from scheduler_lib.broker import Broker
from scheduler_lib.broker.activation import ActivationRuntime

INTERVAL = 0.05  # seconds between the supervisor's turns here
GRACE = 0.5  # seconds a turn may take before the runtime counts as stalled


def test_a_supervisor_stuck_in_a_call_is_reported_and_a_turning_one_is_not(
    sqlite_url: str,
) -> None:
    with Broker(sqlite_url) as broker:
        runtime = ActivationRuntime(
            broker, check_interval=INTERVAL, heartbeat_interval=INTERVAL
        ).start()
        release = threading.Event()
        try:
            # Given a runtime that turns: nothing stalled, even past the grace
            poll(lambda: len(runtime._turns) == 2, 10, "both loops turned once")
            release.wait(GRACE + 4 * INTERVAL)
            assert runtime.stalled_loops(grace=GRACE) == []
            # When its supervisor's next call hangs
            sync = runtime._sync_monitors
            runtime._sync_monitors = lambda: (release.wait(60), sync())  # type: ignore[method-assign]
            # Then it is reported by name once the turn outlasts the grace
            stalled = poll(
                lambda: runtime.stalled_loops(grace=GRACE), 10, "the supervisor reported"
            )
            assert len(stalled) == 1 and stalled[0].startswith("activation-supervisor (no turn")
            # And once the call returns, it turns again and is not
            release.set()
            poll(lambda: runtime.stalled_loops(grace=GRACE) == [], 10, "the supervisor turns")
        finally:
            release.set()
            runtime.stop(5)
