"""A connection's frame numbers must rise (frames.ReplayGuard)."""

from __future__ import annotations

import pytest

from scheduler_lib.broker.transport import frames


def test_rising_numbers_are_accepted_and_none_twice() -> None:
    guard = frames.ReplayGuard()
    assert not guard.accept(0)  # the CONFIRM's number, taken by the handshake
    assert [guard.accept(n) for n in (1, 2, 3)] == [True, True, True]
    assert [guard.accept(n) for n in (1, 2, 3)] == [False, False, False]


def test_a_gap_is_accepted_and_what_it_skipped_is_not() -> None:
    # A corrupted frame dropped on the way leaves a gap; nothing may fill it later.
    guard = frames.ReplayGuard()
    assert guard.accept(1) and guard.accept(3)
    assert not guard.accept(2)
    assert guard.accept(4)


def test_a_huge_number_is_just_a_number() -> None:
    guard = frames.ReplayGuard()
    assert guard.accept(10**30)
    assert not guard.accept(10**30) and not guard.accept(5)
    assert guard.accept(10**30 + 1)


@pytest.mark.parametrize("number", [None, -1, True, 1.0, "1", [1]])
def test_a_frame_without_a_proper_number_is_garbage(number: object) -> None:
    with pytest.raises(frames.GarbageFrame, match="frame number"):
        frames.ReplayGuard().accept(number)
