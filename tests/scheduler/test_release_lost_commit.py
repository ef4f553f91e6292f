"""release_scheduler when the answer to its END's commit is lost (a backend terminated
during COMMIT, seen in tests/integration/test_terminated_backends.py): the END may or may
not have committed, and release must neither raise nor leave the conversation open."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_lib.broker import Broker, ConnectionLost
from scheduler_lib.scheduler import TaskScheduler


@pytest.mark.parametrize("committed", [True, False])
def test_release_ends_the_conversation_when_its_commit_answer_is_lost(
    sched: Broker, scheduler: TaskScheduler, monkeypatch: pytest.MonkeyPatch, committed: bool
) -> None:
    # Given a scheduler, and a connection that loses the answer to the first END's commit
    handle = scheduler.get_scheduler()
    real_end = sched.end_conversation
    calls: list[Any] = []

    def end_losing_the_answer(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 1:
            if committed:  # it went through, only the answer was lost
                real_end(*args, **kwargs)
            raise ConnectionLost(
                "commit: the connection was lost while committing", committing=True
            )
        real_end(*args, **kwargs)

    monkeypatch.setattr(sched, "end_conversation", end_losing_the_answer)
    # When it is released
    scheduler.release_scheduler(handle)
    # Then release did not raise, ended again, and the initiator's side is ended
    assert len(calls) == 2
    mine = [
        e
        for e in sched.conversation_endpoints()
        if e.conversation_handle == handle.conversation_handle
    ]
    assert all(e.state != "CO" for e in mine), mine
